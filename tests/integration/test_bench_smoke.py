"""benchmarks/throughput.py, smoke preset: every phase of every combo measured, JSON + PNG written.

The TRL part runs only where ``.venv-trl`` exists (``bash benchmarks/trl_env.sh``).
Each test runs the benchmark as a subprocess: it sets the process's torch threads.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "throughput.py"
MEASURED = ("rollout", "old_logprob", "train", "probe", "sync", "sync_hf", "step")


def _run(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, str(BENCH), "--preset", "smoke", "--world", "--out", str(out), *extra]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert out.with_suffix(".png").stat().st_size > 10_000
    return json.loads(out.read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_smoke_preset_measures_every_phase(tmp_path):
    res = _run(tmp_path / "smoke.json", "--no-trl")
    assert res["preset"] == "smoke" and res["threads"] == 1 and res["trl_skipped"] == "--no-trl"
    assert set(res["models"]) == {"tiny", "small"}
    head = res["headline"]
    for k in ("probe_frac", "replay_overhead", "floor_multiple_small", "probe_work_share"):
        assert isinstance(head[k], float) and math.isfinite(head[k]), k
    assert (
        0 < head["probe_frac"] < 1 and head["floor_multiple_small"] > 1 and 0 < head["probe_work_share"] < 1
    )
    assert head["own_gemms_small"] == res["models"]["small"]["floor"]["own_gemms"]
    assert head["moe_rl_over_trl_tiny"] is None and head["moe_rl_over_trl_small"] is None  # --no-trl
    for model, share in head["padding_share_removed"].items():
        assert 0 <= share < 1, model
    for model, d in res["models"].items():
        assert set(d["combos"]) == {
            f"{a}/{g}" for a in ("grpo", "gspo", "gspo_token") for g in ("none", "r2", "r3")
        } | {"gspo/none+rollout_logp"}
        for name, c in d["combos"].items():
            assert c["tokens"] > 0, (model, name)
            for p in MEASURED:
                ph = c["phases"][p]
                assert _positive(ph["tokens_per_s"]) and _positive(ph["tokens_per_cpu_s"]), (
                    model,
                    name,
                    p,
                    ph,
                )
                if p not in ("probe", "step"):
                    assert _positive(ph["peak_mib"]) and ph["peak_mib"] >= ph["start_mib"] - 1, (
                        model,
                        name,
                        p,
                    )
            # the step is the loop's: rollout + old_logprob + train + probe + sync (sync_hf is extra)
            parts = sum(c["phases"][p]["s"] for p in ("rollout", "old_logprob", "train", "probe", "sync"))
            assert c["phases"]["step"]["s"] == pytest.approx(parts, rel=1e-6)
        assert d["own_gemms"]["combo"] == "gspo/none" and d["own_gemms"]["warm"]["distinct_calls"] > 0
        for k in ("warm", "cold"):  # the step's own GEMMs, timed alone: part of the step
            og = d["floor"]["own_gemms"][k]
            assert _positive(og["gemm_cpu_s"]) and _positive(og["over_flop_floor"]), (model, k)
            assert og["step_over_gemms"] > 1, (model, k)
        ov = d["overheads"]
        assert set(ov["replay"]) == {f"{a}/{g}" for a in ("grpo", "gspo", "gspo_token") for g in ("r2", "r3")}
        assert all(_positive(v["old_logprob_plus_train_cpu"]) for v in ov["replay"].values())
        assert all(_positive(v["probe_over_train"]) for v in ov["probe"].values())
        # every combo of a repeat runs at the same step index: the same prompts and sampling seeds
        assert len({c["tokens"] for c in d["combos"].values()}) == 1


@pytest.mark.skipif(
    not (ROOT / ".venv-trl" / "bin" / "python").exists(),
    reason="no .venv-trl (bash benchmarks/trl_env.sh)",
)
def test_smoke_preset_with_the_trl_peer(tmp_path):
    res = _run(tmp_path / "smoke_trl.json", "--models", "tiny")
    t = res["trl"]["tiny"]
    peer, vs = t["peer"], t["vs"]
    assert "error" not in peer, peer.get("stderr_tail")
    assert peer["settings"]["importance_sampling_level"] == "sequence"
    assert peer["settings"]["num_generations"] == res["settings"]["group_size"]
    assert peer["settings"]["steps_per_generation"] == res["settings"]["minibatches"]
    assert peer["threads"] == res["threads"] == 1
    for p in ("rollout_s", "old_logprob_s", "train_s", "step_s", "tokens"):
        assert _positive(peer["median"][p]), p
    assert _positive(vs["ratio_wall"]) and _positive(vs["ratio_cpu"])
    # the paired rounds: moe-rl's step and TRL's back to back; the headline's ratio is their median
    rounds = t["rounds"]
    assert len(rounds) == res["headline"]["trl_rounds"]["tiny"] == 1 and rounds[0]["first"] == "moe_rl"
    # the run's comparison samples the recipe's prompts and noise, each round its own on both sides
    assert (peer["task_seed"], peer["train_seed"]) == (0, 1234) and rounds[0]["error"] is None
    assert (rounds[0]["task_seed"], rounds[0]["train_seed"]) == (1, 1235)
    tokens = rounds[0]["moe_rl_tokens"] / rounds[0]["trl_tokens"]  # the work each side sampled
    assert res["headline"]["moe_rl_over_trl_tokens"]["tiny"] == pytest.approx(tokens)
    assert (
        _positive(rounds[0]["ratio_cpu"])
        and len(rounds[0]["trl_step_cpu_s"]) == res["settings"]["timed_steps"]
    )
    assert res["headline"]["moe_rl_over_trl_tiny"] == rounds[0]["ratio_cpu"]
    assert res["headline"]["moe_rl_over_trl_range"]["tiny"] == [rounds[0]["ratio_cpu"]] * 2


def test_step_time_rl_measures_every_phase_of_every_routing(tmp_path):
    """``benchmarks.step_time --rl``: CPU seconds per phase of whole RL steps (the before/after
    figures of a speed change), min and median, the probe's share and the replay overheads."""
    out = tmp_path / "rl.json"
    cmd = [sys.executable, "-m", "benchmarks.step_time", "--rl", "micro", "--repeats", "2", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["threads"] == 1 and d["timed_steps"] == 2 and d["settings"] == "smoke"
    assert set(d["combos"]) == {"gspo/none", "gspo/r2", "gspo/r3"}
    for name, phases in d["combos"].items():
        for p in ("rollout", "old_logprob", "train", "probe", "step"):
            assert _positive(phases[p]["min"]) and phases[p]["min"] <= phases[p]["median"], (name, p)
        # every step is the sum of its phases, so its least is at least the sum of their least
        parts = sum(phases[p]["min"] for p in ("rollout", "old_logprob", "train", "probe", "sync"))
        assert phases["step"]["min"] >= parts * (1 - 1e-9), name
    assert d["headline"]["probe_frac"] == d["probe_frac_paired"]
    assert d["headline"]["replay_overhead"] == d["replay_overhead_paired"]
    assert d["headline"]["replay_overhead_of_min"] == d["replay_overhead_min"]
    assert 0 < d["probe_frac_paired"] < 1 and set(d["replay_overhead_paired"]) == {"r2", "r3"}
    assert all(len(v["step"]) == 2 for v in d["cpu_s_per_step"].values())
    for stat in ("min", "median"):
        assert 0 < d[f"probe_frac_{stat}"] < 1
        assert set(d[f"replay_overhead_{stat}"]) == {"r2", "r3"}
        assert all(math.isfinite(v) and v > -1 for v in d[f"replay_overhead_{stat}"].values())


def test_engine_throughput_smoke(tmp_path):
    """benchmarks/engine_throughput.py at a smoke size: both decoders, the naive loop, JSON + PNG."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.engine_throughput",
        "--batch",
        "4",
        "--new-tokens",
        "4",
        "--prompt-len",
        "4",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    res = subprocess.run(
        cmd,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (path,) = tmp_path.glob("engine_throughput-*.json")
    data = json.loads(path.read_text())
    assert path.with_suffix(".png").exists()
    assert data["naive_recompute_greedy"]["same_tokens_as_engine"]
    assert set(data["decoders"]) == {"lean", "megatron"}
    for case in ("engine_greedy", "megatron_engine_greedy", "engine_sampled"):
        assert data[case]["generated_tokens"] == 16 and data[case]["tokens_per_cpu_s"] > 0
