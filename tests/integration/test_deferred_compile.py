"""A fresh process's imports with megatron-core's compile deferred (moe_rl/megatron/deferred_compile.py;
the rule itself: tests/unit/test_deferred_compile.py). Each child is the startup benchmark's
(benchmarks/process_start.py): which of megatron-core and moe-rl it imports first decides."""

from __future__ import annotations

from benchmarks.process_start import child


def test_a_cpu_process_imports_megatron_and_trains_a_pass_without_dynamo_or_inductor():
    """moe-rl imported first (as every moe-rl module does): a forward and backward of the policy
    (routers included: megatron-core's compiled ``_apply_expert_bias`` runs in each) loads neither
    dynamo nor inductor on CPU. Before the hook, ``torch.compile`` at megatron-core's import loaded
    both (1.6 of the 4.1 s import) and the routers traced with dynamo."""
    out = child("deferred")
    assert out["router_compile_deferred"], out
    assert out["loaded_at_import"] == [] and out["loaded_after_pass"] == [], out


def test_megatron_imported_first_keeps_its_own_compile():
    """megatron-core imported before moe-rl: its functions were decorated already (inductor loaded
    at import), and the pass still runs."""
    out = child("stock")
    assert not out["router_compile_deferred"], out
    assert "torch._inductor.compile_fx" in out["loaded_at_import"], out
