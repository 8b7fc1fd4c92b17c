"""Every push checked: the engines score tokens the trainer scores, and tensors are read back by name.

SGLang's model loaders skip a name they do not know (Qwen3-MoE's ``load_weights`` among them), so a
push can "succeed" and leave a tensor stale. After the first push, and every
``rollout.verify_every`` pushes, two checks run:

- **Scores** (every engine): at the next rollout (the engines hold their KV cache then, the
  trainer's state is on the host) each engine continues a fixed prompt of :data:`PROBE_PROMPT`
  token ids with :data:`PROBE_NEW` sampled tokens (``ignore_eos``) and returns their log-probs
  (:func:`probe_engines`); once the trainer's state is back, the trainer scores the same tokens and
  the mean absolute log-prob difference must stay within the rollout precision's tolerance
  (:func:`check_scores`, :data:`SCORE_TOLERANCE`, ``rollout.verify_tolerance``). A wrong push (one
  expert's weights swapped) moves the tokens routed to that expert; sampled tokens reach most
  experts of every layer. This works on every model SGLang serves.
- **Read-back** (engines that answer ``/get_weights_by_name``): a sample of tensors of every kind
  (:func:`verify_engines`: the first rows, as SGLang's ``truncate_size`` gives them) compared
  exactly with the trainer's, cast to each precision an engine may serve. The sample
  (:func:`sampled`): the embedding, output layer and final norm, and in the first and last layer
  the attention projections, the q/k and layer norms, the router and the first and last expert's
  three projections. A server that cannot read weights by name (SGLang 0.5.x's Qwen3-MoE: "Get
  parameter by name failed") is said once per engine and not asked again.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_protocol import SGLangError, StaleWeightsError
from moe_rl.rollout.types import HFStateSource
from moe_rl.rollout.weight_sync.session import WeightSyncError, source_tensors

logger = logging.getLogger(__name__)
ROWS = 2
"Rows read back per tensor (SGLang's ``truncate_size``)."
PROBE_PROMPT, PROBE_NEW = 64, 64
"Token ids of a probe's fixed prompt, and tokens each engine samples after it."
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def sampled(name: str, num_layers: int, num_experts: int) -> bool:
    """Whether ``name`` is in the sample (module docstring): every kind, first and last layer."""
    layer = _LAYER.match(name)
    if layer is None:
        return True
    if int(layer.group(1)) not in (0, num_layers - 1):
        return False
    expert = _EXPERT.search(name)
    return expert is None or int(expert.group(1)) in (0, num_experts - 1)


class TeeSource:
    """``source`` as a push reads it, keeping the first :data:`ROWS` rows (host copies) of the
    sampled tensors on the way."""

    def __init__(self, source: HFStateSource, num_layers: int, num_experts: int):
        self.source, self.num_layers, self.num_experts = source, num_layers, num_experts
        self.kept: dict[str, torch.Tensor] = {}

    def hf_tensors(self, *, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in source_tensors(self.source, torch.device(device)):
            if sampled(name, self.num_layers, self.num_experts):
                self.kept[name] = t.detach()[:ROWS].to("cpu", torch.float32, copy=True)
            yield name, t


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to the trainer's rows in fp32, or after the cast to bf16 or fp16 an engine makes (a
    tensor-parallel engine may give its first rank's columns only)."""
    if got.dim() == 2 and want.dim() == 2 and got.shape[1] < want.shape[1]:
        want = want[:, : got.shape[1]]
    if got.shape != want.shape:
        return False
    return any(torch.equal(got, want.to(d).float()) for d in (torch.float32, torch.bfloat16, torch.float16))


class PushVerifier:
    """Checks after the first push and every ``every`` pushes (0: never): read-back by name (with
    ``num_layers`` / ``num_experts``) and scores (with ``vocab_size``: the ids a probe draws from)."""

    def __init__(
        self,
        every: int,
        num_layers: int | None,
        num_experts: int | None,
        vocab_size: int | None = None,
        context: int = PROBE_PROMPT + PROBE_NEW,
    ):
        self.every, self.num_layers, self.num_experts = every, num_layers, num_experts
        self.vocab_size, self.context = vocab_size, context
        self.pushes = 0
        self.score_due: str | None = None
        "The version whose scores the next rollout checks (set by :meth:`count` on every rank)."
        self.probes: list[Probe] | None = None
        "The engines' side of the due check, taken at the rollout (by the rank that calls them)."
        self._unreadable: set[str] = set()

    def due(self) -> bool:
        """Whether the next push is checked (counted by :meth:`count`)."""
        n = self.pushes + 1
        return bool(self.every) and (n == 1 or n % self.every == 0)

    def count(self, version: str) -> bool:
        """A push of ``version``: whether it is checked (its scores are then due at the next rollout)."""
        due = self.due()
        self.pushes += 1
        if due and self.vocab_size:
            self.score_due, self.probes = version, None
        return due

    def probe(self, engines: list[SGLangClient]) -> None:
        """At a rollout, with a check due and not yet probed: the engines' side of it."""
        if self.score_due is not None and self.probes is None:
            self.probes = probe_engines(engines, self.vocab_size, self.score_due, self.context)

    def take(self) -> list[Probe] | None:
        """The probes of the due check (None when none is due), and the check no longer due."""
        probes, self.score_due, self.probes = self.probes, None, None
        return probes

    def tee(self, source: HFStateSource, version: str = "") -> tuple[HFStateSource, TeeSource | None]:
        """The source a push should read, and the tee to read back with (None: not read back)."""
        if not self.count(version) or None in (self.num_layers, self.num_experts):
            return source, None
        tee = TeeSource(source, self.num_layers, self.num_experts)
        return tee, tee

    def verify(self, engines: list[SGLangClient], tee: TeeSource, version: str) -> int:
        """Compare every kept tensor on every engine that reads weights by name; the tensors compared.
        WeightSyncError names the first tensor an engine serves differently, and the engine."""
        compared = 0
        for engine in engines:
            if engine.base_url in self._unreadable:
                continue
            for name, want in tee.kept.items():
                try:
                    rows = engine.get_weights_by_name(name, truncate_size=ROWS)
                except SGLangError as e:
                    self._unreadable.add(engine.base_url)
                    logger.warning(
                        "%s cannot read weights by name (%s): its pushes are checked by their scores alone",
                        engine.base_url,
                        str(e)[:120],
                    )
                    break
                got = torch.tensor(rows, dtype=torch.float32)
                if got.numel() == 0 or not _matches(got, want):
                    raise WeightSyncError(
                        f"{engine.base_url} serves {name} differently from the trainer after the push of "
                        f"{version!r} (first rows {got.reshape(-1)[:3].tolist()} vs "
                        f"{want.reshape(-1)[:3].tolist()}): the engine did not load it (SGLang skips "
                        f"names its model does not know); check the export's names against its loader"
                    )
                compared += 1
        return compared


# ----------------------------------------------------------------- scores
SCORE_TOLERANCE = {"fp32": 1e-3, "fp16": 4e-3, "bf16": 2e-2}
"""Largest mean |log-prob difference| between an engine's and the trainer's scores of a probe,
per the lower of the trainer's and the rollout precision (``rollout.verify_tolerance`` overrides).
Measured on the tiny model (CPU, fp32 trainer, 5 samplings: ``python -m tools.score_gaps``): a
faithful fp32 engine differs by 7e-8 to 1.3e-7, a bf16 one by 5.5e-4 to 7.6e-4; experts 1 and 2
of layer 0 swapped move the scores by 2.7e-3 to 3.7e-3 (the random tiny experts barely matter).
fp32 catches that; bf16 and fp16 leave room for GPU kernels at scale (not yet measured), where a
trained model's wrong expert moves its tokens far more."""


def score_tolerance(model_dtype: str, rollout_dtype: str, override: float | None = None) -> float:
    """``override`` (``rollout.verify_tolerance``), else :data:`SCORE_TOLERANCE` of the lower of the
    trainer's precision (``model.dtype``) and the engine's (``rollout.dtype``, resolved)."""
    if override is not None:
        return override
    both = {{"float32": "fp32", "bfloat16": "bf16"}.get(model_dtype, model_dtype), rollout_dtype}
    return SCORE_TOLERANCE["bf16" if "bf16" in both else "fp16" if "fp16" in both else "fp32"]


@dataclass
class Probe:
    """One engine's side of a score check."""

    engine: str
    "The engine's URL."
    tokens: list[int]
    "The prompt, then what the engine sampled."
    prompt_len: int
    "Tokens of the prompt."
    logprobs: list[float]
    "The engine's log-prob of each sampled token."


def probe_prompt(vocab_size: int, length: int = PROBE_PROMPT) -> list[int]:
    """The probes' fixed prompt: ``length`` ids drawn with a fixed seed."""
    rng = random.Random(45)
    return [rng.randrange(vocab_size) for _ in range(length)]


def probe_engines(
    engines: list[SGLangClient], vocab_size: int, version: str, context: int = PROBE_PROMPT + PROBE_NEW
) -> list[Probe]:
    """Each engine's continuation of :func:`probe_prompt` and its log-probs, the two within
    ``context`` tokens (the model's); StaleWeightsError when an engine answers from another weight
    version than ``version``."""
    length = min(PROBE_PROMPT, context // 2)
    prompt, out = probe_prompt(vocab_size, length), []
    sp = {"max_new_tokens": min(PROBE_NEW, context - length), "temperature": 1.0, "ignore_eos": True}
    for e in engines:
        (o,) = e.generate([prompt], sp, return_logprob=True)
        if o.weight_version != version:
            raise StaleWeightsError(
                f"{e.base_url} answered the push check from {o.weight_version!r}, not {version!r}"
            )
        out.append(Probe(e.base_url, prompt + list(o.output_ids), len(prompt), list(o.logprobs)))
    return out


def check_scores(
    probes: list[Probe], trainer_logprobs: list[list[float]], tolerance: float, version: str
) -> float:
    """The largest mean |engine - trainer| log-prob difference over ``probes``; WeightSyncError naming
    the engine when one exceeds ``tolerance``."""
    worst = 0.0
    for p, mine in zip(probes, trainer_logprobs):
        gap = sum(abs(a - b) for a, b in zip(p.logprobs, mine)) / max(1, len(p.logprobs))
        worst = max(worst, gap)
        if not gap <= tolerance:
            raise WeightSyncError(
                f"{p.engine} scores tokens differently from the trainer after the push of {version!r}: mean "
                f"|log-prob difference| {gap:.3g} over {len(p.logprobs)} tokens, tolerance {tolerance:g} "
                "(rollout.verify_tolerance): the engine did not load the pushed weights as the trainer holds "
                "them (a name its loader skips or maps to another expert, a wrong TP / EP slice)"
            )
    logger.info(
        "push check of %s: %d engines score within %.3g (tolerance %g)",
        version,
        len(probes),
        worst,
        tolerance,
    )
    return worst
