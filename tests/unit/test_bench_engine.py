"""The engine benchmark's smoke size, and the benchmarks' count flags."""

import json
import sys
from pathlib import Path

import pytest


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
