"""Quiet dependencies: what megatron-core and torch.distributed print that a user did not cause,
off unless asked for (``-v`` on the command line, ``verbose=True`` in the Python API).

Every entry was seen in a run of this project's own commands (``moe-rl train``, ``export``,
``--resume``, ``launch/torchrun.sh``) with every warning shown; each names where it comes from.
"""

from __future__ import annotations

import logging
import warnings

QUIET_LOGGERS = ("megatron",)
"Libraries whose INFO lines (DDP buckets, optimizer config, FSDP detection) show only when verbose."
QUIET_WARNINGS: tuple[tuple[str, str, type[Warning]], ...] = (
    # megatron-core's own: Transformer Engine / Apex fallbacks on CPU, "tp_group is None", "full
    # scope is deprecated", its deprecated module paths (every one a start printed was raised there)
    ("megatron", "", Warning),
    # torch.distributed deprecations megatron-core's calls trigger: all_gather_into_tensor and
    # reduce_scatter_tensor under torchrun; ShardedTensor in dist_checkpointing's save and load
    # (resume, export from a checkpoint)
    ("torch.distributed", "", FutureWarning),
    # megatron-core's DDP reads .grad of a non-leaf view under EP; torch warns where the call passes
    # our CPU shim (moe_rl/megatron/shims.py's __torch_function__), one line per rank
    ("moe_rl.megatron.shims", r"The \.grad attribute of a Tensor that is not a leaf Tensor", UserWarning),
)
"(module regex, message regex, category) of the warnings shown only when verbose."


def quiet_dependencies(verbose: bool = False) -> None:
    """megatron-core's loggers at WARNING and :data:`QUIET_WARNINGS` off; ``verbose``: its INFO
    lines and every warning (nothing filtered)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
    if verbose:
        return
    for module, message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
