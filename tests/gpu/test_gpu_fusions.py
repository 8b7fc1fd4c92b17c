"""The fusions switched on where a GPU has their kernels (moe_rl.megatron.model.fusions): the fused
weighted SwiGLU (compiled) and torch's fused CUDA Adam against their unfused forms, within bf16 and
float rounding."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _policy(parallel_info, **kw):
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.policy import build_policy

    cfg = ModelConfig(dtype="bfloat16", hidden_size=256, moe_ffn_hidden_size=128, num_experts=8, **kw)
    return build_policy(cfg, ParallelConfig(), parallel_info)


def test_switches_on_a_gpu(parallel_info):
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.model import fusions

    on = {k: v for k, (v, _) in fusions(ModelConfig(dtype="bfloat16"), ParallelConfig()).items()}
    assert on["moe_grouped_gemm"] and on["bias_activation_fusion"] and not on["moe_router_fusion"]


def test_fused_swiglu_matches_unfused_on_cuda(parallel_info, monkeypatch):
    from moe_rl.megatron.local_layers import GroupedExperts

    experts = next(m for m in _policy(parallel_info).model.modules() if isinstance(m, GroupedExperts))
    assert experts._fused_glu
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 1, 0, 40, 3, 9])
    n = int(counts.sum())
    x = torch.randn(n, 256, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    probs = torch.rand(n, generator=g).cuda().requires_grad_(True)
    out = []
    for fused in (True, False):
        monkeypatch.setattr(experts, "_fused_glu", fused)
        y, _ = experts(x, counts.cuda(), probs)
        out.append(
            (y.float(), *(t.float() for t in torch.autograd.grad(y.float().square().sum(), [x, probs])))
        )
    for a, b in zip(*out):
        assert (a - b).norm() <= 2e-2 * b.norm() + 1e-6


def test_fused_cuda_adam_steps_as_foreach(parallel_info):
    from moe_rl.config import OptimConfig
    from moe_rl.megatron.optim import Optimizer

    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        policy = _policy(parallel_info)
        opt = Optimizer(policy.model, OptimConfig(lr=1e-3, weight_decay=0.1), parallel_info)
        groups = [g for o in opt.inner for g in o.optimizer.param_groups]
        assert all(g.get("fused") for g in groups)
        if not fused:
            for g in groups:
                g.update(fused=False, foreach=True)
        tok = torch.randint(0, policy.cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            policy.logprobs(tok).logp_BT.float().mean().neg().backward()
            opt.step()
        results.append([p.detach().float().clone() for p in policy.model.parameters()])
    for a, b in zip(*results):
        assert (a - b).norm() <= 1e-2 * b.norm() + 1e-6


def test_megatron_s_deferred_compile_compiles_on_a_gpu(parallel_info):
    """megatron-core's import-time ``torch.compile`` is deferred to the first call
    (moe_rl/megatron/deferred_compile.py); on a GPU with Triton that call compiles: the routers'
    ``_apply_expert_bias`` runs compiled after a forward, as megatron-core would run it."""
    from megatron.core.transformer.moe.router import TopKRouter

    from moe_rl.megatron.deferred_compile import compile_here

    bias = TopKRouter._apply_expert_bias
    assert compile_here() and bias.deferred_compile is torch.compile
    policy = _policy(parallel_info)
    policy.logits(torch.randint(0, policy.cfg.vocab_size, (2, 17)))
    assert bias.chosen is not None and bias.chosen is not bias.__wrapped__
