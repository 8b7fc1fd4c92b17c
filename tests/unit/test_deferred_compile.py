"""megatron-core's import-time ``torch.compile`` taken at first call, and only where it makes a
kernel (moe_rl/megatron/deferred_compile.py). A fresh process's imports:
tests/integration/test_deferred_compile.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from moe_rl.megatron import deferred_compile


def _function(module: str):
    """``double`` as if defined in ``module``."""

    def double(x, *, y=0):
        """Twice x, plus y."""
        return 2 * x + y

    double.__module__ = module
    return double


@pytest.mark.parametrize("here", [False, True])
def test_megatron_s_function_is_compiled_at_its_first_call_only_where_compile_makes_a_kernel(
    monkeypatch, here
):
    compiled: list = []

    def fake_compile(fn, **options):
        compiled.append((fn, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(deferred_compile, "compile_here", lambda: here)
    fn = _function("megatron.core.fusions.example")
    double = deferred_compile.deferred(fake_compile)(fn)
    with_options = deferred_compile.deferred(fake_compile)(mode="max-autotune")(fn)
    assert compiled == [] and double.__name__ == "double" and double.__doc__ == "Twice x, plus y."
    assert double.chosen is None
    first, second, third = double(3, y=1), double(4), with_options(1)
    if here:
        assert compiled == [(fn, {}), (fn, {"mode": "max-autotune"})]
        assert (first, second, third) == (("compiled", 7), ("compiled", 8), ("compiled", 2))
        assert double.chosen is not fn
    else:
        assert compiled == [] and (first, second, third) == (7, 8, 2) and double.chosen is fn


def test_anything_but_megatron_s_functions_is_compiled_at_once():
    calls: list = []
    fake = deferred_compile.deferred(lambda fn, **o: calls.append(fn) or fn)
    mine, layer = _function("my_project.model"), torch.nn.Linear(2, 2)
    assert fake(mine) is mine and fake(layer) is layer and calls == [mine, layer]


def test_torch_compile_is_deferred_inside_the_block_only_and_nested_blocks_share_it():
    real = torch.compile
    with deferred_compile.compile_deferred():
        outer = torch.compile
        with deferred_compile.compile_deferred():
            assert torch.compile is outer
        assert outer.deferred_compile is real
    assert torch.compile is real


def test_the_hook_runs_a_megatron_module_s_import_inside_the_block(monkeypatch, tmp_path):
    """A module under ``megatron.core`` (a stand-in package on a temporary path) that applies
    ``torch.compile`` at import gets the deferred wrapper; a module outside it gets torch's."""
    pkg = tmp_path / "megatron" / "core"
    pkg.mkdir(parents=True)
    (pkg / "probe_mod.py").write_text("import torch\n\n@torch.compile\ndef f(x):\n    return x + 1\n")
    (tmp_path / "outside_mod.py").write_text("import torch\nCOMPILE = torch.compile\n")
    fake = types.ModuleType("megatron.core")
    fake.__path__ = [str(pkg)]
    monkeypatch.setitem(sys.modules, "megatron.core", fake)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, deferred_compile._MegatronImports)]
    deferred_compile.install()
    deferred_compile.install()
    assert sum(isinstance(f, deferred_compile._MegatronImports) for f in sys.meta_path) == 1
    from megatron.core import probe_mod  # noqa: I001
    import outside_mod

    sys.modules.pop("megatron.core.probe_mod")
    sys.modules.pop("outside_mod")
    assert probe_mod.f.deferred_compile is torch.compile and outside_mod.COMPILE is torch.compile
    assert probe_mod.f(torch.tensor(1)).item() == 2  # no CUDA here: runs as written


def test_this_process_s_megatron_took_the_deferred_compile(tiny_policy):
    """conftest.py imports moe_rl.megatron before megatron-core: the routers' compiled methods (and
    0.19's compiled inference top-k) are the deferred wrappers, and a forward runs them as written."""
    import megatron.core.jit
    from megatron.core.transformer.moe import router

    assert megatron.core.jit.jit_fuser.deferred_compile is torch.compile
    bias = router.TopKRouter._apply_expert_bias
    assert bias.deferred_compile is torch.compile
    if hasattr(router, "InferenceTopKRouter"):
        assert router.InferenceTopKRouter._compiled_topk_routing.deferred_compile is torch.compile
    tiny_policy.logits(torch.randint(0, 50, (2, 9)))
    assert bias.chosen is bias.__wrapped__  # no CUDA here: megatron-core's function as written
