"""The embedded engine's two forwards of the same model, and the weights it samples from.

``MegatronForward``: megatron-core's ``StaticInferenceContext`` passed as ``inference_context=``
to ``policy.model`` (any layout, expert parallelism included; routes captured by a
``RoutingSession``). ``LeanForward``: :mod:`moe_rl.megatron.decode` (TP = 1, local spec; no
collectives while decoding; routes returned by the forward). :func:`pick_forward` chooses by
``rollout.embedded_decoder``; :func:`rollout_policy` gives the policy in the rollout's precision.
Both forwards take ``(cache, inp, start, want_routes, want_gates)`` and return
``(last logits, routes or None, gates or None)``.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


# -- the forward: megatron-core's inference path, or the lean decoder -------------------------
class MegatronForward:
    """``policy.model(inference_context=StaticInferenceContext)``: every layout the policy has
    (expert parallelism included); routes are captured by a RoutingSession."""

    name = "megatron-core StaticInferenceContext"
    lockstep = True  # expert all-to-alls: every rank runs every forward, idle or not
    routes_from_session = True

    def __init__(self, policy):
        self.policy = policy

    def begin(self) -> None:
        """Nothing to prepare."""

    def new_cache(self, batch: int, width: int):
        ctx = self.policy.kv_cache(batch, width)
        if hasattr(ctx, "set_active"):  # megatron-core >= 0.17
            ctx.set_active()
        return ctx

    def forward(self, ctx, inp: torch.Tensor, start: int, want_routes: bool, want_gates: bool = False):
        pos = torch.arange(start, start + inp.shape[1], device=inp.device).expand_as(inp)
        ctx.sequence_len_offset = start
        if start > 0:
            ctx.enable_decode_mode()
        logits = self.policy.model(
            input_ids=inp,
            position_ids=pos,
            attention_mask=None,
            inference_context=ctx,
            runtime_gather_output=True,
        )
        return logits[:, -1], None, None

    def idle(self) -> None:
        """A one-token forward without the cache: keeps expert all-to-alls in lock-step."""
        tok = torch.zeros(1, 1, dtype=torch.long, device=self.policy.info.device)
        self.policy.model(input_ids=tok, position_ids=tok, attention_mask=None)

    @staticmethod
    def keep_rows(ctx, rows: torch.Tensor) -> None:
        mem = ctx.key_value_memory_dict
        for layer, (k, v) in list(mem.items()):
            mem[layer] = (k[:, rows].contiguous(), v[:, rows].contiguous())

    @staticmethod
    def release(ctx) -> None:
        if hasattr(ctx, "unset_active"):
            ctx.unset_active()
        ctx.key_value_memory_dict.clear()


class LeanForward:
    """:class:`moe_rl.megatron.decode.Decoder` (TP = 1, local spec): no collectives while
    decoding (under EP the experts are all-gathered once per call), routes returned by the
    forward itself."""

    name = "moe_rl.megatron.decode (rotated-key cache, folded GQA, grouped experts)"
    lockstep = False  # no collectives while decoding: ranks step independently
    routes_from_session = False

    def __init__(self, policy):
        from moe_rl.megatron.decode import Decoder

        self.lean = Decoder(policy)

    def begin(self) -> None:
        self.lean.begin()

    def new_cache(self, batch: int, width: int):
        return self.lean.new_cache(batch, width)

    def forward(self, cache, inp: torch.Tensor, start: int, want_routes: bool, want_gates: bool = False):
        gates = [] if want_gates else None
        logits, routes = self.lean.forward(cache, inp, start, want_routes, gates_out=gates)
        return logits, routes, gates

    def idle(self) -> None:
        """Nothing to keep in step with."""

    @staticmethod
    def keep_rows(cache, rows: torch.Tensor) -> None:
        cache.keep_rows(rows)

    @staticmethod
    def release(cache) -> None:
        cache.k.clear()
        cache.v.clear()


DECODERS = ("auto", "lean", "megatron")


def pick_forward(policy, decoder: str):
    """The forward for ``rollout.embedded_decoder``: auto = lean where it can run, else megatron."""
    from moe_rl.megatron.decode import unsupported_reason

    if decoder not in DECODERS:
        raise ValueError(f"rollout.embedded_decoder={decoder!r}: use one of {DECODERS}")
    if decoder == "megatron":
        return MegatronForward(policy)
    reason = unsupported_reason(policy)
    if reason is None:
        return LeanForward(policy)
    if decoder == "lean":
        raise ValueError(
            f"rollout.embedded_decoder=lean cannot run this policy: {reason}; use auto or megatron"
        )
    log.info("embedded engine: megatron-core decode path (%s)", reason)
    return MegatronForward(policy)


# -- rollout precision ------------------------------------------------------------------------
ROLLOUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"``rollout.dtype`` -> torch dtype."


def rollout_policy(policy, dtype: str, router_dtype: str):
    """The policy the engine samples from: ``policy`` itself when its weights already have
    ``dtype`` (and the router runs as asked), else a replica in ``dtype`` (``Policy.replica``),
    an SGLang server's own low-precision copy of the trainer's weights (docs/algorithms.md#train-inference-mismatch)."""
    if dtype not in ROLLOUT_DTYPES or router_dtype not in ("same", "fp32"):
        raise ValueError(
            f"rollout dtype={dtype!r} / router_dtype={router_dtype!r}: use dtype in "
            f"{sorted(ROLLOUT_DTYPES)} and router_dtype same or fp32"
        )
    torch_dtype = ROLLOUT_DTYPES[dtype]
    weights_dtype = next(policy.model.parameters()).dtype
    router_fp32 = router_dtype == "fp32" or torch_dtype == torch.float32
    if torch_dtype == weights_dtype and router_fp32 == (policy.model.config.moe_router_dtype == "fp32"):
        return policy
    log.info(
        "embedded engine: own %s copy of the weights (router %s)", dtype, "fp32" if router_fp32 else dtype
    )
    return policy.replica(torch_dtype, router_fp32=router_fp32)
