"""The benchmarks' parts in process: the paired overheads of throughput_report, the count flags."""

import json

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


def test_each_trl_round_draws_its_own_prompts_and_sampling_on_both_sides(monkeypatch, tmp_path):
    """Every paired round samples fresh prompts (``task.seed``) and sampling noise (``train.seed``),
    never the in-run measurement's, the same on both sides; a side that sampled other ones is an
    error, not a ratio. (With one draw every round timed the same three steps' prompts and noise.)"""
    from benchmarks import throughput as tp

    asked = []

    def ours(name, preset, threads, tmp, draw):
        recipe = tp.build_recipe(tp.PRESETS["smoke"]["models"][name], tp.PRESETS["smoke"]["train"], draw=draw)
        asked.append(("moe_rl", tp.streams(recipe)))
        return tp.streams(recipe)

    def peer_of(reported):
        def peer(name, export, recipe, p, threads, tmp, device):
            asked.append(("trl", tp.streams(recipe)))
            return {"median": {}, **reported(tp.streams(recipe))}

        return peer

    p = {**tp.PRESETS["smoke"], "trl_rounds": 3, "trl_models": ("tiny",)}
    fresh = lambda: {"models": {"tiny": {}}, "trl": {"tiny": {"peer": {"median": {}}}}}  # noqa: E731
    monkeypatch.setattr(tp, "run_round", ours)
    monkeypatch.setattr(tp, "run_trl", peer_of(lambda want: want))
    res = fresh()
    tp.trl_rounds(res, p, "smoke", 1, tmp_path, "cpu")
    rows = res["trl"]["tiny"]["rounds"]
    in_run = tp.streams(tp.build_recipe(p["models"]["tiny"], p["train"]))
    drawn = [{k: row[k] for k in in_run} for row in rows]
    for k in in_run:  # three rounds, three prompt streams and three sampling seeds, none the run's
        assert len({d[k] for d in drawn}) == 3 and in_run[k] not in {d[k] for d in drawn}, k
    assert sorted(map(str, asked)) == sorted(str((side, d)) for d in drawn for side in ("moe_rl", "trl"))
    assert all(row["error"] is None for row in rows)

    for stale in ("task_seed", "train_seed"):  # a peer that ignored the round's prompts or seed
        monkeypatch.setattr(tp, "run_trl", peer_of(lambda want, k=stale: {**want, k: in_run[k]}))
        res = fresh()
        tp.trl_rounds(res, p, "smoke", 1, tmp_path, "cpu")
        assert all("sampled" in row["error"] for row in res["trl"]["tiny"]["rounds"]), stale


def test_step_time_against_alternates_the_first_side_resumes_and_pairs_the_ratios(tmp_path):
    """``step_time --against``: the side that runs first alternates over the pairs, a rerun makes
    only the runs that are missing, and each pair's ratio is this checkout's median over REV's
    (pairs never mixed)."""
    from benchmarks.step_time import RL_PHASES, paired_ratios, paired_runs

    calls = []

    def run(side, path):
        calls.append(path.name)
        i = int(path.stem.split("-")[1])
        scale = (0.9 if side == "here" else 1.0) * i  # pair i's machine runs i times slower
        combos = {"gspo/none": {p: {"median": scale * (k + 1), "min": 0.0} for k, p in enumerate(RL_PHASES)}}
        path.write_text(json.dumps({"combos": combos}))

    runs = paired_runs(tmp_path, 4, run)
    assert calls == ["rev-1.json", "here-1.json", "here-2.json", "rev-2.json",
                     "rev-3.json", "here-3.json", "here-4.json", "rev-4.json"]  # fmt: skip
    (tmp_path / "here-3.json").unlink()
    calls.clear()
    paired_runs(tmp_path, 4, run)
    assert calls == ["here-3.json"]
    ratios = paired_ratios(runs)["gspo/none"]
    assert "sync" not in ratios
    for phase, r in ratios.items():
        assert r["pairs"] == pytest.approx([0.9] * 4), phase  # unpaired, the ratios would span 0.225-3.6
        assert r["median"] == pytest.approx(0.9) and r["range"] == pytest.approx([0.9, 0.9])
