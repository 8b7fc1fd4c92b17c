"""The rollout engine protocol and the batch it returns.

Shape legend: B = sequences (prompts x samples), T = padded prompt+response length,
L = MoE layers, K = experts per token (top-k).

Alignment conventions, shared by every engine and the trainer:
- ``tokens_BT[b, :total_len[b]]`` is prompt then response, right-padded with ``pad_id``.
- ``logprobs_BT[b, t]`` is log pi(tokens[b, t] | tokens[b, <t]) for response positions
  (``response_mask_BT[b, t] == 1``), computed as log_softmax(logits / temperature)
  like SGLang; 0 elsewhere.
- ``routes_BTLK[b, t]`` are the K experts chosen in each MoE layer when token t is the
  model's *input*, for t < total_len[b] - 1 (the last token is never fed through the
  model, so SGLang returns total_len - 1 rows); other rows are 0.
- ``gates_BTLK[b, t, l, k]`` (embedded engine only, when asked) is the gate weight the engine
  gave expert ``routes_BTLK[b, t, l, k]`` of token t: the router's output probability of that
  expert, with which its output was mixed (under routing noise, the clean score of the chosen
  expert); 0 where routes are 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one batch of responses."""

    temperature: float = 1.0
    "Softmax temperature; 0 means greedy."
    top_p: float = 1.0
    "Nucleus sampling mass (1 disables it)."
    top_k: int = -1
    "Sample among the k most likely tokens (-1 disables it)."
    max_new_tokens: int = 64
    "Longest response."
    stop_token_ids: tuple[int, ...] = ()
    "Generation of a sequence ends after any of these tokens (it is kept in the response)."
    ignore_eos: bool = False
    "Keep generating past the engine's end-of-sequence token (stop_token_ids still stop)."
    seed: int | None = None
    "Base seed; sample j of the batch uses seed + j, so rollouts are reproducible."
    return_routes: bool = False
    "Return the routed experts of every token (needed for R3 and disagreement metrics)."
    return_gates: bool = False
    "Also return their gate weights (``Rollouts.gates_BTLK``; R3 with algo.replay_gate_weights; the embedded engine only)."

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.return_gates and not self.return_routes:
            raise ValueError(
                "sampling.return_gates=True needs return_routes=True: gates are those of the routes"
            )


@dataclass(kw_only=True)
class Rollouts:
    """One batch of sampled responses; see the module docstring for alignment."""

    tokens_BT: torch.Tensor
    "int64 prompt+response ids, right-padded."
    prompt_lens_B: torch.Tensor
    "int64 prompt length of each row."
    total_lens_B: torch.Tensor
    "int64 prompt+response length of each row."
    response_mask_BT: torch.Tensor
    "float32, 1 on response tokens."
    logprobs_BT: torch.Tensor
    "float32 rollout log-probs of the response tokens, 0 elsewhere."
    finish_reasons: list[str]
    "'stop' (a stop token) or 'length' (max_new_tokens) per row."
    weight_version: str
    "Version of the weights that produced every row."
    prompt_index_B: torch.Tensor
    "int64 index of the row's prompt in the generate() call (rows of a group are adjacent)."
    routes_BTLK: torch.Tensor | None = None
    "uint8/int16 routed experts per input token and MoE layer, or None."
    gates_BTLK: torch.Tensor | None = None
    "float32 gate weights of ``routes_BTLK``'s experts, slot for slot, or None (SGLang returns none)."
    pad_id: int = 0
    "Padding token id."
    extras: dict = field(default_factory=dict)
    "Engine-specific timings and counters (tokens/s, ...)."

    @property
    def batch_size(self) -> int:
        return int(self.tokens_BT.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask_BT.sum().item())

    def to(self, device: torch.device | str) -> Rollouts:
        """This batch with every tensor on ``device`` (the same object when all are there already).

        The trainer calls it once, where a step takes the batch from the engine
        (``moe_rl.trainer.run.Run.generate``): engines return their tensors on the host."""
        device = torch.device(device)
        moved = {
            f.name: v.to(device)
            for f in fields(self)
            if isinstance(v := getattr(self, f.name), torch.Tensor) and v.device != device
        }
        return replace(self, **moved) if moved else self


class HFStateSource(Protocol):
    """Something whose weights can be streamed in Hugging Face Qwen3-MoE names and layout."""

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full unsharded tensor) one at a time (on the host; a source may take
        ``device=`` to leave them on the GPU: :func:`moe_rl.rollout.weight_sync.session.source_tensors`)."""
        ...


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine (embedded, SGLang, ...)."""

    weight_version: str

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        """Sample ``n`` responses for every prompt; rows of one prompt are adjacent."""
        ...

    def update_weights(self, source: HFStateSource, version: str) -> str:
        """Make the engine serve ``source``'s current weights under ``version``; return it."""
        ...

    def close(self) -> None:
        """Release servers, processes and memory."""
        ...


class WeightSink(Protocol):
    """An engine-side model that can take new weights by HF name (used by the server)."""

    def hf_param_meta(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (full shape, dtype) of every weight the engine expects."""
        ...

    def load_hf_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace weights by HF name. All-or-nothing: validate every name and shape first,
        raise ValueError naming the first bad one, and only then copy."""
        ...
