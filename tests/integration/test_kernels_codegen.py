"""The GPU build of the fused log-prob kernels compiles for Hopper, checked on a machine without one.

``benchmarks/kernels.py --codegen`` compiles both kernels at the default tile for sm_90 with
triton's bundled toolchain (the pointer / H / stride alignment triton's JIT infers at
H = 2048 / 4096): they must use wgmma, have a pipelined (cp.async) main loop, fit in shared
memory and not spill registers. Runs in a subprocess because triton's interpreter mode, which
tests/unit/test_kernels.py turns on, is per process. About 15 s of CPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
H100_MAX_SHARED = 227 * 1024


def test_default_tile_compiles_for_sm90(tmp_path):
    from moe_rl.kernels.fused_logprob import GPU_TILE, GPU_TILES

    name = next(k for k, v in GPU_TILES.items() if v is GPU_TILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "kernels.py"),
        "--codegen",
        "--only",
        name,
        "--arch",
        "90",
        "--out",
        str(tmp_path),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = json.loads(next(tmp_path.glob("kernels-codegen-*.json")).read_text())
    assert {r["kernel"] for r in rows} == {"fwd", "grad"}
    for r in rows:
        assert "error" not in r, r
        assert r["wgmma"] and r["cp_async"], f"{r['kernel']}: not a pipelined wgmma main loop: {r}"
        assert r["shared_bytes"] <= H100_MAX_SHARED, r
        if r["spill_store_bytes"] is not None:  # None: no bundled ptxas could read the PTX
            assert r["spill_store_bytes"] == 0, r
