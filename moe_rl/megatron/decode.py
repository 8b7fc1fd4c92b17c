"""A lean KV-cache decoder over the megatron-core policy's own parameters (rollout only).

megatron-core's static inference path is built for GPUs with flash-decode: without it,
every decode step re-applies RoPE to the whole key cache and (local spec) repeats GQA
keys/values, so a step costs O(context) copies on top of the layer's ~50 module calls.
This module runs the same Qwen3-MoE computation as :func:`moe_rl.megatron.model.build_gpt`'s
local spec, reading the *live* parameter tensors (no copy: the engine still shares the
trainer's weights), with:

- a preallocated cache of rotated keys and values, ``[b, groups, T, head_dim]`` per layer,
  written in place;
- decode attention with the query heads of a group folded into the query dimension
  (``[b, g, heads_per_group, d] @ [b, g, d, T]``: no repeated keys), prefill by SDPA;
- the router and experts as in megatron-core (router logits in the model's ``moe_router_dtype``:
  fp32 for the trainer's policy, the weights' dtype for a low-precision replica; top-k then softmax over
  the chosen logits, or softmax then top-k; tokens sorted by expert into the layer's own
  :class:`~moe_rl.megatron.local_layers.GroupedExperts`);
- the output layer applied to the last position only.

It returns each layer's top-k expert indices of every fed token, and on request their gate
weights, so routing capture (R3, and the gates ``algo.replay_gate_weights`` replays) needs no
hooks. Under expert parallelism :meth:`Decoder.begin` all-gathers every layer's
expert weights over the EP group once per ``generate`` call (collective; the stacked copy
lives until the next call), so decoding itself needs no all-to-all and ranks decode their
own prompts independently: the memory of all experts on every rank, in exchange for no
per-token collectives. :func:`unsupported_reason` says when it cannot serve a policy
(tensor parallelism, the transformer-engine spec); the engine then uses megatron-core's
path. ``tests/unit/test_decode.py`` pins it to megatron-core's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_rl.dist import all_gather_cat
from moe_rl.megatron.local_layers import GroupedExperts, SDPAttention
from moe_rl.megatron.rope import rotate, signed_sin
from moe_rl.megatron.routing import selection_noise
from moe_rl.routing.noise import selection_key


def unsupported_reason(policy) -> str | None:
    """Why :class:`Decoder` cannot run ``policy`` (None when it can)."""
    info = policy.info
    if info.tp_size > 1:
        return f"tensor_parallel={info.tp_size} (sequence parallelism cannot feed one token per step)"
    layers = policy.model.decoder.layers
    for layer in layers:
        if not isinstance(layer.self_attention.core_attention, SDPAttention):
            return "the policy was not built with the local spec (transformer-engine layers)"
        if not isinstance(layer.mlp.experts, GroupedExperts):
            return "the policy's experts are not GroupedExperts"
        if getattr(layer.mlp, "shared_experts", None) is not None:
            return "shared experts"
    cfg = policy.model.config
    if cfg.rotary_interleaved or getattr(policy.model, "position_embedding_type", "rope") != "rope":
        return "only non-interleaved RoPE is implemented"
    return None


@dataclass
class KVCache:
    """Rotated keys / values per layer, ``[b, groups, T, head_dim]``; ``length`` tokens filled."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (in that order)."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]


class Decoder:
    """Prefill / decode forward of a megatron-core GPTModel (local spec, TP = 1, any EP)."""

    def __init__(self, policy):
        reason = unsupported_reason(policy)
        if reason is not None:
            raise ValueError(f"Decoder cannot run this policy: {reason}")
        self.policy = policy
        model, cfg = policy.model, policy.cfg
        self.heads, self.groups, self.head_dim = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
        self.heads_per_group = self.heads // self.groups
        self.topk, self.num_experts = cfg.moe_router_topk, cfg.num_experts
        self.pre_softmax = not cfg.moe_norm_topk_prob
        self.scale = model.decoder.layers[0].self_attention.core_attention.softmax_scale
        freqs = model.rotary_pos_emb(cfg.max_seq_len)  # [S, 1, 1, hd], megatron's own table
        # [S, 1, hd]: position s's row broadcasts over a step's [b, n, heads, hd] queries and keys;
        # the sine as rope.rotate takes it (its first half negated)
        self.cos = torch.cos(freqs).reshape(cfg.max_seq_len, 1, self.head_dim)
        self.sin_signed = signed_sin(torch.sin(freqs).reshape(cfg.max_seq_len, 1, self.head_dim))
        self.router_fp32 = model.config.moe_router_dtype == "fp32"  # else the router runs in its own dtype
        self._experts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._routers: list[torch.Tensor] = []

    # -- weights and cache ------------------------------------------------------------------
    @torch.no_grad()
    def begin(self) -> None:
        """Take every layer's input-major expert weights ``[E, H, 2F]`` / ``[E, F, H]``
        (:meth:`GroupedExperts.input_major`: views of the parameters) and router weight (fp32 when the model's
        ``moe_router_dtype`` is fp32, as megatron computes it) for one generate() call (the
        weights do not change during it). Under EP the experts are
        all-gathered over the EP group in rank order (megatron's global expert id = ep_rank *
        local_experts + i): every rank of the group must call this together."""
        info = self.policy.info
        self._experts, self._routers = [], []
        for layer in self.policy.model.decoder.layers:
            w1t, w2t = layer.mlp.experts.input_major()  # [E, H, 2F], [E, F, H]
            if info.ep_size > 1:
                w1t, w2t = (all_gather_cat(w, info.ep_group, dim=0) for w in (w1t, w2t))
            self._experts.append((w1t, w2t))
            router = layer.mlp.router.weight
            self._routers.append(router.float() if self.router_fp32 else router)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for ``batch`` rows of up to ``max_len`` tokens."""
        if not self._experts:
            raise RuntimeError("Decoder.begin() must run before the first cache of a generate call")
        layers = self.policy.model.decoder.layers
        p = self.policy.model.embedding.word_embeddings.weight
        shape = (batch, self.groups, max_len, self.head_dim)
        return KVCache(k=[p.new_empty(shape) for _ in layers], v=[p.new_empty(shape) for _ in layers])

    # -- forward ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        cache: KVCache,
        tokens_bn: torch.Tensor,
        start: int,
        want_routes: bool = False,
        gates_out: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Feed ``tokens_bn`` at positions ``start ..``; logits of the last position ``[b, V]``.

        ``start`` must equal ``cache.length``; several tokens only at ``start == 0`` (the
        prefill). Routes: per layer ``[n * b, K]`` top-k indices, sequence-major (row
        ``s * b + r``, megatron's token order). ``gates_out``: a list to which each layer's gate
        weights of those experts are appended, ``[n * b, K]`` float32 in the same order.
        """
        b, n = tokens_bn.shape
        if start != cache.length:
            raise ValueError(f"start={start} but the cache holds {cache.length} tokens")
        if n > 1 and start != 0:
            raise ValueError("several tokens per row only for the prefill (start 0)")
        model = self.policy.model
        x = F.embedding(tokens_bn, model.embedding.word_embeddings.weight)  # [b, n, H]
        # every layer's query and key rotate by the same two tables
        cos, sin_s = self.cos[start : start + n].to(x.dtype), self.sin_signed[start : start + n].to(x.dtype)
        routes = [] if want_routes else None
        for layer_idx, layer in enumerate(model.decoder.layers):
            x = x + self._attention(layer, layer.input_layernorm(x), cache, layer_idx, start, cos, sin_s)
            y, idx, probs = self._moe(layer, layer_idx, layer.pre_mlp_layernorm(x))
            x = x + y
            if routes is not None:
                routes.append(idx.view(b, n, -1).transpose(0, 1).reshape(n * b, -1))
            if gates_out is not None:
                gates_out.append(probs.float().view(b, n, -1).transpose(0, 1).reshape(n * b, -1))
        cache.length = start + n
        h = model.decoder.final_layernorm(x[:, -1])
        return F.linear(h, self.policy.output_weight()), routes

    def _attention(self, layer, x, cache: KVCache, layer_idx: int, start: int, cos, sin_s):
        att = layer.self_attention
        b, n, _ = x.shape
        g, rep, hd = self.groups, self.heads_per_group, self.head_dim  # groups, heads per group, head dim
        qkv = F.linear(x, att.linear_qkv.weight).view(b, n, g, (rep + 2) * hd)
        q, k, v = torch.split(qkv, [rep * hd, hd, hd], dim=-1)
        q = q.reshape(b, n, g * rep, hd)
        if att.q_layernorm is not None:
            q, k = att.q_layernorm(q), att.k_layernorm(k)
        # megatron's non-interleaved RoPE, as the trainer's packed forward rotates: [b, n, heads, hd]
        q, k = rotate(q, cos, sin_s), rotate(k, cos, sin_s)
        end = start + n
        cache.k[layer_idx][:, :, start:end] = k.transpose(1, 2)
        cache.v[layer_idx][:, :, start:end] = v.transpose(1, 2)
        keys, values = cache.k[layer_idx][:, :, :end], cache.v[layer_idx][:, :, :end]
        if n == 1:  # one query per row: fold the group's heads into the query dimension
            # (b, g) as one batch dimension of views (the cache's rows are [g, T, hd] blocks):
            # the batched matmuls torch.matmul would reach through expands and reshapes
            qg, kg, vg = (
                q.reshape(b * g, rep, hd),
                keys.reshape(b * g, end, hd),
                values.reshape(b * g, end, hd),
            )
            s = torch.bmm(qg, kg.transpose(1, 2)) * self.scale  # [b * g, rep, T]
            p = torch.softmax(s.float(), dim=-1).to(values.dtype)
            out = torch.bmm(p, vg).view(b, 1, g * rep * hd)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, is_causal=True, scale=self.scale, enable_gqa=rep > 1
            )
            out = out.transpose(1, 2).reshape(b, n, g * rep * hd)
        return F.linear(out, att.linear_proj.weight)

    def _moe(self, layer, layer_idx: int, x):
        """Routed experts of ``x [b, n, H]`` -> (output [b, n, H], top-k indices [b*n, K], their
        gate weights [b*n, K])."""
        mlp = layer.mlp
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        idx, probs = self._route(layer_idx, t)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token-major slots sorted by expert
        token = order // self.topk
        counts = torch.bincount(flat, minlength=self.num_experts)
        ys = mlp.experts.grouped(
            t.index_select(0, token), counts, probs.reshape(-1)[order], *self._experts[layer_idx]
        )
        out = torch.zeros_like(t).index_add_(0, token, ys)
        return out.view(shape), idx, probs

    def _route(self, layer_idx: int, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router of layer ``layer_idx`` on tokens ``t [N, H]``: top-k indices ``[N, K]`` and
        their gate weights ``[N, K]`` (in the router's dtype), as megatron-core's router computes
        them; under selection noise the gates are the clean scores of the chosen experts."""
        router = self._routers[layer_idx]
        logits = F.linear(t.to(router.dtype), router)  # [N, E] in the router's dtype, as megatron's
        noise = selection_noise(self.policy)  # the decode loop's, as install_route_choice applies it
        if self.pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            if noise.active:
                idx = noise.topk(selection_key(scores, pre_softmax=True), self.topk)
                probs = scores.gather(1, idx)
            else:
                probs, idx = torch.topk(scores, self.topk, dim=-1)
        else:
            if noise.active:
                idx = noise.topk(selection_key(logits, pre_softmax=False), self.topk)
                top = logits.gather(1, idx)
            else:
                top, idx = torch.topk(logits, self.topk, dim=-1)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
        return idx, probs
