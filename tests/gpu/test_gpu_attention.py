"""GPU tier: the packed (thd) bf16 attention path forward and backward on CUDA (skipped without CUDA).

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
        grads.append({n: p.grad.float().clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    # bf16: the two paths round differently, and a rounding can flip a token's top-k experts, so
    # the comparison is on the whole (mean log-prob difference, cosine of the full gradient)
    diff = (logps[0] - logps[1]).abs().sum() / lens.sum()
    assert diff < 0.05, float(diff)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    a, b = (torch.cat([g[n].flatten() for n in sorted(g)]) for g in grads)
    assert torch.isfinite(a).all()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
    assert cos > 0.95, float(cos)
