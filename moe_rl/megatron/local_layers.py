"""Faster drop-ins for two modules of megatron-core's local (non transformer-engine) layer spec.

Without transformer-engine (CPU, or a GPU without the package) megatron-core builds
``DotProductAttention`` and ``SequentialMLP``. Both are correct and slow at RL's small
per-call sizes: the first materialises GQA's repeated keys/values (``repeat_interleave``
copies the whole KV cache on every decode step) and runs an unfused baddbmm / mask /
softmax / bmm; the second runs each expert through megatron's linear wrappers, ~10 ops
per expert per layer. The subclasses below keep their parents' parameters, names,
sharded state dicts and constructor (so checkpoints, HF mapping, routing replay and the
optimizer see the same model) and change only ``forward``:

- :class:`SDPAttention`: ``torch.nn.functional.scaled_dot_product_attention`` with
  ``enable_gqa`` (no repeated keys) and the parent's masking rule (causal when
  ``sq > 1``, none for a one-token decode step against a KV cache), on torch's flash,
  memory-efficient or math kernels, never cuDNN's (:data:`SDPA_BACKENDS`);
- :class:`GroupedExperts`: the dispatcher's expert-sorted tokens through each local expert in one
  ``F.linear`` per projection on the expert's own weights (no per-forward stacked copy: on CPU
  the copy cost more than the matmuls); :meth:`GroupedExperts.grouped` runs the same math by
  ``torch._grouped_mm`` on stacked weights: on CUDA the training forward's
  (:meth:`GroupedExperts.stacked_views`, whose backward needs no per-expert copy), the lean
  decoder's input-major snapshot (:meth:`GroupedExperts.stacked_weights`); probabilities
  applied after the GLU and before ``linear_fc2``, in the same dtypes as megatron's MLP.

``tests/unit/test_local_layers.py`` checks both against the stock modules (values and
gradients of every parameter) on the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.experts import SequentialMLP
from torch.nn.attention import SDPBackend, sdpa_kernel

#: The SDPA kernels attention may run on, in torch's own order of preference. cuDNN's is left
#: out: on an H200 (torch 2.11+cu130, bf16) its backward over the packed path's per-segment views
#: failed ("mha_graph.execute(...).is_good()") and left an illegal memory access that ended the
#: process's CUDA context (benchmarks/results/gpu_check-nvidia-h200-a3f34b9.json, moe_1b).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

_GROUPED_MM: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_ok(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` serves ``x``'s device type and dtype in this torch, probed
    once per pair (on CPU most dtypes; CUDA builds restrict it to bf16 on sm90 and later, with
    16-byte aligned strides: :func:`_aligned`)."""
    if not hasattr(torch, "_grouped_mm") or x.device.type not in ("cpu", "cuda"):
        return False
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_MM:
        try:
            a = torch.ones(16, 16, dtype=x.dtype, device=x.device)
            b = torch.ones(2, 16, 16, dtype=x.dtype, device=x.device)
            torch._grouped_mm(a, b, offs=torch.tensor([8, 16], dtype=torch.int32, device=x.device))
            _GROUPED_MM[key] = True
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM[key] = False
    return _GROUPED_MM[key]


def _aligned(*tensors: torch.Tensor) -> bool:
    """Every dimension but the first spans a multiple of 16 bytes, so every row of the operands
    (and of the intermediate ``[N, F]``) starts 16-byte aligned, as CUDA grouped GEMMs need."""
    return all(d * t.element_size() % 16 == 0 for t in tensors for d in t.shape[1:])


class SDPAttention(DotProductAttention):
    """DotProductAttention computed by torch SDPA (same parameters, same masking rule)."""

    def __init__(self, config, *args, **kwargs):
        unsupported = {
            "attention_dropout": config.attention_dropout != 0.0,
            "apply_query_key_layer_scaling": bool(config.apply_query_key_layer_scaling),
            "softmax_type": getattr(config, "softmax_type", "vanilla") != "vanilla",
            "window_size": getattr(config, "window_size", None) is not None,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"SDPAttention does not implement {bad}; build the stock local spec")
        super().__init__(config, *args, **kwargs)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """[sq, b, np, hn] queries, [sk, b, ng, hn] keys/values -> [sq, b, np * hn]; packed
        (``thd``): [t, np, hn] and [t, ng, hn] -> [t, np * hn], causal within each segment."""
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention bias needs the transformer-engine spec")
        with sdpa_kernel(SDPA_BACKENDS):
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params)
            return self._dense(query, key, value, attention_mask)

    def _dense(self, query, key, value, attention_mask):
        sq, b, heads, hn = query.shape
        sk, groups = key.shape[0], key.shape[2]
        mask, causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend
        elif self.attn_mask_type == AttnMaskType.causal and sq > 1:
            # the parent's rule: a causal mask only for self-attention of a whole sequence;
            # one query against a KV cache attends to every cached key
            if sq != sk:
                raise ValueError(f"causal attention needs sq == sk, got {sq} and {sk}")
            causal = True
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale, enable_gqa=groups != heads
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _packed(self, query, key, value, params):
        """Causal SDPA of every segment of a ``thd`` pack on its own (no position attends across
        a boundary, none is computed twice): the exact block-diagonal causal attention. On CUDA
        in fp16/bf16, one flash varlen call (torch's ``varlen_attn``) for the whole pack;
        elsewhere one SDPA per segment."""
        if params.qkv_format != "thd" or self.attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError("SDPAttention: packed sequences need qkv_format='thd', causal")
        if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
            fn = _varlen_attn()
            if fn is not None:
                return varlen_causal(
                    fn, query, key, value, params.cu_seqlens_q, params.max_seqlen_q, self.softmax_scale
                )
        t, heads, hn = query.shape
        gqa = key.shape[1] != heads
        bounds = params.cu_seqlens_q.tolist()
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, t, hn]
        outs = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, lo:hi],
                    k[:, :, lo:hi],
                    v[:, :, lo:hi],
                    is_causal=hi - lo > 1,
                    scale=self.softmax_scale,
                    enable_gqa=gqa,
                )
            )
        return torch.cat(outs, dim=2)[0].transpose(0, 1).reshape(t, heads * hn)


def _varlen_attn():
    """torch's ``torch.nn.attention.varlen.varlen_attn`` (flash attention over packed
    variable-length sequences; torch >= 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_causal(fn, query, key, value, cu_seqlens, max_seqlen, scale) -> torch.Tensor:
    """``[t, heads, hn]`` queries and ``[t, groups, hn]`` keys/values of a pack -> ``[t, heads *
    hn]``, causal within each segment, by ``fn`` (``varlen_attn``'s signature). torch 2.10 takes
    ``is_causal``, later releases ``window_size=(-1, 0)``; GQA by ``enable_gqa`` where ``fn``
    has it, else by repeating the keys and values."""
    import inspect

    t, heads, hn = query.shape
    accepts = inspect.signature(fn).parameters
    kw = {"scale": scale}
    if "window_size" in accepts:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if key.shape[1] != heads:
        if "enable_gqa" in accepts:
            kw["enable_gqa"] = True
        else:
            rep = heads // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    m = int(max_seqlen)
    return fn(query, key, value, cu, cu, m, m, **kw).reshape(t, heads * hn)


class StackIntoMainGrad(torch.autograd.Function):
    """``torch.stack(weights)`` whose backward, under megatron-core DDP, accumulates the weights'
    gradients into their ``main_grad`` itself: one fused add for all of them
    (``torch._foreach_add_``) instead of DDP's per-parameter hook adding each ``param.grad``.

    transformer-engine's gradient-accumulation fusion under the same contract: each weight is
    marked ``grad_added_to_main_grad`` (DDP resets it when it zeroes its buffer) and handed a
    gradient of the right shape that is never read (an uninitialised allocation; zeros where
    ``zero_out_wgrad`` asks for them), so its accumulator and DDP's hook still run (the bucket's
    readiness with ``overlap_grad_reduce``) but the hook skips its ``main_grad.add_``. Weights
    without a ``main_grad`` (no DDP: inference, a bare module) get the stack's own backward.

    One rule then holds within a backward window: a weight marked added takes no ``param.grad``
    from elsewhere. :class:`GroupedExperts` uses the stack for every CUDA training forward of
    its experts; only a micro-batch routing no token to this rank's experts takes the per-expert
    path, whose gradients are zeros."""

    @staticmethod
    def forward(ctx, *weights):
        ctx.weights = weights
        return torch.stack(weights)

    @staticmethod
    def backward(ctx, grad):
        weights, ctx.weights = ctx.weights, None
        if not all(hasattr(w, "main_grad") and hasattr(w, "grad_added_to_main_grad") for w in weights):
            return grad.unbind(0)
        mains = [w.main_grad for w in weights]
        torch._foreach_add_(mains, list(grad.to(mains[0].dtype).unbind(0)))
        for w in weights:
            w.grad_added_to_main_grad = True
        zero = any(getattr(w, "zero_out_wgrad", False) for w in weights)
        return (torch.zeros_like(grad) if zero else torch.empty_like(grad)).unbind(0)


class GroupedExperts(SequentialMLP):
    """SequentialMLP whose forward runs all local experts as one grouped matmul per projection."""

    def __init__(self, num_local_experts, config, submodules, **kwargs):
        unsupported = {
            "add_bias_linear": config.add_bias_linear,
            "gated_linear_unit must be true": not config.gated_linear_unit,
            "moe_apply_probs_on_input": config.moe_apply_probs_on_input,
            "fp8/fp4": bool(config.fp8 or getattr(config, "fp4", None)),
            "activation_func_clamp_value": getattr(config, "activation_func_clamp_value", None) is not None,
            "expert_tensor_parallel_size > 1": (config.expert_tensor_parallel_size or 1) > 1,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"GroupedExperts does not implement {bad}; build the stock local spec")
        super().__init__(num_local_experts, config, submodules, **kwargs)
        self._act = config.activation_func
        self._offset = getattr(config, "glu_linear_offset", 0.0)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """Tokens sorted by local expert ([N, H], counts [E], probs [N]) -> ([N, H], None).

        One matmul per expert and projection on the experts' own weights: no stacked copy of
        them (a copy per forward costs more than the matmuls of a small batch on CPU) and
        gradients land in each expert's parameters directly; same values as :meth:`grouped`.
        On CUDA, where this torch's grouped GEMM takes the dtype: :meth:`grouped` on a stacked
        copy (:meth:`stacked_views`; a 64-expert layer is ~6 kernels instead of ~400; the copy is
        a small memcpy)."""
        x = permuted_local_hidden_states
        if x.is_cuda and x.shape[0] > 0 and grouped_mm_ok(x):
            w1t, w2t = self.stacked_views()
            if _aligned(x, w1t, w2t):
                return self.grouped(x, tokens_per_expert, permuted_probs, w1t, w2t), None
        w1 = [e.linear_fc1.weight for e in self.local_experts]
        w2 = [e.linear_fc2.weight for e in self.local_experts]
        return self.per_expert(permuted_local_hidden_states, tokens_per_expert, permuted_probs, w1, w2), None

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Input-major stacked copies: ``linear_fc1`` weights transposed, ``w1t [E, H, 2F]``, and
        ``linear_fc2`` weights transposed, ``w2t [E, F, H]``, contiguous (the layout a grouped
        matmul ``x @ w`` reads without a strided pass; the copies carry gradients back to each
        expert's parameters)."""
        w1t, w2t = self.stacked_views()
        return w1t.contiguous(), w2t.contiguous()

    def stacked_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training forward's stacked weights on CUDA: each projection's weights stacked in their
        own layout (``linear_fc1``: ``[E, 2F, H]``) and seen input-major (``.transpose(1, 2)``:
        ``[E, H, 2F]``, column-major, which the grouped GEMM reads as it reads a transposed
        operand). Unlike :meth:`stacked_weights` the backward then hands expert e its gradient as a
        contiguous slice in the weight's own layout, which autograd accumulates as it is: no
        per-expert copy and transpose (on the H100's 1B pass, 1,280 of each per training pass).
        Under megatron-core DDP the stack's backward adds them all to DDP's buffer at once
        (:class:`StackIntoMainGrad`)."""
        w1 = StackIntoMainGrad.apply(*(e.linear_fc1.weight for e in self.local_experts))
        w2 = StackIntoMainGrad.apply(*(e.linear_fc2.weight for e in self.local_experts))
        return w1.transpose(1, 2), w2.transpose(1, 2)

    def grouped(self, x, tokens_per_expert, probs, w1t, w2t) -> torch.Tensor:
        """The experts' SwiGLU MLPs over expert-sorted tokens ``x`` with stacked input-major weights
        (:meth:`stacked_views` or :meth:`stacked_weights`; one grouped matmul per projection where :func:`grouped_mm_ok`;
        :meth:`per_expert` elsewhere)."""
        if x.shape[0] > 0 and grouped_mm_ok(x) and (not x.is_cuda or _aligned(x, w1t, w2t)):
            offs = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
            h = torch._grouped_mm(x, w1t, offs=offs)
            h = (self._glu(h) * probs.unsqueeze(-1)).to(x.dtype)
            return torch._grouped_mm(h, w2t, offs=offs)
        return self.per_expert(x, tokens_per_expert, probs, w1t.transpose(1, 2), w2t.transpose(1, 2))

    def per_expert(self, x, tokens_per_expert, probs, w1, w2) -> torch.Tensor:
        """The experts' SwiGLU MLPs, one ``F.linear`` per expert; ``w1[e]``, ``w2[e]``: expert e's
        weights (stacked tensors or lists)."""
        parts = []
        counts = tokens_per_expert.tolist()
        for e, (xe, pe) in enumerate(zip(torch.split(x, counts), torch.split(probs, counts))):
            h = (self._glu(F.linear(xe, w1[e])) * pe.unsqueeze(-1)).to(xe.dtype)
            parts.append(F.linear(h, w2[e]))
        return torch.cat(parts, dim=0)

    def _glu(self, h):
        gate, lin = torch.chunk(h, 2, dim=-1)
        return self._act(gate) * (lin + self._offset)
