"""The RL step's wiring, pinned by its effect (issue 34): which routes the training forward
actually replays, which correction weights the loss actually gets, what the flip instruments
compare, and which weights reach the engine. Each test names the planted bug it kills."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_rl.trainer.hooks import StepHook
from moe_rl.trainer.rl import rl_step
from moe_rl.trainer.run import Run
from moe_rl.trainer.timer import StepTimer
from tests.tiny import ready_run

FORCED = (0, 1)
"The experts the wrapped engine reports for layer 0 of every token (tiny model: 4 experts, top-2)."


class ReportingEngine:
    """The run's engine, whose rollouts are changed on purpose and kept: layer 0's routes forced to
    :data:`FORCED` (``force_routes``), the log-probs moved (``shift_logp``)."""

    def __init__(self, engine, *, force_routes: bool = False, shift_logp: float = 0.0):
        self.engine, self.force_routes, self.shift_logp = engine, force_routes, shift_logp
        self.name = "reporting"
        self.rollouts = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, n, sampling):
        ro = self.engine.generate(prompts, n, sampling)
        changes = {}
        if self.force_routes:
            routes = ro.routes_BTLK.clone()
            routes[:, :, 0, :] = torch.tensor(FORCED, dtype=routes.dtype)
            changes["routes_BTLK"] = routes
        if self.shift_logp:
            g = torch.Generator().manual_seed(0)
            noise = torch.rand(ro.logprobs_BT.shape, generator=g) * self.shift_logp
            changes["logprobs_BT"] = ro.logprobs_BT - noise.to(ro.logprobs_BT)
        self.rollouts = dataclasses.replace(ro, **changes) if changes else ro
        return self.rollouts


def _run(
    tmp_path, *, train: dict | None = None, optim: dict | None = None, rollout: dict | None = None, **algo
) -> Run:
    return ready_run(tmp_path / "run", algo=algo, train=train or {}, optim=optim or {}, rollout=rollout or {})


@pytest.mark.parametrize("routing", ["none", "r2", "r3"])
def test_the_training_forward_replays_what_the_mode_names(tmp_path, parallel_info, routing):
    """The engine reports layer-0 routes that differ from the trainer's own (forced to experts 0
    and 1). Under R3 the training forward's router selects exactly those on every token; under R2
    (pi_old's recorded routes) and with no replay (the router's own top-k) it does not.
    Planted bug killed: R3 replaying the trainer's own pi_old routes (the R2 ones) instead of the
    engine's (``trainer/rl.py``, where the replay routes are chosen)."""
    run = _run(tmp_path, routing=routing)
    try:
        derived = run.derive(engine=ReportingEngine(run.engine, force_routes=True), engine_gives_routes=True)
        maps = []
        hook = run.policy.routers[0].register_forward_hook(
            lambda m, a, o: maps.append(o[1].detach().clone()) if torch.is_grad_enabled() else None
        )
        try:
            rl_step(derived, 0, StepTimer())
        finally:
            hook.remove()
        assert maps, "no training forward ran"
        chosen = torch.cat(maps)  # [tokens, experts] routing map of every training forward
        forced = torch.zeros(chosen.shape[1], dtype=torch.bool)
        forced[list(FORCED)] = True
        on_forced = (chosen == forced).all(dim=1)
        if routing == "r3":
            assert on_forced.all(), (
                f"{int((~on_forced).sum())} of {len(on_forced)} tokens not on the engine's routes"
            )
        else:
            assert not on_forced.all(), "the engine's routes were replayed without R3"
    finally:
        derived.close()
        run.close()


@pytest.mark.parametrize("method", ["tis", "icepop", "icepop_mask"])
def test_the_correction_weights_are_the_hand_formula_of_the_batch(tmp_path, parallel_info, method):
    """With the engine's log-probs moved off the trainer's, the step's weights equal the formula
    on that batch: rho = pi_old / pi_roll per token, TIS ``min(rho, C)``, IcePop
    ``rho * 1[low <= rho <= high]``, icepop_mask ``1[low <= rho <= high]``; so do its ``mismatch/*``
    and ``correction/*`` metrics. Planted bugs killed: the weights built with pi_old and pi_roll
    swapped (rho inverted); IcePop weighting a kept token by 1 (the mask alone) instead of by rho;
    the mismatch metrics with pi_old and pi_roll swapped."""
    bounds = {"correction_low": 0.5, "correction_high": 1.5} if method.startswith("icepop") else {}
    run = _run(
        tmp_path, name="grpo", rollout_correction=method, correction_c=1.5, old_logprobs="recompute", **bounds
    )
    try:
        engine = ReportingEngine(run.engine, shift_logp=0.8)
        derived = run.derive(engine=engine)
        res = rl_step(derived, 0, StepTimer())
        b, ro = res.batch, engine.rollouts
        assert torch.equal(b.tokens_BT.cpu(), ro.tokens_BT.cpu())  # the batch is these rollouts, in order
        mask = b.mask_BT.bool().cpu()
        rho = torch.exp(b.old_logp_BT.detach().double().cpu() - ro.logprobs_BT.double().cpu())
        algo = derived.recipe.algo
        if method == "tis":
            want = torch.clamp(rho, max=algo.correction_c)
        else:
            low, high = algo.correction_bounds
            keep = ((rho >= low) & (rho <= high)).double()
            want = rho * keep if method == "icepop" else keep
        got = b.is_weights.double().cpu()
        if method != "icepop_mask":  # rho itself on some tokens, something else on others
            assert (want[mask] != rho[mask]).any() and (want[mask] == rho[mask]).any()
        if method != "tis":  # both sides of a bound; kept ratios far enough from 1 to tell rho from 1
            kept = mask & (keep == 1)
            assert kept.any() and (mask & (keep == 0)).any()
            assert (rho[kept] - 1).abs().max() > 0.2
        torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-6)
        m = res.metrics
        n = int(mask.sum())
        assert m["correction/masked_frac"] == pytest.approx(float((want[mask] == 0).sum()) / n, rel=1e-5)
        assert m["correction/weight_mean"] == pytest.approx(float(want[mask].sum()) / n, rel=1e-4)
        # the step's mismatch metrics, by hand from the same batch
        # (docs/algorithms.md#mismatch-metrics): rho = pi_old / pi_roll over response tokens
        log_rho = torch.log(rho)
        per_seq = torch.where(mask, log_rho, 0.0).sum(1)[mask.any(1)]
        by_hand = {
            "mismatch/abs_log_ratio": float(log_rho[mask].abs().mean()),
            "mismatch/k3": float((rho - 1 - log_rho)[mask].mean()),
            "mismatch/extreme_frac": float((log_rho[mask].abs() > math.log(2)).double().mean()),
            "mismatch/seq_log_ratio_abs_max": float(per_seq.abs().max()),
        }
        assert by_hand["mismatch/k3"] > 0.01, by_hand  # the engine's log-probs were moved
        for key, v in by_hand.items():
            assert m[key] == pytest.approx(v, rel=1e-4, abs=1e-6), (key, m[key], v)
    finally:
        derived.close()
        run.close()


def test_drift_is_measured_against_pi_olds_natural_routes_not_the_replayed_ones(tmp_path, parallel_info):
    """Under R3 with the engine's layer-0 routes forced away from the trainer's, the engine and the
    trainer disagree on most layer-0 decisions, yet ``flip/drift`` (pi_old's natural routes against
    the current natural routes, a few small updates apart) stays small. Planted bug killed: drift
    compared against the replayed routes (it then reads the forced disagreement)."""
    run = _run(tmp_path, routing="r3")
    try:
        derived = run.derive(engine=ReportingEngine(run.engine, force_routes=True), engine_gives_routes=True)
        m = rl_step(derived, 0, StepTimer()).metrics
        assert m["flip/rollout_vs_trainer/rate"] > 0.15, m["flip/rollout_vs_trainer/rate"]  # forced apart
        assert m["flip/drift/rate"] < 0.05, m["flip/drift/rate"]
    finally:
        derived.close()
        run.close()


class NaturalMaps(StepHook):
    """Every row's natural routing maps, by a plain padded forward of the batch (no routing session,
    no replay) at pi_old's weights (``begin``) and after every optimizer step: ``versions[j]``
    holds, per row, the ``[positions, layers, experts]`` boolean map of the experts each router
    chose for the row's input positions (``t < total_len - 1``; causal: padding after them does
    not reach them)."""

    def __init__(self) -> None:
        self.versions: list[list[torch.Tensor]] = []

    def begin(self, run, step, batch) -> None:
        self.versions.append(self.maps(run, batch))

    def __call__(self, event) -> None:
        self.versions.append(self.maps(event.run, event.batch))

    @staticmethod
    def maps(run, batch) -> list[torch.Tensor]:
        per_layer: list[torch.Tensor] = []
        hooks = [
            r.register_forward_hook(lambda m, a, o: per_layer.append(o[1].detach().cpu().clone()))
            for r in run.policy.routers
        ]
        inputs_BS = batch.tokens_BT[:, :-1]
        b, s = inputs_BS.shape
        try:
            with torch.no_grad():
                run.policy.logits(inputs_BS)
        finally:
            for h in hooks:
                h.remove()
        maps_BSLE = torch.stack([x.view(s, b, -1).transpose(0, 1) for x in per_layer], dim=2).bool()
        return [maps_BSLE[i, : int(n)] for i, n in enumerate(batch.valid_BS.sum(1))]


def _flips(a: list[torch.Tensor], b: list[torch.Tensor], k: int) -> tuple[torch.Tensor, int, int, int]:
    """docs/algorithms.md#expert-flip-rate by hand: per layer, the sum over tokens of
    ``1 - |R_a & R_b| / K``; the (token, layer) routers whose expert set changed; the tokens whose
    set changed in some layer; the tokens."""
    flip_L = sum(((k - (x & y).sum(-1)).double() / k).sum(0) for x, y in zip(a, b))
    routers = sum(int((x != y).any(-1).sum()) for x, y in zip(a, b))
    any_flip = sum(int(((x != y).any(-1)).any(-1).sum()) for x, y in zip(a, b))
    return flip_L, routers, any_flip, sum(x.shape[0] for x in a)


def _rates(prefix: str, pieces: list[tuple[torch.Tensor, int, int, int]]) -> dict[str, float]:
    flip_L = sum(p[0] for p in pieces)
    tokens = sum(p[3] for p in pieces)
    out = {
        f"{prefix}/rate": float(flip_L.mean()) / tokens,
        f"{prefix}/router_rate": sum(p[1] for p in pieces) / (tokens * len(flip_L)),
        f"{prefix}/token_any": sum(p[2] for p in pieces) / tokens,
    }
    out.update({f"{prefix}/layer_{i}": float(v) / tokens for i, v in enumerate(flip_L)})
    return out


@pytest.fixture
def varied_rewards(monkeypatch):
    """Rewards that differ within a group (the response's length, odd or even): updates with a
    gradient, from the untrained policy too."""
    from moe_rl.tasks.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text) % 2))


@pytest.mark.parametrize("every", [1, 2])
def test_flip_step_and_drift_are_the_flips_of_natural_routes_recomputed_by_hand(
    tmp_path, parallel_info, varied_rewards, every
):
    """``flip/step`` and ``flip/drift`` of one RL step of 4 optimizer steps (4 minibatches of 2
    rows, a probe after every ``every``-th update) against the same rates computed here, by hand,
    from a plain forward of the batch at each weight version W_0 (pi_old) .. W_4
    (docs/algorithms.md#expert-flip-rate):

    - ``flip/step``: the probe rows' (the first ``flip_probe_sequences``) routes at
      W_(j-every) against W_j, for j = every, 2 every, .. 4;
    - ``flip/drift``: minibatch j's rows at W_0 (pi_old) against W_j, the weights its training
      forward ran at (0 for the first minibatch);
    - ``flip/rollout_vs_trainer``: the engine's routes against W_0's.

    The engine reports layer-0 routes forced away from the trainer's (not replayed: routing
    ``none``, whose training forwards route naturally), so a drift measured against the engine's
    routes reads that disagreement. The learning rate is large enough that routes flip.
    Planted bugs killed: the probe's reference never advanced (``flip/step`` reads W_0 -> W_j,
    cumulative drift), ``train.flip_probe_every`` ignored, and ``flip/drift`` compared against
    the replayed (here the engine's) routes instead of pi_old's natural ones."""
    minibatches, probe = 4, 3
    run = _run(
        tmp_path,
        routing="none",
        train={"minibatches": minibatches, "flip_probe_sequences": probe, "flip_probe_every": every},
        optim={"lr": 3e-3},
    )
    try:
        engine = ReportingEngine(run.engine, force_routes=True)
        derived = run.derive(engine=engine, engine_gives_routes=True)
        maps = derived.add_hook(NaturalMaps())
        m = rl_step(derived, 0, StepTimer()).metrics
        w = maps.versions
        assert len(w) == minibatches + 1, len(w)
        k, rows = derived.recipe.model.moe_router_topk, len(w[0])
        per = rows // minibatches
        probed = range(every, minibatches + 1, every)  # the optimizer steps the probe follows
        want = _rates("flip/step", [_flips(w[j - every][:probe], w[j][:probe], k) for j in probed])
        want |= _rates(
            "flip/drift",
            [
                _flips(w[0][j * per : (j + 1) * per], w[j][j * per : (j + 1) * per], k)
                for j in range(minibatches)
            ],
        )
        # the engine's routes (row t: input token t) as maps, against pi_old's natural ones
        e = w[0][0].shape[-1]
        routes = engine.rollouts.routes_BTLK.long().cpu()
        engine_maps = [
            torch.nn.functional.one_hot(routes[i, : len(x)], e).sum(-2).bool() for i, x in enumerate(w[0])
        ]
        want |= _rates("flip/rollout_vs_trainer", [_flips(engine_maps, w[0], k)])
        assert want["flip/step/rate"] > 0.01 and want["flip/drift/rate"] > 0.01, want  # routes did flip
        assert want["flip/rollout_vs_trainer/rate"] > 0.15, want  # the engine's layer 0 forced apart
        for key, v in want.items():
            assert m[key] == pytest.approx(v, abs=1e-6), (key, m[key], v)
    finally:
        derived.close()
        run.close()


class PushCounter:
    """The run's engine, counting the weight pushes it receives."""

    def __init__(self, engine):
        self.engine, self.pushes = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update_weights(self, source, version):
        self.pushes.append(version)
        return self.engine.update_weights(source, version)


def test_non_finite_weights_are_never_pushed_to_the_engine(tmp_path, parallel_info, varied_rewards):
    """docs/safety.md, "Only good weights are saved": an RL step whose updates leave a weight NaN
    pushes nothing to the rollout engine (``weights/finite`` 0), whose own bf16 copy stays finite
    and keeps serving the last good version; a healthy step pushes. Planted bug killed: the push
    made whatever the weights are."""

    def poison(event):
        if event.step == 1 and event.minibatch == event.minibatches - 1:  # after the last update
            with torch.no_grad():
                next(event.run.policy.model.parameters()).view(-1)[0] = float("nan")

    run = _run(tmp_path, rollout={"dtype": "bf16"})
    try:
        engine = PushCounter(run.engine)
        derived = run.derive(engine=engine)
        derived.add_hook(poison)
        m0 = rl_step(derived, 0, StepTimer()).metrics
        assert m0["weights/finite"] == 1.0 and engine.pushes == ["2"], engine.pushes  # a healthy step pushes
        m1 = rl_step(derived, 1, StepTimer()).metrics
        assert m1["weights/finite"] == 0.0
        assert engine.pushes == ["2"], engine.pushes  # no push of the NaN weights
        assert all(bool(torch.isfinite(p).all()) for p in engine.engine.policy.model.parameters())
    finally:
        derived.close()
        run.close()
