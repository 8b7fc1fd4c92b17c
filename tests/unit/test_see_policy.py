"""See the policy (issue 33, item 3): the expert load metrics by hand, and the RL step's samples
and expert load pinned by their effect. Each test names the planted bug it kills."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from moe_rl.routing.load import expert_load_counts, expert_load_metrics, router_entropy_N

# 4 tokens, 2 layers, top-2 of 4 experts; token 3 is masked out (padding)
ROUTES_NLK = torch.tensor(
    [
        [[0, 1], [1, 2]],
        [[0, 2], [3, 0]],
        [[1, 0], [2, 1]],
        [[3, 2], [3, 3]],
    ]
)
MASK_N = torch.tensor([1.0, 1.0, 1.0, 0.0])


def test_expert_load_of_hand_built_routes():
    """Layer 0 loads (valid tokens 0-2): experts 0..3 get 3, 2, 1, 0 assignments (mean 6/4 = 1.5):
    imbalance 3 / 1.5 = 2, expert 3 dead. Layer 1: 1, 2, 2, 1: imbalance 2 / 1.5 = 4/3. Mean
    imbalance 5/3; dead share 1 of 8 (layer, expert) pairs; router entropy the mean of the valid
    tokens' entropies over both layers. Planted bugs killed: the masked token counted; the
    imbalance as max / min or (max - mean) / mean; dead experts counted over experts of any layer
    (1/4) instead of (layer, expert) pairs; the entropy averaged over every token."""
    entropy_NL = torch.tensor([[0.5, 1.0], [0.25, 0.75], [1.5, 0.5], [9.0, 9.0]])
    counts = expert_load_counts(ROUTES_NLK, 4, MASK_N, entropy_NL)
    assert counts["load_LE"].tolist() == [[3, 2, 1, 0], [1, 2, 2, 1]]
    m = expert_load_metrics(counts)
    assert m["experts/load_imbalance/layer_0"] == pytest.approx(2.0)
    assert m["experts/load_imbalance/layer_1"] == pytest.approx(4 / 3)
    assert m["experts/load_imbalance"] == pytest.approx(5 / 3)
    assert m["experts/dead_frac"] == pytest.approx(1 / 8)
    assert m["experts/router_entropy"] == pytest.approx((0.5 + 1.0 + 0.25 + 0.75 + 1.5 + 0.5) / 6)
    assert set(m) == {
        "experts/load_imbalance",
        "experts/load_imbalance/layer_0",
        "experts/load_imbalance/layer_1",
        "experts/dead_frac",
        "experts/router_entropy",
    }
    assert "experts/router_entropy" not in expert_load_metrics(expert_load_counts(ROUTES_NLK, 4, MASK_N))
    assert expert_load_metrics(expert_load_counts(ROUTES_NLK, 4, torch.zeros(4))) == {}
    with pytest.raises(ValueError, match="outside 0..2"):
        expert_load_counts(ROUTES_NLK, 3, MASK_N)


def test_expert_load_sums_counts_over_pieces_before_dividing():
    """Two data-parallel ranks (or micro-batches) hold tokens {0} and {1, 2}: their summed counts
    give the whole batch's metrics exactly, and the mean of their own imbalances does not (so the
    test can tell). Planted bug killed: ranks' ratios averaged instead of their counts summed."""
    whole = expert_load_metrics(expert_load_counts(ROUTES_NLK[:3], 4))
    pieces = [expert_load_counts(ROUTES_NLK[:1], 4), expert_load_counts(ROUTES_NLK[1:3], 4)]
    summed = {k: pieces[0][k] + pieces[1][k] for k in pieces[0]}
    assert expert_load_metrics(summed) == pytest.approx(whole)
    per_rank = [expert_load_metrics(p)["experts/load_imbalance"] for p in pieces]
    assert sum(per_rank) / 2 != pytest.approx(whole["experts/load_imbalance"])


def test_router_entropy_of_logits_and_of_probabilities():
    """Uniform logits: ln E; one expert certain: 0; a router's softmax probabilities (megatron's
    ``moe_router_pre_softmax``) give the entropy of its logits. Planted bug killed: the entropy of
    the scores taken as probabilities when they are logits."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0], [1.0, 2.0, 0.5, -1.0]])
    h = router_entropy_N(logits, probabilities=False)
    assert h[0] == pytest.approx(math.log(4))
    assert h[1] == pytest.approx(0.0, abs=1e-12)
    p = torch.softmax(logits[2], -1)
    assert h[2] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6)
    torch.testing.assert_close(router_entropy_N(torch.softmax(logits, -1), probabilities=True), h)


def test_samples_due_every_n_steps_and_at_every_evaluation():
    """Steps 0, N, 2N, ... and every evaluation write; off at 0, and on a rank without the sink.
    Planted bug killed: ``(step + 1) % N`` (the evaluation schedule) skipping step 0."""
    from moe_rl.trainer.samples import samples_due

    def run(every, k=4, enabled=True):
        return SimpleNamespace(
            recipe=SimpleNamespace(train=SimpleNamespace(samples_every=every, samples_per_step=k)),
            sink=SimpleNamespace(enabled=enabled),
        )

    assert [s for s in range(7) if samples_due(run(3), s)] == [0, 3, 6]
    assert samples_due(run(3)) and not samples_due(run(0)) and not samples_due(run(0), 0)
    assert not samples_due(run(3, enabled=False), 0) and not samples_due(run(3, k=0), 0)


def test_sink_appends_tagged_sample_rows_and_tensorboard_text(tmp_path, monkeypatch):
    """Each batch of rows is appended, tagged like metrics rows; a resumed attempt's sink (a new
    one in the same folder) appends after the first attempt's rows, never replacing them; each
    batch is one TensorBoard text entry that holds its responses. Planted bug killed: the file
    opened for writing from its start (the resumed attempt's rows replace the earlier ones)."""
    from moe_rl.trainer.metrics import MetricsSink, read_samples
    from moe_rl.trainer.trackers import TRACKERS, TensorBoardTracker

    class Recorded(TensorBoardTracker):  # the tracker's own samples(), a writer that records
        def start(self, run):
            self.writer = SimpleNamespace(
                add_text=lambda *a: shown.append(a), flush=lambda: None, close=lambda: None
            )

    monkeypatch.setitem(TRACKERS, "tensorboard", Recorded)
    row = {"row": 0, "prompt": "1+2=", "response": "3é", "answer": "3", "reward": 1.0, "correct": True}
    row.update(response_tokens=2, finish_reason="stop")
    shown = []
    for attempt, step, kind, rows in [
        (0, 5, "eval", [row]),
        (1, 6, "rollout", [{**row, "advantage": 0.5}, {**row, "row": 1, "advantage": -0.5}]),
    ]:
        sink = MetricsSink(tmp_path, loggers=("jsonl", "tensorboard"))
        sink.tags = {"run": "abc", "attempt": attempt}
        sink.samples(step, kind, rows)
        sink.close()
    rows = read_samples(tmp_path)
    assert [(r["step"], r["kind"], r["row"], r["attempt"]) for r in rows] == [
        (5, "eval", 0, 0),
        (6, "rollout", 0, 1),
        (6, "rollout", 1, 1),
    ]
    assert all(r["run"] == "abc" and r["response"] == "3é" for r in rows)
    assert [r["row"] for r in read_samples(tmp_path, "rollout")] == [0, 1]
    assert [(tag, step) for tag, _, step in shown] == [("samples/eval", 5), ("samples/rollout", 6)]
    assert "3é" in shown[0][1] and "advantage +0.5" in shown[1][1] and "advantage -0.5" in shown[1][1]


# -- the RL step, end to end -------------------------------------------------------------------------
def _distinct_reward(prompt, text: str) -> float:
    """A reward that differs between rows and between prompts: a row taken from the wrong place,
    or a response decoded from the wrong tokens, gets another one."""
    return len(text) / 10 + int(prompt.answer) / 100


def test_rl_step_writes_its_rows_and_logs_the_routers_own_load(tmp_path, parallel_info, monkeypatch):
    """One R3 step whose engine reports layer 0 on experts 0 and 1 for every token. samples.jsonl's
    rollout rows are the batch's rows: the prompt of row i is prompt i // G, the response decodes
    the row's response tokens, the reward is the task's reward of that response, the advantage the
    batch's; their rewards average to the step's ``reward/mean``. ``experts/*`` equal the load and
    router entropy recomputed by hand from the router logits of every training forward (the
    routers' own top-k), not the replayed routes (which would put layer 0 at imbalance 2, half its
    experts dead). Planted bugs killed: the response decoded with the prompt; prompt i instead of
    i // G; rewards of another row; the load counted from the replayed routes; counting only the
    last micro-batch."""
    from moe_rl.tasks.arithmetic import ArithmeticTask
    from moe_rl.trainer.metrics import read_samples
    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.timer import StepTimer
    from tests.unit.test_wiring import FORCED, ReportingEngine, _run

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: _distinct_reward(prompt, text))
    run = _run(tmp_path, routing="r3", train={"samples_every": 1, "samples_per_step": 8})
    logits: dict[int, list[torch.Tensor]] = {}
    try:
        engine = ReportingEngine(run.engine, force_routes=True)
        derived = run.derive(engine=engine, engine_gives_routes=True)
        for i, router in enumerate(run.policy.routers):
            gating = router.gating

            def capture(x, i=i, gating=gating):
                out = gating(x)
                if torch.is_grad_enabled():  # the training forwards (pi_old and probes run without)
                    logits.setdefault(i, []).append(out.detach().float().reshape(-1, out.shape[-1]))
                return out

            monkeypatch.setattr(router, "gating", capture)
        res = rl_step(derived, 0, StepTimer())
    finally:
        derived.close()
        run.close()
    ro, cfg = engine.rollouts, derived.recipe.train
    prompts = run.task.sample(0, cfg.prompts_per_step, derived.recipe.task.seed)
    rows = read_samples(tmp_path / "run", "rollout")
    assert [r["row"] for r in rows] == list(range(8)) and all(r["step"] == 0 for r in rows)
    for i, r in enumerate(rows):
        start, end = int(ro.prompt_lens_B[i]), int(ro.total_lens_B[i])
        prompt = prompts[i // cfg.group_size]
        assert r["prompt"] == prompt.text
        assert r["response"] == run.tok.decode(ro.tokens_BT[i, start:end].tolist())
        assert r["reward"] == pytest.approx(_distinct_reward(prompt, r["response"]))
        assert r["advantage"] == pytest.approx(float(res.batch.adv_B[i]))
        assert r["response_tokens"] == end - start and r["finish_reason"] == ro.finish_reasons[i]
    assert len({r["reward"] for r in rows}) > 2  # the rows' rewards tell them apart
    assert sum(r["reward"] for r in rows) / 8 == pytest.approx(res.metrics["reward/mean"])

    # the load by hand: every training forward's router logits (packed rows: every row a valid token)
    m, k, e = res.metrics, derived.recipe.model.moe_router_topk, derived.recipe.model.num_experts
    n_valid = int(res.batch.valid_BS.sum())
    hand_imbalance, entropies = [], []
    for i in sorted(logits):
        z = torch.cat(logits[i])
        assert z.shape[0] == n_valid  # each valid token once
        load = torch.bincount(z.topk(k, dim=-1).indices.reshape(-1), minlength=e).double()
        hand_imbalance.append(float(load.max() / load.mean()))
        p = torch.softmax(z, -1)
        entropies.append(-(p * p.log()).sum(-1))
        assert m[f"experts/load_imbalance/layer_{i}"] == pytest.approx(hand_imbalance[-1], rel=1e-9)
    assert m["experts/load_imbalance"] == pytest.approx(sum(hand_imbalance) / len(hand_imbalance))
    assert m["experts/router_entropy"] == pytest.approx(float(torch.cat(entropies).mean()), rel=1e-5)
    assert hand_imbalance[0] != pytest.approx(e / len(FORCED))  # the replayed load would be this
    assert 0 <= m["experts/dead_frac"] < 0.5


def test_evaluation_writes_its_held_out_generations(tmp_path, parallel_info, monkeypatch):
    """An evaluation after 3 RL steps writes ``eval`` rows of step 3: the held-out prompt, the greedy
    response decoded, its reward and ``correct``, no advantage; the sink's run tags. Planted bug
    killed: evaluations writing no samples (only RL steps)."""
    from moe_rl.tasks.arithmetic import ArithmeticTask
    from moe_rl.trainer.loop import evaluate
    from moe_rl.trainer.metrics import read_samples
    from tests.unit.test_wiring import ReportingEngine, _run

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: _distinct_reward(prompt, text))
    run = _run(tmp_path, train={"samples_per_step": 3})
    try:
        engine = ReportingEngine(run.engine)
        derived = run.derive(engine=engine)
        evaluate(derived, 3)
    finally:
        derived.close()
        run.close()
    ro = engine.rollouts
    prompts = run.task.heldout(derived.recipe.train.eval_prompts)
    rows = read_samples(tmp_path / "run")
    assert [(r["kind"], r["step"], r["row"]) for r in rows] == [("eval", 3, i) for i in range(3)]
    for i, r in enumerate(rows):
        response = run.tok.decode(
            ro.tokens_BT[i, int(ro.prompt_lens_B[i]) : int(ro.total_lens_B[i])].tolist()
        )
        assert (r["prompt"], r["answer"], r["response"]) == (prompts[i].text, prompts[i].answer, response)
        assert r["reward"] == pytest.approx(_distinct_reward(prompts[i], response))
        assert r["correct"] == (r["reward"] >= 1.0) and "advantage" not in r
        assert r["run"] == run.state.run_id
    raw = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    assert len(raw) == 3 and all(json.loads(line)["kind"] == "eval" for line in raw)


def test_report_draws_a_panel_only_for_a_metric_that_moved(tmp_path):
    """``moe-rl report``'s panels (issue 33, item 8): a metric gets a panel when some arm logged it
    and its values, over every arm, differ by more than round-off; absent ones (an old run's expert
    load, an SFT run's RL metrics), constant ones (an fp32 engine's all-zero rollout-vs-trainer flip
    rate, a dead-expert share that stayed 0) and round-off ones (k3 at 1e-13) get none. Planted
    bugs killed: the panels drawn for every run; the constant test dropped; the round-off test
    dropped."""
    from moe_rl.lab.report import EXPERT_PANELS, ROLLOUT_FLIP, panels, plot, y_scale

    def rows(**cols):
        return [{"step": i, **{k.replace("__", "/"): v[i] for k, v in cols.items()}} for i in range(3)]

    old = {"rl": rows(reward__mean=[0.5, 0.6, 0.7]), "eval": []}
    new = {
        "rl": [
            {**r, "experts/load_imbalance": 1.2 + 0.1 * r["step"], "experts/dead_frac": 0.0, ROLLOUT_FLIP: 0.0,
             "mismatch/k3": 1e-13 * r["step"]}
            for r in rows(reward__mean=[0.5, 0.5, 0.5])
        ],
        "eval": [{"step": 0, "eval/accuracy": 0.3}, {"step": 2, "eval/accuracy": 0.4}],
    }  # fmt: skip
    assert panels({"a": old}) == ["reward/mean"]
    assert panels({"b": new}) == ["eval/accuracy", EXPERT_PANELS[0]]  # reward constant in b alone
    assert panels({"a": old, "b": new}) == ["reward/mean", "eval/accuracy", EXPERT_PANELS[0]]
    assert panels({"sft": {"rl": [], "eval": []}}) == []
    assert plot({"a": old, "b": new}, tmp_path / "r.png").stat().st_size > 0
    assert plot({"sft": {"rl": [], "eval": []}}, tmp_path / "empty.png").stat().st_size > 0
    assert y_scale([1e-5, 1e-3, 0.2]) == "log" and y_scale([0.0, 0.2]) == "linear"
    assert y_scale([0.1, 0.3]) == "linear"


def test_report_writes_its_table_as_csv_and_markdown(tmp_path):
    """``moe-rl report`` writes report.csv and report.md beside report.png, with the terminal
    table's rows (issue 33, item 8)."""
    import csv

    from moe_rl.lab.report import report

    for name, reward in (("a", 0.25), ("b", 0.75)):
        d = tmp_path / name
        d.mkdir()
        lines = [{"step": s, "stage": "rl", "run": "r", "reward/mean": reward + 0.01 * s} for s in range(3)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    table, rows = report({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "report.png")
    got = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert [r["arm"] for r in got] == ["a", "b"] and float(got[1]["reward_last"]) == rows[1]["reward_last"]
    md = (tmp_path / "report.md").read_text().splitlines()
    assert md[2].startswith("| arm | steps |") and md[4].startswith("| a | 3 | 0.250 |")
    assert "rew_end" in table


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_session_router_entropy_is_the_routers_softmax_entropy_padded_and_packed(parallel_info, pre_softmax):
    """A session's per-token router entropy, in the ``[B, S, L]`` layout, equals the entropy of the
    softmax of that router's logits at that token (by hand from ``router.gating``), in a padded and
    in a packed forward (rows of different lengths), for a router that takes top-k of its logits
    and one that takes it of its softmax probabilities (``moe_norm_topk_prob=false``: megatron-core's
    ``moe_router_pre_softmax``). Planted bugs
    killed: the entropy of the pre-softmax probabilities' softmax; the packed rows mapped back to
    the wrong positions; router rows read batch-major (megatron's are sequence-major)."""
    from moe_rl.config import ParallelConfig
    from moe_rl.megatron.policy import build_policy
    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction
    from tests.tiny import tiny_model_config

    policy = build_policy(
        tiny_model_config(moe_norm_topk_prob=not pre_softmax), ParallelConfig(), parallel_info
    )
    b, s = 3, 10
    tok = torch.randint(0, 64, (b, s + 1), generator=torch.Generator().manual_seed(3))
    lens_B = torch.tensor([10, 4, 7])
    logits: dict[int, torch.Tensor] = {}
    originals = [r.gating for r in policy.routers]
    for i, router in enumerate(policy.routers):

        def first_logits(x, i=i, gating=originals[i]):
            out = gating(x)
            logits.setdefault(i, out.detach())  # the padded forward's
            return out

        router.gating = first_logits
    try:
        with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL, entropy=True) as padded:
            policy.logprobs(tok)
        padded_BSL = padded.router_entropy_BSL(b, s)
        by_hand = []
        for i in range(len(policy.routers)):
            p = torch.softmax(logits[i].float(), -1).reshape(s, b, -1).transpose(0, 1)  # rows s * B + b
            by_hand.append(-(p * p.log()).sum(-1))
        torch.testing.assert_close(padded_BSL, torch.stack(by_hand, -1), rtol=1e-5, atol=1e-6)
        pack = policy.pack(tok, lens_B)
        with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL, pack=pack, entropy=True) as rs:
            policy.logprobs(tok, pack=pack)
        packed_BSL = rs.router_entropy_BSL(b, s)
    finally:
        for router, g in zip(policy.routers, originals):
            router.gating = g
    valid_BS = torch.arange(s)[None, :] < lens_B[:, None]
    torch.testing.assert_close(packed_BSL[valid_BS], padded_BSL[valid_BS], rtol=1e-4, atol=1e-5)
    assert (packed_BSL[~valid_BS] == 0).all()
    with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL) as off:
        policy.logprobs(tok)
    assert off.router_entropy_BSL(b, s) is None
