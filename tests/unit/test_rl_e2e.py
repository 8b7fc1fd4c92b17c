"""The RL stage end to end on the tiny policy: every algorithm x routing mode, sentinel, NaN guard."""

import json

import pytest

from moe_rl.trainer.loop import TrainingStopped
from moe_rl.trainer.metrics import read_every_attempt, read_metrics, read_samples
from moe_rl.trainer.run import run
from tests.tiny import tiny_e2e as tiny


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token"])
@pytest.mark.parametrize("routing", ["none", "r2", "r3"])
def test_every_algorithm_and_routing_mode_runs(tmp_path, parallel_info, name, routing):
    res = run(tiny(tmp_path, algo={"name": name, "routing": routing}))
    rl = res["rl"]
    for key in (
        "reward/mean",
        "clip/token_frac",
        "clip/seq_frac",
        "clip/token_frac_of_clipped_seqs",
        "ratio/seq_log_sum_max",
        "flip/step/rate",
        "flip/drift/rate",
        "entropy/mean",
        "grad_norm",
        "time/rollout",
        "time/old_logprob",
        "time/train",
        "time/sync",
        "tokens_per_s",
        "eval/accuracy",
        "flip/rollout_vs_trainer/rate",
        "mismatch/k3",
        "experts/load_imbalance",
        "experts/load_imbalance/layer_1",
        "experts/dead_frac",
        "experts/router_entropy",
    ):
        assert key in rl, key
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl", "rl")
    assert [r["step"] for r in rows] == [0, 1]
    # train.samples_every (10): step 0's first 4 rollouts; the start's and the final evaluation's
    samples = [(r["kind"], r["step"]) for r in read_samples(tmp_path / "run")]
    assert samples == [("eval", 0)] * 4 + [("rollout", 0)] * 4 + [("eval", 2)] * 4
    # the trainer recomputes pi_old with the weights that generated: same routes, same log-probs
    assert rl["flip/rollout_vs_trainer/rate"] == 0.0
    assert rl["mismatch/abs_log_ratio"] < 1e-5
    if routing != "none":
        # replayed minibatches start exactly at pi_old: the first update's ratios are 1
        assert abs(rows[0]["ratio/token_min"] - 1) < 1e-5 or rows[0]["ratio/token_max"] >= 1


def test_non_finite_steps_stop_with_the_checkpoint_intact(tmp_path, parallel_info, monkeypatch):
    from moe_rl.megatron.checkpoint import latest_checkpoint
    from moe_rl.tasks.arithmetic import ArithmeticTask

    r = tiny(tmp_path, algo={"name": "grpo"}, train={"rl_steps": 6, "max_bad_steps": 2})
    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float("nan"))
    with pytest.raises(TrainingStopped, match="2 consecutive RL steps had non-finite"):
        run(r)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl", "rl")
    assert len(rows) == 1  # the first bad step is logged and skipped, the second stops the run
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt is not None and json.loads((ckpt / "meta.json").read_text())["extra"]["done"] == ["sft"]


def test_sentinel_stop_and_rollback(tmp_path, parallel_info):
    stop = tiny(tmp_path, sentinel={"min_entropy": 1e9, "entropy_action": "stop"}, train={"stages": ["rl"]})
    with pytest.raises(TrainingStopped, match="entropy"):
        run(stop)
    roll = tiny(
        tmp_path / "roll",  # a new run: the stopped one's directory is refused without --resume
        sentinel={"min_entropy": 1e9, "entropy_action": "rollback", "max_rollbacks": 2},
        train={"stages": ["rl"], "rl_steps": 3},
    )
    with pytest.raises(TrainingStopped, match="rolled back 2 times"):
        run(roll)
    # a rollback moves the rows of the steps it abandons to metrics.abandoned.jsonl (attempts 0, 1)
    folder = tmp_path / "roll" / "run"
    rows = read_every_attempt(folder)
    assert [r["attempt"] for r in rows if r["stage"] == "rl"] == [0, 1, 2]
    assert [r["attempt"] for r in read_metrics(folder / "metrics.jsonl", "rl")] == [2]
    lrs = [r["lr"] for r in rows if r["stage"] == "rl"]
    assert lrs[-1] < lrs[0], "rollback lowers the learning rate"
    # each rollback multiplies the scale again (0.5, then 0.25), not reloads it from the checkpoint
    assert lrs[1] == pytest.approx(lrs[0] * 0.5, rel=1e-6) and lrs[2] == pytest.approx(
        lrs[0] * 0.25, rel=1e-6
    )


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_micro_batching_leaves_the_update_unchanged(tmp_path, parallel_info, monkeypatch, name):
    from moe_rl.tasks.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text) % 2))
    res = {}
    for mbs in (0, 1):
        r = tiny(
            tmp_path / str(mbs),
            algo={"name": name, "routing": "r2"},
            train={"stages": ["rl"], "rl_steps": 1, "micro_batch_size": mbs},
        )
        res[mbs] = run(r)["rl"]
    assert res[0]["adv/abs_mean"] > 0, "the injected rewards must give a learning signal"
    for k in ("loss/pg", "clip/token_frac", "ratio/token_max", "grad_norm", "flip/step/rate", "entropy/mean"):
        assert res[1][k] == pytest.approx(res[0][k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize(
    "name,routing,correction,aggregation",
    [
        ("grpo", "none", "tis", "seq_mean"),
        ("grpo", "r2", "icepop", "token_mean"),
        ("gspo_token", "r3", "seq_tis", "seq_mean"),
        ("gspo", "r2", "geo_mask", "seq_mean"),
    ],
)
def test_bf16_rollouts_with_a_correction(tmp_path, parallel_info, name, routing, correction, aggregation):
    """bf16 rollouts from the engine's own copy: mismatch and rollout-vs-trainer flips are measured
    (non-zero), and every correction composes with replay and both aggregations."""
    algo = {"name": name, "routing": routing, "rollout_correction": correction, "aggregation": aggregation}
    algo["clip_ratio_c"] = 3.0
    res = run(tiny(tmp_path, algo=algo, rollout={"dtype": "bf16"}))["rl"]
    assert res["mismatch/abs_log_ratio"] > 0 and res["mismatch/k3"] >= 0
    assert 0 <= res["mismatch/extreme_frac"] <= 1 and res["mismatch/seq_log_ratio_abs_max"] > 0
    assert 0 < res["correction/weight_mean"] and 0 <= res["correction/masked_frac"] <= 1
    assert 0 <= res["flip/rollout_vs_trainer/rate"] <= 1 and "flip/rollout_vs_trainer/layer_1" in res
    assert 0 <= res["clip/dual_clip_frac"] <= 1


def test_fp32_rollouts_have_no_mismatch_and_bypass_mode_no_trainer_routes(tmp_path, parallel_info):
    res = run(tiny(tmp_path / "recompute", algo={"name": "grpo"}))["rl"]
    assert res["mismatch/abs_log_ratio"] < 1e-5 and res["mismatch/extreme_frac"] == 0
    assert res["flip/rollout_vs_trainer/rate"] == 0
    assert "correction/weight_mean" not in res  # no correction asked for
    bypass = run(tiny(tmp_path / "bypass", algo={"name": "gspo", "old_logprobs": "rollout"}))["rl"]
    assert not any(k.startswith(("mismatch/", "flip/rollout_vs_trainer")) for k in bypass)


def test_report_shows_the_mismatch(tmp_path, parallel_info):
    from moe_rl.lab.report import report

    run(tiny(tmp_path / "bf16", algo={"name": "grpo"}, rollout={"dtype": "bf16"}))
    run(tiny(tmp_path / "fp32", algo={"name": "grpo"}))
    runs = {"bf16": tmp_path / "bf16" / "run", "fp32": tmp_path / "fp32" / "run"}
    table, rows = report(runs, tmp_path / "report.png")
    assert "k3" in table and "flip/r-v-t" in table and (tmp_path / "report.png").stat().st_size > 0
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["bf16"]["mismatch_k3"] > by_arm["fp32"]["mismatch_k3"]
    assert by_arm["fp32"]["flip_rollout"] == 0


def test_a_report_of_a_folder_reused_with_fresh_shows_the_newest_run(tmp_path, parallel_info):
    """Rows carry the run's id: a folder reused with ``--fresh`` used to be reported as one run
    (its steps counted twice, the start's reward taken from the earlier run)."""
    from moe_rl.lab.report import load_arm

    first = tiny(tmp_path, train={"stages": ["rl"], "rl_steps": 3})
    run(first)
    run(tiny(tmp_path, train={"stages": ["rl"], "rl_steps": 1}), fresh=True)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl", "rl")
    assert len(rows) == 4 and len({r["run"] for r in rows}) == 2  # both runs' rows stay in the file
    arm = load_arm(tmp_path / "run")
    assert [r["step"] for r in arm["rl"]] == [0] and arm["rl"][0]["run"] == rows[-1]["run"]
