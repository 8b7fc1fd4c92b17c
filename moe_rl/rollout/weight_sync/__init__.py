"""Push trainer weights (HF names) to an SGLang server or ``moe-rl serve``.

- :mod:`.session`: the pause / begin / apply / version / end / continue protocol every push runs
  inside, :class:`PushReport` and :class:`WeightSyncError`.
- :mod:`.distributed`: :class:`DistributedWeightSync`, broadcast over a dedicated gloo/nccl group
  (``/init_weights_update_group``, ``/update_weights_from_distributed``), and the SGLang-compatible
  process-group helpers the server side shares.
- :mod:`.tensor`: :class:`TensorWeightSync`, colocated pushes with ``/update_weights_from_tensor``
  (flattened buckets; CUDA IPC on GPU).
- :mod:`.address`: :func:`trainer_address`, the routable rendezvous address of the trainer.
- :mod:`.disk`: :class:`DiskWeightSync`, HF safetensors written atomically, then
  ``/update_weights_from_disk``.
"""

from __future__ import annotations

from moe_rl.rollout.weight_sync.address import RendezvousAddressError, trainer_address
from moe_rl.rollout.weight_sync.disk import DiskWeightSync, write_hf_checkpoint
from moe_rl.rollout.weight_sync.distributed import (
    DistributedWeightSync,
    destroy_process_group,
    dtype_name,
    init_custom_process_group,
    parse_dtype,
)
from moe_rl.rollout.weight_sync.session import PushReport, WeightSyncError, run_update_session
from moe_rl.rollout.weight_sync.tensor import TensorWeightSync

__all__ = [
    "DiskWeightSync",
    "DistributedWeightSync",
    "PushReport",
    "RendezvousAddressError",
    "TensorWeightSync",
    "WeightSyncError",
    "destroy_process_group",
    "dtype_name",
    "init_custom_process_group",
    "parse_dtype",
    "run_update_session",
    "trainer_address",
    "write_hf_checkpoint",
]
