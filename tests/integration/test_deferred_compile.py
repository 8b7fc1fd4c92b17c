"""A process's imports with megatron-core's compile deferred (moe_rl/megatron/deferred_compile.py;
the wrapper itself: tests/unit/test_deferred_compile.py). Each test is a fresh interpreter: which of
megatron-core and moe-rl it imports first decides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
import megatron.core.jit
from moe_rl.megatron.policy import build_policy
from moe_rl.config import ParallelConfig
from moe_rl.megatron.parallel import init_parallel
from tests.tiny import tiny_model_config
import torch
from megatron.core.transformer.moe.router import TopKRouter
after_import = sorted(m for m in ("torch._dynamo", "torch._inductor.compile_fx") if m in sys.modules)
info = init_parallel(ParallelConfig(), seed=1)
policy = build_policy(tiny_model_config(), ParallelConfig(), info)
tokens = torch.randint(0, 50, (2, 9))
policy.logits(tokens).float().square().mean().backward()
print(json.dumps({
    "after_import": after_import,
    "after_pass": sorted(m for m in ("torch._dynamo", "torch._inductor.compile_fx") if m in sys.modules),
    "fuser_deferred": hasattr(megatron.core.jit.jit_fuser, "deferred_compile"),
    "router_deferred": hasattr(TopKRouter._apply_expert_bias, "deferred_compile"),
}))
"""


def _child(first: str) -> dict:
    code = f"import {first}\n" + CHILD
    env = {
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "PATH": "/usr/bin:/bin",
    }
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_cpu_process_imports_megatron_and_trains_a_pass_without_dynamo_or_inductor():
    """A process that imports megatron-core through moe-rl and runs a forward and backward of the
    policy (routers included: megatron-core's compiled ``_apply_expert_bias`` runs in each) loads
    neither dynamo nor inductor on CPU. Before the hook, ``torch.compile`` at megatron-core's import
    loaded both (1.6 of the 4.3 s import) and the routers traced with dynamo."""
    out = _child("moe_rl.megatron")
    assert out["fuser_deferred"] and out["router_deferred"], out
    assert out["after_import"] == [] and out["after_pass"] == [], out


def test_megatron_imported_first_keeps_its_own_compile():
    """megatron-core imported before moe-rl: the hook stays out (its functions were decorated
    already) and the pass still runs."""
    out = _child("megatron.core")
    assert not out["fuser_deferred"] and not out["router_deferred"], out
    assert "torch._inductor.compile_fx" in out["after_import"], out
