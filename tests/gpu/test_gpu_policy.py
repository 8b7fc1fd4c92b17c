"""GPU tier: build and step the policy in bf16 on CUDA (skipped without CUDA)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_policy_steps_on_cuda(parallel_info):
    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    cfg = ModelConfig(dtype="bfloat16")
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    opt = Optimizer(policy.model, OptimConfig(lr=1e-3), parallel_info)
    tok = torch.randint(0, cfg.vocab_size, (8, 129), device="cuda")
    losses = []
    for _ in range(3):
        out = policy.logprobs(tok)
        assert out.logp_BT.dtype == torch.float32 and out.logp_BT.is_cuda
        loss = -out.logp_BT.mean()
        loss.backward()
        assert opt.step()["skipped"] == 0
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_a_clipped_bf16_step_syncs_as_often_for_3_layers_as_for_1(parallel_info):
    """megatron-core's local l2 norm (no transformer-engine or apex) read every gradient's norm back
    to the host; with moe-rl's foreach stand-ins (moe_rl.megatron.optim.use_foreach_multi_tensor)
    a step's device-to-host syncs do not grow with the parameter count."""
    import warnings

    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    syncs = {}
    for layers in (1, 3):
        cfg = ModelConfig(dtype="bfloat16", num_layers=layers)
        policy = build_policy(cfg, ParallelConfig(), parallel_info)
        opt = Optimizer(policy.model, OptimConfig(lr=1e-3, grad_clip=1e-3), parallel_info)
        tok = torch.randint(0, cfg.vocab_size, (4, 65), device="cuda")
        for _ in range(2):  # the second step's syncs: the first also makes Adam's state
            (-policy.logprobs(tok).logp_BT.float().mean()).backward()
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    stats = opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            assert stats["skipped"] == 0
        syncs[layers] = sum("synchroniz" in str(w.message) for w in caught)
    assert syncs[1] == syncs[3], syncs
