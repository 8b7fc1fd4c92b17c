"""megatron-core behind moe-rl's seams: the only package that imports it.

Importing it first defers megatron-core's import-time ``torch.compile`` to each function's first
call, taken only where it makes a kernel (:mod:`moe_rl.megatron.deferred_compile`).
"""

from moe_rl.megatron.deferred_compile import install as _install_deferred_compile

_install_deferred_compile()
