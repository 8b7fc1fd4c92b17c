"""Faster drop-ins for two modules of megatron-core's local (non transformer-engine) layer spec.

Without transformer-engine (CPU, or a GPU without the package) megatron-core builds
``DotProductAttention`` and ``SequentialMLP``. Both are correct and slow at RL's small
per-call sizes: the first materialises GQA's repeated keys/values (``repeat_interleave``
copies the whole KV cache on every decode step) and runs an unfused baddbmm / mask /
softmax / bmm; the second runs each expert through megatron's linear wrappers, ~10 ops
per expert per layer. The modules below keep the stock ones' constructors and checkpoint
entries (so checkpoints, HF mapping, routing replay and the optimizer see the same model):

- :class:`SDPAttention`: ``torch.nn.functional.scaled_dot_product_attention`` with
  ``enable_gqa`` (no repeated keys) and the parent's masking rule (causal when
  ``sq > 1``, none for a one-token decode step against a KV cache), on torch's flash,
  memory-efficient or math kernels, never cuDNN's (:data:`SDPA_BACKENDS`);
- :class:`GroupedExperts`: every local expert's projection as one stacked parameter (megatron-core's
  grouped-GEMM experts' shape of state) and the dispatcher's expert-sorted tokens through them in
  one ``torch._grouped_mm`` per projection over transposed views of the stacks (no copy; gradients
  land in the stacks), on CPU as on CUDA (:meth:`GroupedExperts.grouped`); the lean decoder calls
  the same method with its own snapshot of the weights (:meth:`GroupedExperts.input_major`), and a
  per-expert loop serves where this torch has no grouped GEMM for the device and dtype;
  probabilities applied after the GLU and before ``linear_fc2``, in the same dtypes as megatron's
  MLP.

``tests/unit/test_local_layers.py`` checks both against the stock modules (values and
gradients of every parameter) on the same weights.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
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
        bounds = getattr(params, "host_bounds", None) or params.cu_seqlens_q.tolist()  # no device read
        sizes = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        # split, not slices: the backward joins the segments' gradients in one cat, where a slice's
        # backward writes its segment into a zero tensor of the whole pack, once per segment
        q, k, v = (x.transpose(0, 1).unsqueeze(0).split(sizes, dim=2) for x in (query, key, value))
        outs = [
            F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=qs.shape[2] > 1, scale=self.softmax_scale, enable_gqa=gqa
            )  # [1, heads, segment, hn]
            for qs, ks, vs in zip(q, k, v)
        ]
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


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: torch's grouped GEMM backward refuses
    a broadcast (stride-0) gradient, such as ``out.sum().backward()`` gives."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class ExpertWeights(torch.nn.Module):
    """One projection of every local expert as one parameter: ``weight [E, out, in]``, expert e's
    ``weight[e]`` in its own ``nn.Linear`` layout."""

    def __init__(self, experts: int, out_features: int, in_features: int, *, dtype, device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(experts, out_features, in_features, dtype=dtype, device=device)
        )


class GroupedExperts(MegatronModule):
    """Every local expert's SwiGLU MLP, one parameter per projection (megatron-core's grouped-GEMM
    experts' shape of state; module docstring): ``linear_fc1.weight [E, 2F, H]`` (expert e's rows
    ``[gate; up]``) and ``linear_fc2.weight [E, H, F]``.

    Built where megatron-core builds ``SequentialMLP`` (same constructor), with the values
    ``SequentialMLP`` would draw (each expert's ``linear_fc1`` then ``linear_fc2``, expert by expert,
    by megatron-core's own CPU initialiser) and the same parameter attributes, so a seed gives the same
    policy in either layout; its checkpoint keys and global shapes are ``SequentialMLP``'s
    (:meth:`sharded_state_dict`). The forward is one ``torch._grouped_mm`` per projection over the
    stacked weights seen input-major (a transposed view: no copy), on CPU as on CUDA; a per-expert
    loop where this torch has no grouped GEMM for the device and dtype."""

    def __init__(self, num_local_experts, config, submodules=None, pg_collection=None, **_kwargs):
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
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = (
            pg_collection.ep,
            pg_collection.expt_tp,
            pg_collection.expt_dp,
        )
        h, f = config.hidden_size, config.moe_ffn_hidden_size
        kw = dict(
            dtype=config.params_dtype,
            device=None if config.use_cpu_initialization else torch.cuda.current_device(),
        )
        self.linear_fc1 = ExpertWeights(num_local_experts, 2 * f, h, **kw)
        self.linear_fc2 = ExpertWeights(num_local_experts, h, f, **kw)
        # SequentialMLP's experts' attributes (column-parallel fc1 with GLU stride 2, row-parallel
        # fc2), one dimension further for the expert axis
        for w, dim, stride in ((self.linear_fc1.weight, 1, 2), (self.linear_fc2.weight, 2, 1)):
            set_tensor_model_parallel_attributes(w, True, dim, stride)
            w.allreduce = self.ep_group.size() == 1
        if config.perform_initialization:
            self._initialize(config)
        self._act = config.activation_func
        self._offset = getattr(config, "glu_linear_offset", 0.0)
        self._fused_glu = bool(config.bias_activation_fusion) and self._act is F.silu and not self._offset

    @torch.no_grad()
    def _initialize(self, config) -> None:
        """Each expert's weights as ``SequentialMLP``'s MLP draws them on CPU (megatron-core's
        ``_initialize_affine_weight_cpu``, expert by expert, fc1 then fc2)."""
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        (_, f2, h), f = w1.shape, w2.shape[2]
        for e in range(self.num_local_experts):
            for w, out, inp, dim, init in (
                (w1, f2, h, 0, config.init_method),
                (w2, h, f, 1, config.output_layer_init_method),
            ):
                part = torch.empty(out, inp, dtype=w.dtype)
                _initialize_affine_weight_cpu(
                    part,
                    out,
                    inp,
                    out if dim == 0 else inp,
                    dim,
                    init,
                    params_dtype=w.dtype,
                    rank=0,
                    world_size=1,
                )
                w[e].copy_(part)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """Tokens sorted by local expert ([N, H], counts [E], probs [N]) -> ([N, H], None)."""
        w1t, w2t = self.input_major()
        return self.grouped(permuted_local_hidden_states, tokens_per_expert, permuted_probs, w1t, w2t), None

    def input_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights as a grouped matmul ``x @ w`` reads them: ``w1t [E, H, 2F]`` and
        ``w2t [E, F, H]``, transposed views of the parameters (no copy; gradients land in them)."""
        return self.linear_fc1.weight.transpose(1, 2), self.linear_fc2.weight.transpose(1, 2)

    def grouped(self, x, tokens_per_expert, probs, w1t, w2t) -> torch.Tensor:
        """The experts' SwiGLU MLPs over expert-sorted tokens ``x [N, H]`` (``tokens_per_expert``
        rows each) with input-major weights (:meth:`input_major`, or an all-gathered copy of
        them): one grouped matmul per projection where :func:`grouped_mm_ok` (CUDA also needs
        16-byte aligned rows), else :meth:`per_expert`."""
        if x.shape[0] > 0 and grouped_mm_ok(x) and (not x.is_cuda or _aligned(x, w1t, w2t)):
            offs = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
            h = self._glu_probs(torch._grouped_mm(x, w1t, offs=offs), probs).to(x.dtype)
            return _ContiguousGrad.apply(torch._grouped_mm(h, w2t, offs=offs))
        return self.per_expert(x, tokens_per_expert, probs, w1t.transpose(1, 2), w2t.transpose(1, 2))

    def per_expert(self, x, tokens_per_expert, probs, w1, w2) -> torch.Tensor:
        """The same MLPs with one ``F.linear`` per expert; ``w1[e]``, ``w2[e]``: expert e's weights in
        their ``nn.Linear`` layout (one host read of the counts)."""
        parts = []
        counts = tokens_per_expert.tolist()
        for e, (xe, pe) in enumerate(zip(torch.split(x, counts), torch.split(probs, counts))):
            parts.append(F.linear(self._glu_probs(F.linear(xe, w1[e]), pe).to(xe.dtype), w2[e]))
        return torch.cat(parts, dim=0)

    def _glu_probs(self, h, probs):
        """``silu(gate) * up`` scaled by each row's routing probability (megatron-core's weighted
        SwiGLU; its fused form with ``bias_activation_fusion``)."""
        if self._fused_glu:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1))
        gate, lin = torch.chunk(h, 2, dim=-1)
        if self._offset:  # megatron-core's glu_linear_offset; its default 0 adds nothing: no op for it
            lin = lin + self._offset
        return self._act(gate) * lin * probs.unsqueeze(-1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``SequentialMLP``'s checkpoint entries: ``<prefix>experts.linear_fc{1,2}.weight``, global
        ``[..., E, out, in]`` with this rank's experts at ``ep_rank * E_local``, replicated over the
        expert-data-parallel group; one ShardedTensor per projection (the parameter itself), which
        loads from a per-expert checkpoint's pieces as from a stacked one's."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        if (metadata or {}).get("singleton_local_shards"):
            raise NotImplementedError("GroupedExperts: singleton_local_shards checkpoints")
        axis = len(sharded_offsets)
        out = {}
        for name in ("linear_fc1", "linear_fc2"):
            out[f"{prefix}{name}.weight"] = ShardedTensor.from_rank_offsets(
                f"{prefix}experts.{name}.weight",
                getattr(self, name).weight,
                *sharded_offsets,
                (axis, self.ep_group.rank(), self.ep_group.size()),
                replica_id=(0, 0, self.dp_group.rank()),
                prepend_axis_num=axis,
            )
        return out

    def backward_dw(self):
        """No delayed weight gradients (megatron-core's experts interface)."""
