"""The MoE policy: a megatron-core GPTModel with a log-prob forward.

Shape legend: B = sequences, T = padded tokens per sequence, V = local vocab shard,
L = MoE layers, K = experts per token, N = packed input positions (moe_rl.megatron.packing).

Alignment (same as moe_rl.rollout.types): ``logp_BT[b, t]`` is
log pi(tokens[b, t] | tokens[b, <t]) for t >= 1 and 0 at t = 0. The model's input is
``tokens[:, :-1]``, so routes are per input position t < T - 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moe_rl.config import ModelConfig, ParallelConfig
from moe_rl.kernels import logprobs_from_hidden, resolve_logprob_impl, triton_available
from moe_rl.kernels.logprob_reference import logprobs_entropy
from moe_rl.megatron.model import build_gpt, moe_routers
from moe_rl.megatron.packing import PackedRows, pack_rows
from moe_rl.megatron.parallel import ParallelInfo
from moe_rl.megatron.routing import install_route_choice

log = logging.getLogger(__name__)


@dataclass
class LogProbOutput:
    """Per-token outputs of one forward."""

    logp_BT: torch.Tensor
    "fp32 log-probs of the given tokens (0 at t = 0)."
    entropy_BT: torch.Tensor | None
    "fp32 entropy of the predictive distribution at each position (0 at t = 0), or None."


class _OutputLayerInput(torch.nn.Module):
    """Stands in for the output layer during a hidden-state forward: returns its input mapped as
    the column-parallel output layer maps it (all-gathered from sequence parallelism, or
    copied into the TP region), so gradients flow back exactly as through the real layer."""

    def __init__(self, layer):
        super().__init__()
        self.sequence_parallel = bool(getattr(layer, "sequence_parallel", False))
        self.group = layer.tp_group

    def forward(self, x, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel import mappings

        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(x, group=self.group), None
        return mappings.copy_to_tensor_model_parallel_region(x, group=self.group), None


class Policy:
    """megatron-core MoE GPTModel plus what RL needs from it."""

    def __init__(self, model_cfg: ModelConfig, parallel_cfg: ParallelConfig, info: ParallelInfo):
        self.cfg = model_cfg
        self.parallel_cfg = parallel_cfg
        self.info = info
        self.model = build_gpt(model_cfg, parallel_cfg)
        self.routers = moe_routers(self.model)
        install_route_choice(self)
        self.vocab_start = info.tp_rank * (model_cfg.vocab_size // info.tp_size)

    def replica(self, dtype: torch.dtype, *, router_fp32: bool) -> Policy:
        """An inference copy of this policy in ``dtype``, as a rollout server holds its own weights.

        Same architecture and layout; every weight is cast to ``dtype`` except, with
        ``router_fp32``, the routers, which then also compute their logits in fp32 (megatron's
        ``moe_router_dtype``); without it the router computes in ``dtype`` too. No gradients.
        Refresh it with :meth:`copy_weights_from`. Building it leaves the RNG state as it was.
        """
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # its random init must not move the trainer's RNG
            other = Policy(self.cfg, self.parallel_cfg, self.info)
        other.model.config.moe_router_dtype = "fp32" if router_fp32 else None
        other.model.to(dtype)
        if router_fp32:
            for router in other.routers:
                router.to(torch.float32)
        for p in other.model.parameters():
            p.requires_grad_(False)
        other.model.eval()
        other.copy_weights_from(self)
        return other

    @torch.no_grad()
    def copy_weights_from(self, src: Policy) -> None:
        """Copy (and cast) every weight of ``src``, a policy of the same architecture and layout."""
        mine, theirs = list(self.model.named_parameters()), list(src.model.named_parameters())
        if [n for n, _ in mine] != [n for n, _ in theirs]:
            raise ValueError("copy_weights_from: the two policies do not have the same parameters")
        for (_, dst), (_, p) in zip(mine, theirs):
            dst.copy_(p)

    @property
    def num_moe_layers(self) -> int:
        return len(self.routers)

    def parameters(self):
        return self.model.parameters()

    def train(self, mode: bool = True) -> Policy:
        self.model.train(mode)
        return self

    def eval(self) -> Policy:
        return self.train(False)

    def kv_cache(self, max_batch: int, max_len: int):
        """A megatron-core StaticInferenceContext (the KV cache ``model(inference_context=)``
        takes); its constructor is the same in 0.16.1 and later releases."""
        from megatron.core.inference.contexts import StaticInferenceContext

        return StaticInferenceContext(max_batch, max_len)

    def _pad_to_tp(self, inputs_BS: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Sequence parallelism splits the sequence over TP ranks: pad it to a multiple."""
        s = inputs_BS.shape[1]
        pad = (-s) % self.info.tp_size
        if pad:
            inputs_BS = torch.nn.functional.pad(inputs_BS, (0, pad), value=0)
        return inputs_BS, s

    def pack(self, tokens_BT: torch.Tensor, lens_B: torch.Tensor) -> PackedRows:
        """``tokens_BT``'s rows packed for this policy (the first ``lens_B[b]`` input positions of
        each row; the pack padded to a multiple of the TP size for sequence parallelism)."""
        return pack_rows(tokens_BT, lens_B, multiple=self.info.tp_size)

    def logits(self, inputs_BS: torch.Tensor, *, pack: PackedRows | None = None) -> torch.Tensor:
        """Local-vocab-shard logits ``[B, S, V]`` of every input position (causal, no mask); with
        ``pack`` (of these rows), logits ``[N, V]`` of the packed positions only."""
        if pack is not None:
            return self._packed_forward(pack)
        inputs_BS = inputs_BS.to(self.info.device)
        padded, s = self._pad_to_tp(inputs_BS)
        pos = torch.arange(padded.shape[1], device=padded.device).unsqueeze(0).expand_as(padded)
        out = self.model(input_ids=padded, position_ids=pos, attention_mask=None)
        return out[:, :s]

    def _packed_forward(self, pack: PackedRows) -> torch.Tensor:
        """The model over one packed sequence (``thd``: position ids restart per row); ``[N, *]``."""
        dev = self.info.device
        pos_P = torch.zeros(pack.p, dtype=torch.int64, device=dev)
        pos_P[: pack.n] = pack.pos_N.to(dev)
        out = self.model(
            input_ids=pack.inputs_P.to(dev)[None],
            position_ids=pos_P[None],
            attention_mask=None,
            packed_seq_params=pack.packed_seq_params(dev),
        )
        return out[0, : pack.n]

    def hidden(self, inputs_BS: torch.Tensor, *, pack: PackedRows | None = None) -> torch.Tensor:
        """Final hidden states ``[B, S, H]`` (the output layer's input; no [B, S, V] logits);
        with ``pack``, ``[N, H]`` of the packed positions."""
        real = self.model.output_layer
        self.model.output_layer = _OutputLayerInput(real)
        try:
            return self.logits(inputs_BS, pack=pack)
        finally:
            self.model.output_layer = real

    def output_weight(self) -> torch.Tensor:
        """The (local vocab shard of the) output-layer weight ``[V, H]``."""
        if self.cfg.tie_embeddings:
            return self.model.shared_embedding_or_output_weight()
        return self.model.output_layer.weight

    def _logprob_path(self) -> str:
        """``model.logprob_impl`` resolved: "logits", "triton" or "torch" ("auto": triton on CUDA
        when one of its tiles fits the GPU's shared memory in the weights' dtype, else the torch
        chunked path; full logits off CUDA)."""
        path = self.cfg.logprob_impl
        if path == "auto":
            if self.info.device.type != "cuda" or not triton_available():
                return "logits"
            return resolve_logprob_impl("auto", self.info.device, self.output_weight().dtype)
        return path

    def logprobs(
        self,
        tokens_BT: torch.Tensor,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        pack: PackedRows | None = None,
    ) -> LogProbOutput:
        """Per-token log-probs (and entropy) of ``tokens_BT`` under the current weights.

        fp32 softmax of logits / temperature, vocab-parallel across TP ranks; identical on
        every TP rank. Gradients flow when called with grad enabled. ``model.logprob_impl``
        picks full logits or the vocab-chunked path from hidden states (Triton kernel or
        its torch reference), which never materialises ``[B, T, V]``.

        With ``pack`` (``self.pack(tokens_BT, lens)``) only the packed positions are computed;
        the outputs keep the ``[B, T]`` layout, 0 where the pack does not reach.
        """
        tokens_BT = tokens_BT.to(self.info.device)
        b, t = tokens_BT.shape
        target = tokens_BT[:, 1:].reshape(-1) if pack is None else pack.gather_BS(tokens_BT[:, 1:])
        kw = dict(
            temperature=temperature,
            group=self.info.tp_group,
            vocab_start=self.vocab_start,
            with_entropy=with_entropy,
        )
        path = self._logprob_path()
        if path == "logits":
            logits = self.logits(tokens_BT[:, :-1], pack=pack)
            logp, ent = logprobs_entropy(logits.reshape(-1, logits.shape[-1]), target, **kw)
        else:
            h = self.hidden(tokens_BT[:, :-1], pack=pack)
            logp, ent = logprobs_from_hidden(
                h.reshape(-1, h.shape[-1]), self.output_weight(), target, impl=path, **kw
            )
        if pack is not None:
            ent_BT = pack.scatter_BS(ent, shift=1, width=t) if with_entropy else None
            return LogProbOutput(logp_BT=pack.scatter_BS(logp, shift=1, width=t), entropy_BT=ent_BT)
        zero = torch.zeros(b, 1, device=logp.device, dtype=logp.dtype)
        logp_BT = torch.cat([zero, logp.view(b, t - 1)], dim=1)
        ent_BT = torch.cat([zero, ent.view(b, t - 1)], dim=1) if with_entropy else None
        return LogProbOutput(logp_BT=logp_BT, entropy_BT=ent_BT)


def build_policy(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, info: ParallelInfo) -> Policy:
    """Build the policy on this rank: random init from ``model_cfg.seed``, or the weights of
    the Hugging Face checkpoint at ``model_cfg.hf_path``."""
    torch.manual_seed(model_cfg.seed)
    policy = Policy(model_cfg, parallel_cfg, info)
    if model_cfg.hf_path:
        from moe_rl.megatron.hf import import_hf

        import_hf(policy, model_cfg.hf_path)
    return policy
