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
