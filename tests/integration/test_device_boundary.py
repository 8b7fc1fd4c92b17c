"""The RL step with the policy on another device than the engine's batch (issue 27).

Engines return their batch on the host; the policy lives on an accelerator. On CUDA every op
that mixes the two fails, and every NCCL collective of a host tensor fails. A CPU has one real
device, so these tests keep the books with :class:`tests.device_ledger.DeviceLedger`: the
policy and everything megatron-core makes on "the current device" are on the pretend
accelerator ``cpu:0``, the engine's batch and everything made without a device on the host, and
the ledger records every op that would mix them. One whole ``rl_step`` per algorithm x routing
x pi_old source, and the evaluation, must mix nothing, and every tensor a collective receives
must be on the device.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl import dist
from tests.device_ledger import DeviceLedger, check_collectives, run_on_accel

OURS = ("all_reduce", "all_gather_cat")


def on_device(ledger: DeviceLedger, t: torch.Tensor) -> bool:
    return ledger.on_device(t)


@pytest.mark.parametrize("old_logprobs", ["recompute", "rollout"])
@pytest.mark.parametrize("routing", ["none", "r2", "r3"])
@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token"])
def test_rl_step_mixes_no_devices(tmp_path, parallel_info, monkeypatch, name, routing, old_logprobs):
    from moe_rl.trainer.loop import evaluate
    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.timer import StepTimer

    run = run_on_accel(
        tmp_path / "run", {"name": name, "routing": routing, "old_logprobs": old_logprobs}, monkeypatch
    )
    try:
        ledger = DeviceLedger([*run.policy.model.parameters(), *run.policy.model.buffers()])
        off = check_collectives(monkeypatch, ledger, dist, OURS, on_device)
        with ledger:
            result = rl_step(run, 0, StepTimer())
            evaluate(run, 1)
        assert "\n".join(sorted({str(m) for m in ledger.mixes})) == ""
        assert off == []
        # the step really trained: its batch is on the device and the weights moved
        assert ledger.on_device(result.batch.adv_B) and ledger.on_device(result.batch.mask_BT)
        assert result.skipped_updates == 0
    finally:
        run.close()


def test_the_ledger_sees_a_host_mask_meet_device_log_probs(tmp_path, parallel_info, monkeypatch):
    """The check itself: a batch left on the host (today's bug) is reported, op and line."""
    from moe_rl.rollout.types import Rollouts
    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.timer import StepTimer

    run = run_on_accel(tmp_path / "run", {"name": "grpo", "routing": "r3"}, monkeypatch)
    monkeypatch.setattr(Rollouts, "to", lambda self, device: self)  # no boundary
    try:
        ledger = DeviceLedger([*run.policy.model.parameters(), *run.policy.model.buffers()])
        off = check_collectives(monkeypatch, ledger, dist, OURS, on_device)
        with ledger:
            rl_step(run, 0, StepTimer())
        where = " ".join(str(m) for m in ledger.mixes)
        assert "losses" in where or "trainer" in where, where
        assert off, "host tensors reached the collectives"
    finally:
        run.close()


def test_collectives_refuse_a_tensor_off_their_groups_device(monkeypatch):
    """NCCL reduces CUDA tensors only: a host tensor is one line naming its device and the fix."""
    monkeypatch.setattr(dist, "_active", lambda group: True)
    monkeypatch.setattr(dist, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(RuntimeError, match=r"nccl collective got a tensor on cpu.*Run.generate"):
        dist.all_reduce(torch.zeros(2))
    with pytest.raises(RuntimeError, match="all_gather_cat"):
        dist.all_gather_cat(torch.zeros(2))
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert dist.group_device() == torch.device("cpu")
