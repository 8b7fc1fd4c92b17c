"""SDPAttention and GroupedExperts against megatron-core's stock local modules, same weights."""

import pytest
import torch

from moe_rl.config import ModelConfig, ParallelConfig


def per_expert_state(model) -> dict:
    """``model``'s state dict in the per-expert layout of megatron-core's ``SequentialMLP``
    (``...experts.local_experts.<e>.linear_fc<i>.weight``): what a stock model loads."""
    out = {}
    for name, t in model.state_dict().items():
        head, sep, tail = name.partition("mlp.experts.linear_fc")
        if not sep:
            out[name] = t
            continue
        fc = tail.split(".")[0]
        for e, w in enumerate(t.unbind(0)):
            out[f"{head}mlp.experts.local_experts.{e}.linear_fc{fc}.weight"] = w
    return out


def _pair(cfg: ModelConfig, dtype=torch.float32):
    """(ours, stock) GPT models with identical weights: built from one seed, which draws the same
    weights in either layout (checked here), then the stock one loaded from ours."""
    from dataclasses import replace

    from moe_rl.megatron.model import build_gpt

    if dtype == torch.bfloat16:
        cfg = replace(cfg, dtype="bfloat16")
    torch.manual_seed(0)
    ours = build_gpt(cfg, ParallelConfig())
    torch.manual_seed(0)
    stock = build_gpt(cfg, ParallelConfig(), stock_local=True)
    drawn, mine = stock.state_dict(), per_expert_state(ours)
    tensors = {k: v for k, v in mine.items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(drawn[k], v) for k, v in tensors.items()), "a seed draws other weights per layout"
    missing, unexpected = stock.load_state_dict(mine, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    return ours, stock


def _stacked_grads(ours, stock) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(stock name, our gradient, stock gradient) of every parameter, ours sliced per expert."""
    out = []
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    for name, p in stock.named_parameters():
        head, sep, tail = name.partition("mlp.experts.local_experts.")
        if sep:
            e, rest = tail.split(".", 1)
            g = ours_grads[f"{head}mlp.experts.{rest}"]
            out.append((name, None if g is None else g[int(e)], p.grad))
        else:
            out.append((name, ours_grads[name], p.grad))
    return out


def _forward(model, tok, **kw):
    pos = torch.arange(tok.shape[1]).expand_as(tok)
    return model(input_ids=tok, position_ids=pos, attention_mask=None, **kw)


def test_modules_are_swapped(parallel_info, tiny_model_cfg):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_rl.megatron.local_layers import GroupedExperts, SDPAttention

    ours, stock = _pair(tiny_model_cfg)
    kinds = lambda m: {type(x) for x in m.modules()}  # noqa: E731
    assert {SDPAttention, GroupedExperts} <= kinds(ours)
    assert not {SDPAttention, GroupedExperts} & kinds(stock)
    assert {DotProductAttention, SequentialMLP} <= kinds(stock)
    # one parameter per expert projection (two per MoE layer, whatever the number of experts), the
    # same names elsewhere; the per-expert layout maps onto it element for element
    ours_names = [n for n, _ in ours.named_parameters()]
    experts = [n for n in ours_names if ".mlp.experts." in n]
    assert len(experts) == 2 * tiny_model_cfg.num_layers
    assert [n for n in ours_names if n not in experts] == [
        n for n, _ in stock.named_parameters() if ".mlp.experts." not in n
    ]
    shapes = lambda sd: {k: v.shape for k, v in sd.items() if isinstance(v, torch.Tensor)}  # noqa: E731
    assert shapes(per_expert_state(ours)) == shapes(stock.state_dict())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logits_and_every_gradient_match_stock(parallel_info, tiny_model_cfg, seed):
    ours, stock = _pair(tiny_model_cfg)
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, tiny_model_cfg.vocab_size, (3, 19), generator=g)
    w = torch.randn(3, 19, tiny_model_cfg.vocab_size, generator=g)
    outs = []
    for m in (ours, stock):
        m.zero_grad(set_to_none=True)
        out = _forward(m, tok)
        (out * w).sum().backward()
        outs.append(out.detach())
    # measured: max |diff| ~3e-7 on logits of magnitude ~1 (fp32 summation order)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=1e-5)
    for name, go, gs in _stacked_grads(ours, stock):
        assert go is not None and gs is not None, name
        scale = gs.abs().max().clamp_min(1e-6)
        assert (go - gs).abs().max() / scale < 1e-4, name


def test_kv_cache_decode_matches_stock(parallel_info, tiny_model_cfg):
    """Prefill then one-token decode steps against megatron's static KV cache."""
    from megatron.core.inference.contexts import StaticInferenceContext

    ours, stock = _pair(tiny_model_cfg)
    tok = torch.randint(0, tiny_model_cfg.vocab_size, (4, 12), generator=torch.Generator().manual_seed(3))
    results = []
    for m in (ours, stock):
        m.eval()
        ctx = StaticInferenceContext(4, 12)
        steps = []
        with torch.no_grad():
            for start, n in [(0, 7)] + [(s, 1) for s in range(7, 12)]:
                ctx.sequence_len_offset = start
                if start > 0:
                    ctx.enable_decode_mode()
                inp = tok[:, start : start + n]
                pos = torch.arange(start, start + n).expand_as(inp)
                steps.append(
                    m(
                        input_ids=inp,
                        position_ids=pos,
                        attention_mask=None,
                        inference_context=ctx,
                        runtime_gather_output=True,
                    )[:, -1]
                )
        results.append(torch.stack(steps))
    torch.testing.assert_close(results[0], results[1], atol=2e-6, rtol=1e-5)
    with torch.no_grad():  # and decode equals the full causal forward
        full = _forward(ours, tok)[:, 6:]
    torch.testing.assert_close(results[0].transpose(0, 1), full, atol=2e-6, rtol=1e-5)


def test_bf16_matches_stock(parallel_info, tiny_model_cfg):
    ours, stock = _pair(tiny_model_cfg, torch.bfloat16)
    tok = torch.randint(0, tiny_model_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = _forward(ours, tok).float(), _forward(stock, tok).float()
    # bf16 (8-bit mantissa): SDPA and baddbmm round differently; measured max diff ~1e-2
    torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_expert_with_no_tokens_and_empty_batch(parallel_info, tiny_model_cfg):
    from moe_rl.megatron.local_layers import GroupedExperts

    ours, stock = _pair(tiny_model_cfg)
    e_ours = next(m for m in ours.modules() if isinstance(m, GroupedExperts))
    e_stock = dict(stock.named_modules())[next(n for n, m in ours.named_modules() if m is e_ours)]
    h = tiny_model_cfg.hidden_size
    for counts in ([3, 0, 5, 0], [0, 0, 0, 0], [0, 0, 0, 2]):
        n = sum(counts)
        x = torch.randn(n, h, requires_grad=True)
        probs = torch.rand(n)
        cnt = torch.tensor(counts)
        a, _ = e_ours(x, cnt, probs)
        b, _ = e_stock(x, cnt, probs)
        assert a.shape == (n, h)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_unsupported_options_are_refused(parallel_info, tiny_model_cfg):
    from dataclasses import replace

    from moe_rl.megatron.local_layers import GroupedExperts, SDPAttention
    from moe_rl.megatron.model import transformer_config

    config = transformer_config(tiny_model_cfg, ParallelConfig())
    with pytest.raises(ValueError, match="add_bias_linear"):
        GroupedExperts(4, replace(config, add_bias_linear=True), None)
    with pytest.raises(ValueError, match="attention_dropout"):
        SDPAttention(replace(config, attention_dropout=0.1), layer_number=1, attn_mask_type=None)


def test_per_expert_loop_equals_grouped_mm(parallel_info, tiny_model_cfg, monkeypatch):
    """The grouped GEMM over the stacked weights (the module's forward, on CPU as on CUDA) and the
    per-expert loop (its fallback where this torch has no grouped GEMM) give the same outputs and
    gradients, input and weights, bit for bit on CPU fp32 (measured)."""
    from moe_rl.megatron import local_layers
    from moe_rl.megatron.local_layers import GroupedExperts

    ours, _ = _pair(tiny_model_cfg)
    experts = next(m for m in ours.modules() if isinstance(m, GroupedExperts))
    weights = [experts.linear_fc1.weight, experts.linear_fc2.weight]
    x = torch.randn(9, tiny_model_cfg.hidden_size, requires_grad=True)
    cnt, probs = torch.tensor([2, 0, 4, 3]), torch.rand(9)
    assert local_layers.grouped_mm_ok(x)
    results = []
    for grouped in (True, False):
        monkeypatch.setattr(local_layers, "grouped_mm_ok", lambda x, g=grouped: g)
        y, _ = experts(x, cnt, probs)
        results.append((y, *torch.autograd.grad(y.sum(), [x, *weights])))  # .sum(): a broadcast gradient
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_attention_never_runs_on_cudnn(parallel_info, tiny_model_cfg, monkeypatch):
    """Dense and packed attention call SDPA with cuDNN's kernel switched off (its backward broke
    the packed bf16 step on an H200: local_layers.SDPA_BACKENDS); the flash, memory-efficient
    and math kernels stay on. The switches are torch's global flags, readable on a CPU build."""
    import torch.nn.functional as F

    from moe_rl.megatron.packing import pack_rows

    ours, _ = _pair(tiny_model_cfg)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **kw):
        b = torch.backends.cuda
        seen.append(
            (
                b.cudnn_sdp_enabled(),
                b.flash_sdp_enabled(),
                b.mem_efficient_sdp_enabled(),
                b.math_sdp_enabled(),
            )
        )
        return real(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    tok = torch.randint(0, tiny_model_cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _forward(ours, tok)
        dense = len(seen)
        pack = pack_rows(tok, torch.tensor([11, 1, 7]))
        ours(
            input_ids=pack.inputs_P[None],
            position_ids=pack.pos_N[None],
            attention_mask=None,
            packed_seq_params=pack.packed_seq_params("cpu"),
        )
    assert dense == tiny_model_cfg.num_layers and len(seen) == dense + 3 * tiny_model_cfg.num_layers
    assert set(seen) == {(False, True, True, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the forward


@pytest.mark.parametrize("release", ["2.10", "later"])
@pytest.mark.parametrize("gqa_arg", [True, False])
def test_varlen_call_matches_the_per_segment_attention(parallel_info, tiny_model_cfg, release, gqa_arg):
    """The CUDA pack path's call of torch's ``varlen_attn`` (both of its signatures, with and
    without ``enable_gqa``) computes the per-segment causal attention of the CPU path: checked
    with a stand-in of that signature that attends like flash varlen (it fails loudly on a
    causal flag it was not given or on keys it cannot broadcast)."""
    import torch.nn.functional as F

    from moe_rl.megatron.local_layers import SDPAttention, varlen_causal
    from moe_rl.megatron.packing import pack_rows

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, **kw):
        causal = kw.pop("window_size", None) == (-1, 0) if release == "later" else kw.pop("is_causal")
        gqa = kw.pop("enable_gqa", False)
        assert causal is True and not kw and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        assert gqa or k.shape[1] == q.shape[1]
        b = cu_q.tolist()
        outs = [
            F.scaled_dot_product_attention(
                *(x[lo:hi].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale, enable_gqa=gqa
            ).transpose(0, 1)
            for lo, hi in zip(b[:-1], b[1:])
        ]
        return torch.cat(outs)

    def later(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size, **kw)

    def later_no_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        return stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    def first(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False, enable_gqa=False):
        kw = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal, **kw)

    def first_no_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False):
        return stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal)

    fn = {
        ("later", True): later,
        ("later", False): later_no_gqa,
        ("2.10", True): first,
        ("2.10", False): first_no_gqa,
    }
    att = next(m for m in _pair(tiny_model_cfg)[0].modules() if isinstance(m, SDPAttention))
    cfg = tiny_model_cfg
    pack = pack_rows(torch.zeros(3, 12, dtype=torch.long), torch.tensor([11, 1, 7]))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(pack.p, cfg.num_attention_heads, cfg.head_dim, generator=g)
    k, v = (torch.randn(pack.p, cfg.num_query_groups, cfg.head_dim, generator=g) for _ in range(2))
    assert cfg.num_query_groups != cfg.num_attention_heads
    params = pack.packed_seq_params("cpu")
    ref = att._packed(q, k, v, params)  # CPU: one SDPA per segment
    got = varlen_causal(
        fn[release, gqa_arg], q, k, v, params.cu_seqlens_q, params.max_seqlen_q, att.softmax_scale
    )
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


def test_the_expert_pass_runs_no_per_expert_op(parallel_info):
    """The experts' forward and backward dispatch the same ops at 4 and 64 experts (one grouped GEMM
    per projection each way; no per-expert matmul, split, copy or transpose) and never read the
    token counts on the host (the per-expert loop's ``tolist``: a device-to-host sync per layer)."""
    from moe_rl.megatron.local_layers import GroupedExperts
    from moe_rl.megatron.model import build_gpt
    from tests.ops import CountOps
    from tests.tiny import tiny_model_config

    counted = {}
    for experts in (4, 64):
        torch.manual_seed(0)
        model = build_gpt(tiny_model_config(num_experts=experts), ParallelConfig())
        module = next(m for m in model.modules() if isinstance(m, GroupedExperts))
        cnt = torch.full((experts,), 3)
        x = torch.randn(3 * experts, 64, requires_grad=True)
        with CountOps() as ops:
            y, _ = module(x, cnt, torch.rand(3 * experts))
            y.square().sum().backward()
        counted[experts] = ops.count
    assert counted[4] == counted[64], set(counted[4].items()) ^ set(counted[64].items())
    assert counted[4]["aten._grouped_mm"] == 6 and not counted[4]["aten._local_scalar_dense"]


def test_a_stacked_projection_takes_one_gradient_add_in_ddp(parallel_info, tiny_model_cfg):
    """Under megatron-core DDP each stacked projection's gradient lands in DDP's buffer by one add
    (its hook's), whatever the number of experts, over two micro-batches; the buffer holds what the
    per-expert loop's gradients sum to."""
    from moe_rl.config import OptimConfig
    from moe_rl.megatron.local_layers import GroupedExperts
    from moe_rl.megatron.optim import Optimizer
    from tests.ops import CountOps

    ours, _ = _pair(tiny_model_cfg)
    opt = Optimizer(ours, OptimConfig(lr=1e-3), parallel_info)
    experts = next(m for m in ours.modules() if isinstance(m, GroupedExperts))
    weights = [experts.linear_fc1.weight, experts.linear_fc2.weight]
    x = torch.randn(9, tiny_model_cfg.hidden_size)
    cnt, probs = torch.tensor([2, 0, 4, 3]), torch.rand(9)
    opt.zero_grad()
    with CountOps() as ops:
        for _ in range(2):  # two micro-batches accumulate
            out, _ = experts(x, cnt, probs)
            out.square().sum().backward()
    adds = sum(s in {tuple(w.shape) for w in weights} for s in ops.shapes["aten.add_"])
    assert adds == 2 * len(weights), adds
    want = torch.autograd.grad(
        2 * experts.per_expert(x, cnt, probs, weights[0], weights[1]).square().sum(), weights
    )
    for w, g in zip(weights, want):
        torch.testing.assert_close(w.main_grad, g, atol=1e-5, rtol=1e-5)


def test_fused_weighted_swiglu_computes_the_unfused_values(parallel_info, tiny_model_cfg, monkeypatch):
    """``bias_activation_fusion`` (on where CUDA and Triton are) runs megatron-core's weighted SwiGLU
    function: its formula and its hand-written backward (here eagerly, its compiler off: the CPU form of
    the fused op) give the unfused path's outputs and gradients, the routing probabilities' included."""
    import torch._dynamo

    from moe_rl.megatron.local_layers import GroupedExperts

    ours, _ = _pair(tiny_model_cfg)
    experts = next(m for m in ours.modules() if isinstance(m, GroupedExperts))
    x = torch.randn(9, tiny_model_cfg.hidden_size, requires_grad=True)
    probs = torch.rand(9, requires_grad=True)
    cnt = torch.tensor([2, 0, 4, 3])
    results = []
    for fused in (False, True):
        monkeypatch.setattr(experts, "_fused_glu", fused)
        with torch._dynamo.config.patch(disable=True):
            y, _ = experts(x, cnt, probs)
            w = torch.linspace(-1, 1, y.numel()).view_as(y)
            results.append((y, *torch.autograd.grad((y * w).sum(), [x, probs, experts.linear_fc1.weight])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_packed_attention_backward_does_not_grow_with_segments(parallel_info, tiny_model_cfg):
    """The CPU pack path's backward hands each segment's query/key/value gradient back in one
    concatenation, not one pack-sized zero tensor per segment and slice (``slice_backward``: a
    zero-fill of the whole pack per segment and its add, O(segments x pack) memory traffic): but for
    each segment's own attention backward, it dispatches the same ops for 2 and 12 segments of one
    pack, and its gradients are those of attention run on each segment alone."""
    import torch.nn.functional as F

    from moe_rl.megatron.local_layers import SDPAttention
    from moe_rl.megatron.packing import pack_rows
    from tests.ops import CountOps

    att = next(m for m in _pair(tiny_model_cfg)[0].modules() if isinstance(m, SDPAttention))
    cfg, counted = tiny_model_cfg, {}
    for lens in ([20, 28], [4] * 12):
        pack = pack_rows(torch.zeros(len(lens), 29, dtype=torch.long), torch.tensor(lens))
        g = torch.Generator().manual_seed(len(lens))
        q = torch.randn(pack.p, cfg.num_attention_heads, cfg.head_dim, generator=g, requires_grad=True)
        k, v = (
            torch.randn(pack.p, cfg.num_query_groups, cfg.head_dim, generator=g, requires_grad=True)
            for _ in range(2)
        )
        out = att._packed(q, k, v, pack.packed_seq_params("cpu"))
        with CountOps() as ops:
            out.square().sum().backward()
        # each segment's attention backward, and its view of the output's gradient (cat's backward)
        per_segment = (
            "aten._scaled_dot_product_flash_attention_for_cpu_backward",
            "aten.detach",
            "aten.slice",
        )
        counted[len(lens)] = {op: n for op, n in ops.count.items() if op not in per_segment}
        grads = [x.grad for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        bounds = pack.packed_seq_params("cpu").cu_seqlens_q.tolist()
        ref = torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(x[lo:hi].transpose(0, 1) for x in (q, k, v)),
                    is_causal=True,
                    scale=att.softmax_scale,
                    enable_gqa=True,
                ).transpose(0, 1)
                for lo, hi in zip(bounds[:-1], bounds[1:])
            ]
        )
        ref.square().sum().backward()
        for got, want in zip(grads, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counted[2] == counted[12], counted
