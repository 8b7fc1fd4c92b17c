"""Ragged RL batches end to end (issue 48): prompts of different lengths, rows that end early at a stop
token (an EOS), through every algorithm x routing mode, packed and padded.

Real batches are ragged in every step: ``total_len - 1`` differs from row to row and from the padded
length. The engine here is the run's own embedded engine (fp32: it shares the trainer's weights), with
a stop token added that some of the step's rows sample and others do not (:class:`RaggedEngine`), so
every row it returns is one the engine computed itself: its log-probs, routes and gates, its
``finish_reason``, the cache compaction of the rows that ended. At fp32 the trainer's pi_old pass
recomputes exactly what the engine computed, so on every such batch:

- ``batch.lens_B`` (the input positions the packed forwards compute) is the engine's
  ``total_len - 1``, ``valid_BS`` those positions and ``mask_BT`` the engine's response tokens;
- pi_old's log-probs equal the engine's on every response token; ``flip/rollout_vs_trainer`` is
  exactly 0 (the engine's routes against the trainer's own, valid positions only: the engine's
  padding rows are zeros);
- padding reaches no metric and no loss: the same step on the same batch with its padding
  poisoned (other token ids past ``total_len``, other log-probs off the response, other routes and
  gates past ``total_len - 1``) gives the same metrics and the same weights.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.trainer.rl import rl_step
from moe_rl.trainer.timer import StepTimer
from tests.tiny import TINY_RL

pytestmark = pytest.mark.usefixtures("one_thread")

RAGGED: dict = {
    **TINY_RL,
    "task": {"name": "arithmetic", "arithmetic": {"min_operands": 2, "max_operands": 3, "digits": 2}},
    "train": {**TINY_RL["train"], "prompts_per_step": 2, "group_size": 3, "max_new_tokens": 8},
}
"""TINY_RL with prompts of 2 or 3 operands of 1 or 2 digits (lengths differ) and 2 x 3 rows of up to 8
new tokens."""


def stop_token(ro) -> int:
    """The response token that, as a stop token, makes the batch most ragged: some rows end at it
    before their last token, others never sample it (they run to ``max_new_tokens``)."""
    tokens, plen, tlen = ro.tokens_BT.tolist(), ro.prompt_lens_B.tolist(), ro.total_lens_B.tolist()
    responses = [row[p:t] for row, p, t in zip(tokens, plen, tlen)]
    best, best_key = None, None
    for tok in sorted({x for r in responses for x in r}):
        ends = [p + r.index(tok) + 1 if tok in r else t for r, p, t in zip(responses, plen, tlen)]
        early = sum(e < t for e, t in zip(ends, tlen))
        if early == 0 or early == len(ends):
            continue
        key = (len(set(ends)), early)
        if best_key is None or key > best_key:
            best, best_key = tok, key
    assert best is not None, "no response token stops some rows and not others: change RAGGED's seed"
    return best


class RaggedEngine:
    """The run's engine with one more stop token (:func:`stop_token` of the batch it would return
    without it, found once per prompts and seed: ``stops``): some rows end early (``finish_reason``
    "stop"), others run to ``max_new_tokens``. ``poison``: the batch's padding is overwritten (what
    no metric and no loss may read), valid positions untouched. Keeps what it returned
    (``rollouts``)."""

    def __init__(self, engine, vocab: int, stops: dict, *, poison: bool = False):
        self.engine, self.vocab, self.stops, self.poison = engine, vocab, stops, poison
        self.name = "ragged"
        self.rollouts = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, n, sampling):
        key = (tuple(map(tuple, prompts)), n, sampling.seed)
        if key not in self.stops:
            self.stops[key] = stop_token(self.engine.generate(prompts, n, sampling))
        sampling = dataclasses.replace(sampling, stop_token_ids=(*sampling.stop_token_ids, self.stops[key]))
        ro = self.engine.generate(prompts, n, sampling)
        self.rollouts = poisoned(ro, self.vocab) if self.poison else ro
        return self.rollouts


def poisoned(ro, vocab: int):
    """``ro`` with everything outside its valid positions replaced: token ids past ``total_len``,
    log-probs off the response, routes (K distinct experts, other than the engine's zeros) and gates
    past ``total_len - 1``."""
    g = torch.Generator().manual_seed(1234)
    b, t = ro.tokens_BT.shape
    pos_T = torch.arange(t)
    past_BT = pos_T[None, :] >= ro.total_lens_B[:, None]
    tokens_BT = torch.where(past_BT, torch.randint(0, vocab, (b, t), generator=g), ro.tokens_BT)
    logp_BT = torch.where(ro.response_mask_BT.bool(), ro.logprobs_BT, -5 * torch.rand(b, t, generator=g))
    changes = {"tokens_BT": tokens_BT, "logprobs_BT": logp_BT}
    if ro.routes_BTLK is not None:
        _, _, layers, k = ro.routes_BTLK.shape
        experts = int(ro.routes_BTLK.max()) + 1
        pad_BT = pos_T[None, :] >= (ro.total_lens_B[:, None] - 1)
        other = torch.rand(b, t, layers, max(experts, k + 1), generator=g).argsort(-1)[..., :k]
        changes["routes_BTLK"] = torch.where(
            pad_BT[..., None, None], other.to(ro.routes_BTLK), ro.routes_BTLK
        )
        if ro.gates_BTLK is not None:
            noise = torch.rand(ro.gates_BTLK.shape, generator=g)
            changes["gates_BTLK"] = torch.where(pad_BT[..., None, None], noise, ro.gates_BTLK)
    return dataclasses.replace(ro, **changes)


@pytest.fixture(scope="module")
def ragged_run(tmp_path_factory, parallel_info):
    """One Run of :data:`RAGGED` (its policy, engine and optimizer) for every case, its initial
    weights (every case starts from them: its batch is the same whichever cases ran before) and the
    stop tokens found (:class:`RaggedEngine`)."""
    from tests.tiny import ready_run

    run = ready_run(tmp_path_factory.mktemp("ragged") / "run", base=RAGGED)
    yield run, [p.detach().clone() for p in run.policy.model.parameters()], {}
    run.close()


def _step(ragged_run, algo: dict, packing: bool, *, poison: bool):
    """RL step 0 of the run derived with ``algo`` and ``train.packing``, from its initial weights
    with fresh Adam moments, on the ragged engine: (step result, the engine's rollouts, weights
    after)."""
    run, weights, stops = ragged_run
    with torch.no_grad():
        for p, w in zip(run.policy.model.parameters(), weights):
            p.copy_(w)
    engine = RaggedEngine(run.engine, run.recipe.model.vocab_size, stops, poison=poison)
    derived = run.derive(
        algo=dataclasses.replace(run.recipe.algo, **algo),
        train=dataclasses.replace(run.recipe.train, packing=packing),
        new_optimizer=True,
        engine=engine,
        engine_gives_routes=True,  # routes from the engine in every mode: flip/rollout_vs_trainer
    )
    try:
        res = rl_step(derived, 0, StepTimer())
    finally:
        derived.close()
    return res, engine.rollouts, [p.detach().clone() for p in run.policy.model.parameters()]


MODES = [
    *((name, routing, False) for name in ("grpo", "gspo", "gspo_token") for routing in ("none", "r2", "r3")),
    ("grpo", "r3", True),  # R3 with the engine's gate weights replayed
]
"Every algorithm x routing mode, and R3 with replayed gates: (algo.name, algo.routing, gates)."


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize(
    "name,routing,gates", MODES, ids=[f"{n}-{r}{'-gates' if g else ''}" for n, r, g in MODES]
)
def test_a_ragged_batch_trains_on_its_valid_positions_only(
    ragged_run, monkeypatch, name, routing, gates, packing
):
    """The invariants of the module docstring on one RL step of a ragged batch. Planted bugs
    killed (tools/mutate.py; the first three pass test_rl_e2e.py and test_wiring.py): valid
    positions counted to the padded length; flip/rollout_vs_trainer over every position; the loss
    mask taken to the padded width; the entropy and the mismatch metrics summed over padding."""
    from moe_rl.tasks.arithmetic import ArithmeticTask

    # rewards that differ within a group (the response's length): a step that trains
    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text)))
    start = ragged_run[1]
    algo = {"name": name, "routing": routing, "replay_gate_weights": gates}
    res, ro, after = _step(ragged_run, algo, packing, poison=False)
    b, m = res.batch, res.metrics

    # the batch is ragged: prompts of several lengths, rows ended early at the stop token, others not
    total_B = ro.total_lens_B.cpu()
    assert len(set(ro.prompt_lens_B.tolist())) > 1, ro.prompt_lens_B
    assert {"stop", "length"} <= set(ro.finish_reasons), ro.finish_reasons
    assert len(set(total_B.tolist())) > 2 and int(total_B.min()) < ro.tokens_BT.shape[1], total_B

    # the trainer's positions are the engine's
    s = ro.tokens_BT.shape[1] - 1
    assert torch.equal(b.lens_B.cpu(), total_B - 1)
    assert torch.equal(b.valid_BS.bool().cpu(), torch.arange(s)[None, :] < (total_B[:, None] - 1))
    assert torch.equal(b.mask_BT.cpu(), ro.response_mask_BT.cpu())
    # pi_old's log-probs are the engine's; so are its routes, exactly
    mask = ro.response_mask_BT.bool().cpu()
    torch.testing.assert_close(b.old_logp_BT.cpu()[mask], ro.logprobs_BT.cpu()[mask], rtol=0, atol=2e-5)
    assert m["mismatch/abs_log_ratio"] < 2e-5, m["mismatch/abs_log_ratio"]
    assert m["flip/rollout_vs_trainer/rate"] == 0.0, m["flip/rollout_vs_trainer/rate"]
    assert m["response/len_mean"] == pytest.approx(float(mask.sum(1).double().mean()))

    # padding reaches no metric and no loss: the same step on the batch with its padding poisoned
    res_p, ro_p, after_p = _step(ragged_run, algo, packing, poison=True)
    pad = ~(torch.arange(s + 1)[None, :] < total_B[:, None])
    assert bool((ro_p.tokens_BT.cpu()[pad] != ro.tokens_BT.cpu()[pad]).any()), "nothing was poisoned"
    assert torch.equal(res_p.batch.tokens_BT.cpu()[~pad], ro.tokens_BT.cpu()[~pad])
    exact = packing  # packed forwards never compute a padding position; padded ones do (rounding)
    tol = {"rel": 0, "abs": 0} if exact else {"rel": 1e-5, "abs": 1e-6}
    weight_atol = 0 if exact else 1e-5
    keys = [k for k in m if not k.startswith("time/") and k != "tokens_per_s"]
    assert sorted(keys) == sorted(
        k for k in res_p.metrics if not k.startswith("time/") and k != "tokens_per_s"
    )
    differ = {k: (m[k], res_p.metrics[k]) for k in keys if res_p.metrics[k] != pytest.approx(m[k], **tol)}
    assert not differ, f"metrics read the padding: {differ}"
    for w, w_p in zip(after, after_p):
        torch.testing.assert_close(w_p, w, rtol=tol["rel"], atol=weight_atol)
    assert any(not torch.equal(w, w0) for w, w0 in zip(after, start)), (
        "the step did not train",
        {k: m[k] for k in ("lr", "grad_norm", "adv/abs_mean", "optim/skipped_updates") if k in m},
    )
