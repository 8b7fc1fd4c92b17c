"""Hugging Face Qwen3-MoE checkpoints in and out of a megatron-core :class:`Policy`, any TP/EP layout.

- :func:`import_hf` reads ``config.json`` and the safetensors shards (``model.safetensors.index.json``
  or ``*.safetensors``), checks every name and shape from the headers first, then streams
  shard by shard: each rank reads only the slices of its own parameters
  (``safe_open(...).get_slice``), so no rank ever holds a full copy of the model.
- :func:`export_hf` gathers TP shards (over the TP group) and experts (over the EP group) one
  parameter at a time; global rank 0 writes HF-named safetensors shards + index + ``config.json``
  (+ tokenizer) into a temp directory renamed into place (:mod:`moe_rl.hf_io`).
- :class:`PolicyHFSource` is the trainer side of weight sync (``HFStateSource.hf_tensors``) and
  the engine side (``WeightSink.hf_param_meta`` / ``load_hf_tensors``) for the embedded engine
  and ``moe-rl serve``.

The name/layout map itself is :mod:`moe_rl.megatron.hf_mapping`. Collectives take the policy's
explicit groups and are skipped in a group of one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from moe_rl import dist
from moe_rl.config import ModelConfig
from moe_rl.hf_io import ShardWriter, atomic_dir, scan_headers
from moe_rl.megatron.checkpoint import NonFiniteWeights, weights_finite
from moe_rl.megatron.hf_mapping import (
    Layout,
    Piece,
    config_from_hf,
    fused_expert_shapes,
    hf_config,
    hf_from_full,
    hf_shapes,
    ignorable,
    mismatches,
    param_pieces,
    shard_kind,
)

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
)

__all__ = [
    "PolicyHFSource",
    "config_from_hf",
    "export_hf",
    "hf_config",
    "import_hf",
    "model_config_from_path",
    "read_hf_config",
]


# -- reading -----------------------------------------------------------------------------------
def read_hf_config(path: str | Path) -> dict:
    """The ``config.json`` dict of a local HF checkpoint directory."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return json.loads(f.read_text())


def model_config_from_path(path: str | Path, **overrides) -> ModelConfig:
    """ModelConfig of a local HF checkpoint: ``hf_path`` set, and ``tokenizer`` when it has one."""
    defaults = {"hf_path": str(path)}
    if (Path(path) / "tokenizer.json").is_file():
        defaults["tokenizer"] = str(path)
    return config_from_hf(read_hf_config(path), **{**defaults, **overrides})


def _expected(cfg: ModelConfig, header: dict, root: Path) -> tuple[dict[str, tuple[int, ...]], bool]:
    """The HF names and shapes the checkpoint must hold; whether its experts are fused."""
    fused_shapes = fused_expert_shapes(cfg)
    fused = any(n in header for n in fused_shapes)
    expected = hf_shapes(cfg)
    if fused:
        per_expert = {n for n in expected if ".mlp.experts." in n}
        if any(n in header for n in per_expert):
            raise ValueError(f"{root} holds experts both fused (mlp.experts.gate_up_proj) and per expert")
        expected = {n: s for n, s in expected.items() if n not in per_expert} | fused_shapes
    return expected, fused


def _check_names(cfg: ModelConfig, header: dict, root: Path) -> bool:
    """Raise ValueError listing missing, unexpected and misshapen tensors; return ``fused``."""
    expected, fused = _expected(cfg, header, root)
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(n for n in header if n not in expected and not ignorable(n, cfg))
    shapes = [
        f"{n}: {list(header[n][1])} (expected {list(s)})"
        for n, s in expected.items()
        if n in header and header[n][1] != tuple(s)
    ]
    problems = []
    for what, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)):
        if names:
            more = f" ... and {len(names) - 10} more" if len(names) > 10 else ""
            problems.append(f"{len(names)} {what}: {', '.join(names[:10])}{more}")
    if problems:
        raise ValueError(f"checkpoint {root} does not fit the policy: " + "; ".join(problems))
    return fused


# -- the local plan ----------------------------------------------------------------------------
def _layout(policy) -> Layout:
    i = policy.info
    return Layout(tp_rank=i.tp_rank, tp_size=i.tp_size, ep_rank=i.ep_rank, ep_size=i.ep_size)


def local_plan(policy, *, fused: bool = False) -> dict[str, list[Piece]]:
    """HF name -> the pieces of this rank's parameters it fills.

    Raises ValueError if a parameter has no mapping or the pieces do not cover it exactly once.
    """
    layout, by_hf, problems = _layout(policy), {}, []
    for mg_name, p in policy.model.named_parameters():
        try:
            pieces = param_pieces(mg_name, policy.cfg, layout, fused=fused)
        except KeyError as e:
            problems.append(str(e.args[0]))
            continue
        covered = sum(p.data[piece.dst].numel() for piece in pieces)
        regions = {tuple((s.start, s.stop) for s in piece.dst) for piece in pieces}  # slices hash from 3.12
        if covered != p.numel() or len(regions) != len(pieces):
            problems.append(f"{mg_name}: HF pieces cover {covered} of {p.numel()} elements")
        for piece in pieces:
            by_hf.setdefault(piece.hf, []).append(piece)
    if problems:
        raise ValueError("megatron parameters without an exact HF mapping: " + "; ".join(problems))
    return by_hf


def _copy(param: torch.Tensor, piece: Piece, src: torch.Tensor) -> int:
    dst = param.data[piece.dst]
    dst.copy_(src.reshape(dst.shape))
    return dst.numel()


def import_hf(policy, path: str | Path) -> int:
    """Load a local HF Qwen3-MoE checkpoint into ``policy`` (every rank calls it; no collectives).

    Checks first, before any weight changes: config fields (vs ``policy.cfg``), every tensor
    name (missing/unexpected) and shape. Then copies shard by shard. Returns the elements copied
    on this rank.
    """
    from safetensors import safe_open

    root = Path(path)
    diffs = mismatches(config_from_hf(read_hf_config(root)), policy.cfg)
    if diffs:
        raise ValueError(
            f"checkpoint {root} does not match the policy's model config "
            f"(checkpoint vs policy): {'; '.join(diffs)}"
        )
    header = scan_headers(root)
    plan = local_plan(policy, fused=_check_names(policy.cfg, header, root))
    params = dict(policy.model.named_parameters())
    filled = dict.fromkeys(params, 0)
    for fname in sorted({file for file, _ in header.values()}):
        names = [n for n, (file, _) in header.items() if file == fname and n in plan]
        if not names:
            continue
        with safe_open(str(root / fname), framework="pt", device="cpu") as shard:
            for name in names:
                hf_slice = shard.get_slice(name)
                for piece in plan[name]:
                    filled[piece.mg] += _copy(params[piece.mg], piece, hf_slice[piece.src])
    wrong = [f"{n} ({filled[n]} of {p.numel()})" for n, p in params.items() if filled[n] != p.numel()]
    if wrong:
        raise RuntimeError(f"import_hf filled parameters a wrong number of elements: {wrong}")
    total = sum(filled.values())
    log.info("imported %s: %d tensors, %d local elements (%s)", root, len(header), total, _layout(policy))
    return total


# -- gathering ---------------------------------------------------------------------------------
class PolicyHFSource:
    """A policy's weights under HF Qwen3-MoE names: ``HFStateSource`` and ``WeightSink``.

    ``hf_tensors()`` is collective: every rank of the policy must iterate it to the end, in
    lockstep (it all-gathers over the TP and EP groups); every rank then receives the same full
    CPU tensors (copies, never views of live parameters), cast to ``dtype`` when given, or, with
    ``hf_tensors(device=...)`` another device, tensors left there (no CPU copy: what a colocated
    push hands SGLang by CUDA IPC), which may be views of live parameters: read them before the
    next optimizer step.
    ``hf_param_meta`` and ``load_hf_tensors`` are local (no collectives): each rank takes its
    own slices of the full tensors it is given.
    """

    def __init__(self, policy, *, dtype: torch.dtype | None = None):
        self.policy, self.dtype = policy, dtype
        self._plan: dict[str, list[Piece]] | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> full shape (computed once: a 30B model has about 19k names)."""
        if self._shapes is None:
            self._shapes = hf_shapes(self.policy.cfg)
        return self._shapes

    def hf_tensors(self, *, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) one at a time: per-expert names, no lm_head when tied;
        CPU copies, or tensors on ``device`` (not copied when already there)."""
        device = torch.device(device)
        copy = device.type == "cpu"
        cfg, info = self.policy.cfg, self.policy.info
        shapes = self.shapes
        for name, p in self.policy.model.named_parameters():
            kind, dim = shard_kind(name)
            group = info.tp_group if kind == "tp" else info.ep_group if kind == "ep" else None
            # EP rank r holds global experts r * E_local ..: the gather along dim 0 is every expert
            full = dist.all_gather_cat(p.detach(), group, dim=dim) if group is not None else p.detach()
            for hf_name, t in hf_from_full(name, full, cfg, shapes):
                yield hf_name, t.to(device=device, dtype=self.dtype or t.dtype, copy=copy).contiguous()

    def hf_param_meta(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (full shape, dtype of the policy's parameters)."""
        dtype = next(self.policy.model.parameters()).dtype
        return {n: (s, dtype) for n, s in self.shapes.items()}

    def load_hf_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF tensors into this rank's slices. All-or-nothing: every name, shape and
        dtype (floating point) is checked first; ValueError names the first bad one."""
        meta, staged = self.shapes, {}
        for name, t in named:
            if name in staged:
                raise ValueError(f"{name!r} given twice")
            if name not in meta:
                raise ValueError(f"{name!r} is not a weight of this Qwen3-MoE policy")
            if tuple(t.shape) != tuple(meta[name]):
                raise ValueError(f"{name!r}: shape {list(t.shape)} does not match {list(meta[name])}")
            if not t.is_floating_point():
                raise ValueError(f"{name!r}: dtype {t.dtype} is not floating point")
            staged[name] = t
        if self._plan is None:
            self._plan = local_plan(self.policy)
        params = dict(self.policy.model.named_parameters())
        for name, t in staged.items():
            for piece in self._plan.get(name, ()):
                _copy(params[piece.mg], piece, t[piece.src])


# -- writing -----------------------------------------------------------------------------------
def _save_tokenizer(tokenizer, root: Path) -> None:
    """``tokenizer.save_pretrained(root)``, or copy the tokenizer files of a directory / ``.path``."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(root))
        return
    src = Path(getattr(tokenizer, "path", tokenizer))
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not copied:
        raise ValueError(f"tokenizer {tokenizer!r}: no save_pretrained() and no tokenizer files in {src}")
    for f in copied:
        shutil.copy2(src / f, root / f)


def _special_ids(tokenizer) -> dict:
    """``bos/eos/pad_token_id`` of ``tokenizer`` (those it has), as transformers' configs name them."""
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_id", None) for k in ("bos", "eos", "pad")}
    return {k: int(v) for k, v in ids.items() if v is not None}


def _generation_config(tokenizer) -> dict:
    """``generation_config.json`` of an export: the tokenizer's ``bos/eos/pad_token_id``, over the
    ``generation_config.json`` of the tokenizer's directory when it has one (a Hugging Face model's
    sampling defaults and further stop ids, e.g. Qwen3's ``[<|im_end|>, <|endoftext|>]``, are
    kept; the tokenizer's EOS is always among the stop ids)."""
    special = _special_ids(tokenizer)
    src = getattr(tokenizer, "path", None)
    gen = {}
    if src is not None and (Path(src) / "generation_config.json").is_file():
        try:
            gen = json.loads((Path(src) / "generation_config.json").read_text())
        except ValueError:
            log.warning("%s/generation_config.json is unreadable: the export writes its own", src)
        gen = gen if isinstance(gen, dict) else {}
    for key in ("bos_token_id", "pad_token_id"):
        if key in special and gen.get(key) is None:
            gen[key] = special[key]
    eos = gen.get("eos_token_id")
    stops = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    if "eos_token_id" in special and special["eos_token_id"] not in stops:
        stops.insert(0, special["eos_token_id"])
    if stops:
        gen["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return gen


def _readable(root: Path) -> None:
    """Every file under ``root`` readable as an ordinary new file is (0666 less the umask): the
    safetensors writer leaves its shards 0600, which other users of a shared checkpoint folder and
    a server running as another user cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    for f in root.rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~umask)


def _write(source: PolicyHFSource, out: Path, tokenizer, max_shard_bytes: int) -> Exception | None:
    """Rank 0: stream every tensor into a temp directory, add config + tokenizer, rename it to ``out``.

    Returns the first error instead of raising, after draining ``source`` to the end (the other
    ranks wait in its gathers), so that every rank reaches the final agreement.
    """
    tensors = source.hf_tensors()
    try:
        with atomic_dir(out) as tmp:
            writer = ShardWriter(tmp, max_shard_bytes)
            for name, t in tensors:
                writer.add(name, t)
            written = writer.finish()
            dtype = source.dtype or next(source.policy.model.parameters()).dtype
            cfg_json = hf_config(source.policy.cfg, dtype=dtype)
            if tokenizer is not None:
                cfg_json.update(_special_ids(tokenizer))
                # transformers' generate() reads eos_token_id from here: without it it never stops
                gen = _generation_config(tokenizer)
                (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
            if tokenizer is not None:
                _save_tokenizer(tokenizer, tmp)
            _readable(tmp)
    except Exception as e:  # noqa: BLE001 - returned, raised after the collectives
        for _ in tensors:
            pass
        return e
    log.info("exported %s: %d shards, %.1f MB", out, written.num_shards, written.num_bytes / 1e6)
    return None


def export_hf(
    policy,
    out_dir: str | Path,
    *,
    tokenizer=None,
    max_shard_bytes: int = 4 << 30,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``policy`` as an HF Qwen3-MoE checkpoint at ``out_dir`` (collective: every rank calls).

    Global rank 0 writes ``model-0000k-of-0000N.safetensors`` (at most ``max_shard_bytes`` each,
    one tensor larger than that gets a shard of its own), ``model.safetensors.index.json``,
    ``config.json`` and, when ``tokenizer`` is given (an object with ``save_pretrained`` or a
    tokenizer directory), its files; all into a temp directory renamed over ``out_dir``.
    Tensors are cast to ``dtype`` when given. Every rank raises if rank 0 failed; a policy with a
    non-finite weight is refused before anything is written (``NonFiniteWeights``).
    """
    out = Path(out_dir)
    if tokenizer is not None and not (
        hasattr(tokenizer, "save_pretrained") or hasattr(tokenizer, "path") or Path(str(tokenizer)).is_dir()
    ):
        raise ValueError(f"tokenizer {tokenizer!r}: give an object with save_pretrained() or a directory")
    if not weights_finite(policy.model):
        raise NonFiniteWeights(f"the policy has non-finite weights: not exported to {out}")
    source = PolicyHFSource(policy, dtype=dtype)
    if dist.rank() != 0:
        for _ in source.hf_tensors():
            pass
        if not dist.all_ranks(True):
            raise RuntimeError(f"export_hf to {out} failed on rank 0 (see its log)")
        return out
    error = _write(source, out, tokenizer, max_shard_bytes)
    dist.all_ranks(error is None)
    if error is not None:
        raise error
    return out
