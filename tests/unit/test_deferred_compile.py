"""megatron-core's import-time ``torch.compile`` taken at first call, and only where it makes a
kernel (moe_rl/megatron/deferred_compile.py). A process's imports: tests/integration/test_deferred_compile.py."""

from __future__ import annotations

import sys

import pytest

from moe_rl.megatron import deferred_compile


@pytest.mark.parametrize("here", [False, True])
def test_a_deferred_function_is_compiled_at_its_first_call_only_where_compile_makes_a_kernel(
    monkeypatch, here
):
    compiled: list = []

    def fake_compile(fn):
        compiled.append(fn)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(deferred_compile, "compile_here", lambda: here)

    @deferred_compile.deferred(fake_compile)
    def double(x, *, y=0):
        """Twice x, plus y."""
        return 2 * x + y

    assert compiled == [] and double.__name__ == "double" and double.__doc__ == "Twice x, plus y."
    first, second = double(3, y=1), double(4)
    if here:
        assert compiled == [double.__wrapped__] and first == ("compiled", 7) and second == ("compiled", 8)
    else:
        assert compiled == [] and first == 7 and second == 8


def test_the_hook_is_installed_once_and_only_before_megatron_s_jit_module(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    deferred_compile.remove()
    monkeypatch.delitem(sys.modules, deferred_compile.JIT_MODULE, raising=False)
    assert deferred_compile.install() and deferred_compile.install()
    assert sum(isinstance(f, deferred_compile._JitHook) for f in sys.meta_path) == 1
    monkeypatch.setitem(sys.modules, deferred_compile.JIT_MODULE, object())
    deferred_compile.remove()
    assert not deferred_compile.install()
    assert not any(isinstance(f, deferred_compile._JitHook) for f in sys.meta_path)
