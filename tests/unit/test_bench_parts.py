"""The benchmarks' parts in process: the paired overheads of throughput_report, the count flags."""

import pytest


@pytest.mark.parametrize(
    "module, argv, flag",
    [
        ("step_time", ["--threads", "0"], "--threads"),
    ],
)
def test_a_count_flag_below_one_is_a_usage_error(module, argv, flag, capsys):
    """Every count a benchmark takes is checked (a zero or negative count used to run nothing or
    fail later)."""
    import importlib

    mod = importlib.import_module(f"benchmarks.{module}")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_paired_overheads_difference_only_the_phases_a_mode_changes():
    from benchmarks.throughput_report import paired_probe_fracs, paired_replay_overheads

    def steps(rollout, train, probe=(0.1, 0.1)):
        d = {"rollout": list(rollout), "old_logprob": [0.5, 0.5], "train": list(train), "probe": list(probe)}
        d["step"] = [sum(d[p][i] for p in ("rollout", "old_logprob", "train", "probe")) for i in range(2)]
        return d

    none = steps((1.0, 1.4), (2.0, 2.0))  # step 3.6, 4.0
    other = steps((1.3, 1.0), (2.036, 2.04))  # a noisier rollout, +0.036 / +0.04 s of training
    assert paired_replay_overheads(none, other, "r2") == pytest.approx(
        [0.01, 0.01]
    )  # rollout noise: not R2's
    assert paired_replay_overheads(none, other, "r3") == pytest.approx([0.336 / 3.6, -0.36 / 4.0])
    assert paired_probe_fracs(none) == pytest.approx([0.1 / 3.6, 0.1 / 4.0])
    with pytest.raises(ValueError, match="pair equal counts"):
        paired_replay_overheads(none, {k: v[:1] for k, v in other.items()}, "r2")


def test_each_trl_round_draws_its_own_prompt_stream_on_both_sides(monkeypatch, tmp_path):
    """Every paired round samples a fresh prompt stream (``task.seed``), never the in-run
    measurement's, and the same one on both sides; a side that sampled another is an error, not a
    ratio. (With one stream every round timed the same three prompt draws.)"""
    from benchmarks import throughput as tp

    asked = []

    def ours(name, preset, threads, tmp, seed):
        asked.append(("moe_rl", seed))
        return {"task_seed": seed}

    def peer_of(reported):
        def peer(name, export, recipe, p, threads, tmp, device):
            asked.append(("trl", recipe.task.seed))
            return {"median": {}, "task_seed": reported(recipe.task.seed)}

        return peer

    p = {**tp.PRESETS["smoke"], "trl_rounds": 3, "trl_models": ("tiny",)}
    fresh = lambda: {"models": {"tiny": {}}, "trl": {"tiny": {"peer": {"median": {}}}}}  # noqa: E731
    monkeypatch.setattr(tp, "run_round", ours)
    monkeypatch.setattr(tp, "run_trl", peer_of(lambda seed: seed))
    res = fresh()
    tp.trl_rounds(res, p, "smoke", 1, tmp_path, "cpu")
    rows = res["trl"]["tiny"]["rounds"]
    seeds = [row["task_seed"] for row in rows]
    in_run = tp.build_recipe(p["models"]["tiny"], p["train"]).task.seed
    assert len(set(seeds)) == 3 and in_run not in seeds
    assert sorted(asked) == sorted([(side, s) for s in seeds for side in ("moe_rl", "trl")])
    assert all(row["error"] is None for row in rows)

    monkeypatch.setattr(tp, "run_trl", peer_of(lambda seed: in_run))  # a peer that ignored the stream
    res = fresh()
    tp.trl_rounds(res, p, "smoke", 1, tmp_path, "cpu")
    assert all("prompt streams" in row["error"] for row in res["trl"]["tiny"]["rounds"])
