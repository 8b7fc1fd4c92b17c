"""GPU tier: local_layers on CUDA in bf16 -- packed (thd) attention, grouped experts (skipped without CUDA).

The packed step is what the trainer runs (train.packing defaults on); its first bf16 run on an
H200 broke in cuDNN's attention backward (local_layers.SDPA_BACKENDS)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_packed_bf16_logprobs_and_gradients_match_unpacked(parallel_info):
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.policy import build_policy

    cfg = ModelConfig(dtype="bfloat16", head_dim=64)
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([96, 1, 2, 40, 127, 17])  # a one-token segment, odd lengths
    tok = torch.randint(0, cfg.vocab_size, (len(lens), 128), generator=g).cuda()
    grads, logps = [], []
    for pack in (policy.pack(tok, lens), None):
        policy.model.zero_grad(set_to_none=True)
        out = policy.logprobs(tok, pack=pack)
        keep = torch.arange(out.logp_BT.shape[1], device="cuda")[None] < lens.cuda()[:, None]
        logp = torch.where(keep, out.logp_BT, 0.0)
        (-logp.sum() / keep.sum()).backward()
        torch.cuda.synchronize()
        logps.append(logp.detach())
        grads.append(
            {n: p.grad.float().clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        )
    # bf16: the two paths round differently, and a rounding can flip a token's top-k experts, so
    # the comparison is on the whole (mean log-prob difference, cosine of the full gradient)
    diff = (logps[0] - logps[1]).abs().sum() / lens.sum()
    assert diff < 0.05, float(diff)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    a, b = (torch.cat([g[n].flatten() for n in sorted(g)]) for g in grads)
    assert torch.isfinite(a).all()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
    assert cos > 0.95, float(cos)


def test_grouped_experts_on_cuda_match_the_per_expert_loop(parallel_info, monkeypatch):
    """On CUDA (bf16) the experts run torch's grouped GEMM over their stacked weights (a transposed
    view: no copy): the same outputs and gradients (input and both stacked weights) as one matmul
    per expert, empty experts included."""
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron import local_layers
    from moe_rl.megatron.local_layers import GroupedExperts
    from moe_rl.megatron.policy import build_policy

    cfg = ModelConfig(dtype="bfloat16", hidden_size=256, moe_ffn_hidden_size=128, num_experts=8)
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    experts = next(m for m in policy.model.modules() if isinstance(m, GroupedExperts))
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 1, 0, 40, 3, 9])
    n = int(counts.sum())
    x0 = torch.randn(n, cfg.hidden_size, generator=g).to("cuda", torch.bfloat16)
    probs = torch.rand(n, generator=g).cuda()
    weights = [experts.linear_fc1.weight, experts.linear_fc2.weight]
    out = []
    for path in ("module", "loop"):
        x = x0.clone().requires_grad_(True)
        if path == "module":
            y, _ = experts(x, counts.cuda(), probs)
        else:
            y = experts.per_expert(x, counts, probs, *weights)
        grads = torch.autograd.grad(y.float().square().sum(), [x, *weights])
        out.append((y.float(), [gr.float() for gr in grads]))
    assert local_layers.grouped_mm_ok(x0) and len(calls) == 2, "CUDA bf16 should take the grouped GEMM"
    (ya, ga), (yb, gb) = out
    assert (ya - yb).norm() <= 2e-2 * yb.norm()
    for a, b in zip(ga, gb):
        assert torch.isfinite(a).all() and (a - b).norm() <= 3e-2 * b.norm() + 1e-6


def test_grouped_experts_under_ddp_take_one_gradient_add_per_projection(parallel_info):
    """The CUDA training forward under megatron-core DDP (bf16 weights, fp32 buffer, two
    micro-batches): each stacked projection's gradient reaches DDP's buffer by one add of its hook
    per micro-batch, whatever the number of experts, and equals the per-expert loop's."""
    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.megatron.local_layers import GroupedExperts
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy
    from tests.ops import CountOps

    cfg = ModelConfig(dtype="bfloat16", hidden_size=256, moe_ffn_hidden_size=128, num_experts=8)
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    opt = Optimizer(policy.model, OptimConfig(lr=1e-3, overlap_grad_reduce=False), parallel_info)
    experts = next(m for m in policy.model.modules() if isinstance(m, GroupedExperts))
    weights = [experts.linear_fc1.weight, experts.linear_fc2.weight]
    shapes = {tuple(p.shape) for p in weights}
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 1, 0, 40, 3, 9])
    x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=g).to("cuda", torch.bfloat16)
    probs = torch.rand(x.shape[0], generator=g).cuda()
    mains = {}
    for path in ("module", "loop"):
        opt.zero_grad()
        with CountOps() as ops:
            for _ in opt.micro_batches(range(2)):
                if path == "module":
                    y, _ = experts(x, counts.cuda(), probs)
                else:
                    y = experts.per_expert(x, counts, probs, *weights)
                y.float().square().sum().backward()
            opt.finish_grad_sync()
        torch.cuda.synchronize()
        mains[path] = [p.main_grad.float().clone() for p in weights]
        if path == "module":
            assert sum(s in shapes for s in ops.shapes["aten.add_"]) == 2 * len(weights)
    for a, b in zip(mains["module"], mains["loop"]):
        assert torch.isfinite(a).all() and (a - b).norm() <= 3e-2 * b.norm() + 1e-6


def test_packed_rope_on_cuda_is_megatrons_without_a_host_sync(parallel_info):
    """The one-pass packed RoPE (moe_rl/megatron/rope.py) on CUDA, bf16, boundaries on the device:
    megatron-core's values and gradients, and no device-to-host sync (megatron-core's own loops
    over the sequences on the host)."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.policy import build_policy

    cfg = ModelConfig(dtype="bfloat16", head_dim=64)
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    segs = [96, 1, 2, 40, 127, 17]
    cu = torch.zeros(len(segs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segs), 0)
    cu = cu.cuda()
    freqs = policy.model.rotary_pos_emb(max(segs))
    cp = parallel_state.get_context_parallel_group()
    t = torch.randn(sum(segs), 8, 64, device="cuda", dtype=torch.bfloat16)
    outs = []
    for fn in (attention.apply_rotary_pos_emb, rope_utils.apply_rotary_pos_emb):
        x = t.clone().requires_grad_(True)
        if fn is attention.apply_rotary_pos_emb:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = fn(x, freqs, policy.model.config, cu_seqlens=cu, cp_group=cp)
            out.backward(torch.ones_like(out))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs.append((out.detach(), x.grad))
    assert attention.apply_rotary_pos_emb is not rope_utils.apply_rotary_pos_emb
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
