"""Every push checked: the engine's weights read back by name and compared with the trainer's.

SGLang's model loaders skip a name they do not know (Qwen3-MoE's ``load_weights`` among them), so a
push can "succeed" and leave a tensor stale. After the first push, and every
``rollout.verify_every`` pushes, :func:`verify_engines` reads a sample of tensors of every kind back
from each engine (``/get_weights_by_name``: the first rows, as SGLang's ``truncate_size`` gives
them) and compares them exactly with the trainer's, cast to each precision an engine may serve (an
engine holds fp32, bf16 or fp16 copies, each exact for the cast it made). The sample
(:func:`sampled`): the embedding, output layer and final norm, and in the first and last layer the
attention projections, the q/k and layer norms, the router and the first and last expert's three
projections.

A server that cannot read weights by name (SGLang 0.5.x's Qwen3-MoE has no ``get_weights_by_name``;
it answers "Get parameter by name failed") is said once per engine and not asked again; the
step's ``mismatch/*`` and ``flip/rollout_vs_trainer`` metrics then are the check.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import torch

from moe_rl.rollout.sglang_client import SGLangClient, SGLangError
from moe_rl.rollout.types import HFStateSource
from moe_rl.rollout.weight_sync.session import WeightSyncError, source_tensors

logger = logging.getLogger(__name__)
ROWS = 2
"Rows read back per tensor (SGLang's ``truncate_size``)."
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
    """Reads back and compares after the first push and every ``every`` pushes (0: never)."""

    def __init__(self, every: int, num_layers: int | None, num_experts: int | None):
        self.every, self.num_layers, self.num_experts = every, num_layers, num_experts
        self.pushes = 0
        self._unreadable: set[str] = set()

    def due(self) -> bool:
        """Whether the next push is checked (counted by :meth:`tee`)."""
        n = self.pushes + 1
        return (
            bool(self.every)
            and None not in (self.num_layers, self.num_experts)
            and (n == 1 or n % self.every == 0)
        )

    def tee(self, source: HFStateSource) -> tuple[HFStateSource, TeeSource | None]:
        """The source a push should read, and the tee to verify with (None: this push is not checked)."""
        due = self.due()
        self.pushes += 1
        if not due:
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
                        "%s cannot read weights by name (%s): its pushes are not verified; the step's "
                        "mismatch/* and flip/rollout_vs_trainer metrics are the check",
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
