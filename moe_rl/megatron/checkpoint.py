"""Atomic, resharding checkpoints with megatron.core.dist_checkpointing.

Layout of ``root/``::

    0003-sft-step-000060/ one checkpoint: dist_checkpointing files (model + optimizer),
                          meta.json (its number as ``step``, extra state, owner, ``finite``,
                          every file's sha256), rng-<rank>.pt per rank
    latest                name of the newest complete checkpoint (written last, atomically)

A checkpoint's name is ``<number>-<label>``: the number counts this directory's saves (it
orders them: the newest has the highest) and the label says what it holds, for a run's
checkpoints ``<stage>-step-<steps of that stage done>`` (``0003-sft-step-000060``: the third
save, after SFT step 60; ``0004-rl-step-000040``). Directories of the older scheme,
``step-<number>`` (``step-00000002``), are read as before and ordered by the same number, so
an old run resumes and its next checkpoint is numbered after them.

Every rank writes into ``root/.tmp-<name>``; after a barrier rank 0 renames it to
``<name>`` and then replaces ``latest``. A crash mid-save leaves only a ``.tmp-*``
directory behind, which the next save removes; ``latest`` still names the previous
checkpoint. Weights, Adam moments and fp32 main weights are ShardedTensors (megatron-core's
``optimizer.sharded_state_dict``; the distributed optimizer's ``fully_sharded_model_space``
format), so a checkpoint saved at one TP/EP/DP layout loads into another with its optimizer
state.

Only good weights are written: a model with a non-finite weight is refused. Loading verifies
the checksums; from a root, a dangling ``latest`` or a truncated or corrupt checkpoint is skipped
for the newest intact one, with a warning naming what was skipped. Retention orders checkpoints
by their step number and never removes the one just written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import traceback
from pathlib import Path

import numpy as np
import torch

from moe_rl import dist
from moe_rl.errors import UserError
from moe_rl.files import write_text
from moe_rl.megatron import spec_keys
from moe_rl.megatron.ckpt_writer import guarded_writer

log = logging.getLogger(__name__)
META = "meta.json"


def _sharded_state(model, optimizer, *, is_loading: bool, with_optimizer: bool = True) -> dict:
    """Model (and optimizer) ShardedTensors; an optimizer that never stepped has no state to save."""
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd}
    if optimizer is not None and with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


# the fp32 main weights of the distributed ("param") and mixed-precision ("fp32_param") optimizers,
# under a ChainedOptimizer's "chained_N." prefix
_MAIN = re.compile(r"^((?:chained_\d+\.)?optimizer\.state\.)(fp32_param|param)(\..+)$")


def _own_common(request, loaded):
    """``loaded`` with the request's own non-tensor values (param groups, step, format name).

    The optimizer's tensors (Adam moments, fp32 main weights) reshard by key whatever optimizer
    saved them, but its plain values are laid out per optimizer kind: a checkpoint of the
    distributed optimizer (DP > 1) must load into the plain one (DP = 1) and back. The learning
    rate and weight decay are set at every step and Adam's step count from the meta, so the
    current optimizer's values are the right ones.
    """
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if isinstance(request, ShardedBase):
        return loaded
    if isinstance(request, LocalNonpersistentObject):
        return request.unwrap()
    if isinstance(request, dict):
        return {k: _own_common(v, loaded[k]) if k in loaded else v for k, v in request.items()}
    if isinstance(request, list | tuple):
        return type(request)(_own_common(r, x) for r, x in zip(request, loaded))
    return request


def _match_main_weights(sharded: dict, ckpt: Path) -> dict:
    """Point the optimizer's fp32 main-weight requests at what ``ckpt`` holds.

    The distributed optimizer names them ``param``, the mixed-precision one ``fp32_param``: a
    request takes the other name when its own is absent. The plain fp32 optimizer saves none (its
    main weights are the parameters); such requests are taken out and returned by path, with
    the empty tensor each would have filled, for :func:`load_checkpoint` to put back.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    saved = set(dist_checkpointing.load_tensors_metadata(str(ckpt)))
    missing = {}

    def walk(node, path):
        for k, v in list(node.items()) if isinstance(node, dict) else ():
            main = _MAIN.match(getattr(v, "key", ""))
            if not (isinstance(v, ShardedBase) and main):
                walk(v, (*path, k))
                continue
            other = (
                main.group(1) + ("param" if main.group(2) == "fp32_param" else "fp32_param") + main.group(3)
            )
            if v.key not in saved and other in saved:
                node[k] = dataclasses.replace(v, key=other)
            elif v.key not in saved:
                missing[(*path, k)] = v.data
                node[k] = None

    walk(sharded, ())
    return missing


def _sharded_items(tree, path=()):
    """``(path, node, key, ShardedBase)`` of every sharded leaf of a (nested) sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    for k, v in list(tree.items()) if isinstance(tree, dict) else enumerate(tree):
        if isinstance(v, ShardedBase):
            yield (*path, k), tree, k, v
        elif isinstance(v, dict | list):
            yield from _sharded_items(v, (*path, k))


def _layout(model_sd: dict) -> str | None:
    """The layer-spec key layout (``spec_keys``) of a model's sharded state dict."""
    return spec_keys.layout_of(v.key for *_, v in _sharded_items(model_sd))


def _match_layout(sharded: dict, ckpt: Path, meta: dict) -> None:
    """Point every request of ``sharded`` at the key ``ckpt`` holds it under, when the checkpoint
    was written under the other layer spec's key layout (``spec_keys``: local vs
    transformer-engine; from the meta, else from its keys).

    A request absent from the checkpoint takes its name in the checkpoint's layout; an
    ``_extra_state`` request with no counterpart is dropped (the module keeps its own); any other
    key with no counterpart is refused (:class:`CheckpointError`, one line naming both layouts).
    The optimizer's fp32 main-weight requests are renamed and left to :func:`_match_main_weights`.
    """

    # tensors and objects (``_extra_state``); not re-exported by dist_checkpointing from 0.17 on
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    mine = _layout(sharded["model"])
    # an object is listed by its unique key (``<key>/shard_<offsets>``); its ``key`` is what a request names
    saved = {getattr(v, "key", k) for k, v in load_sharded_metadata(str(ckpt)).items()}
    theirs = meta.get("layer_spec") or spec_keys.layout_of(saved)
    if mine is None or theirs is None or mine == theirs:
        return
    for _path, node, k, v in list(_sharded_items(sharded)):
        if v.key in saved:
            continue
        other = spec_keys.convert(v.key, mine, theirs)
        if other in saved or (other != v.key and _MAIN.match(v.key)):
            node[k] = dataclasses.replace(v, key=other)
        elif v.key.endswith(spec_keys.EXTRA_STATE) and isinstance(node, dict):
            del node[k]
        else:
            raise CheckpointError(
                f"checkpoint {ckpt} holds the {theirs} layer spec's keys and this model has the "
                f"{mine} layer spec's: {v.key} has no counterpart there (moe_rl/megatron/spec_keys.py)"
            )


def _containers_copy(tree):
    """A copy of the dicts and lists of ``tree`` holding the same leaves."""
    if isinstance(tree, dict):
        return {k: _containers_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_containers_copy(v) for v in tree]
    return tree


def _put_back(loaded: dict, missing: dict) -> None:
    """Put each request :func:`_match_main_weights` took out back into ``loaded`` (its path)."""
    for path, tensor in missing.items():
        node = loaded
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = tensor


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


class CheckpointError(UserError):
    """No usable checkpoint where one was asked for (missing, corrupt, truncated, non-finite)."""

    kind = "checkpoint error"


class NoCheckpoint(CheckpointError, FileNotFoundError):
    """Nothing intact to load at the path given."""


class NonFiniteWeights(RuntimeError):
    """The model holds NaN or infinite weights: it is never saved, exported or synced."""


def weights_finite(model, group=None) -> bool:
    """True when every parameter of ``model`` is finite on every rank (a collective over ``group``).

    One fp32 sum per parameter first: a finite sum means every element is finite (a NaN or an
    infinity makes the sum NaN or infinite), and reading a tensor once costs about a tenth of
    ``isfinite(p).all()``, which writes a mask of it. Only a non-finite sum, a NaN or an overflow of
    finite values, is settled element by element, so the answer is exact."""
    params = [p.detach() for p in model.parameters()]
    sums = torch.stack([p.sum(dtype=torch.float32) for p in params])
    finite = bool(torch.isfinite(sums).all()) or all(bool(torch.isfinite(p).all()) for p in params)
    return dist.all_ranks(finite, group)


def non_finite_names(model) -> list[str]:
    """The names of this rank's parameters of ``model`` holding a NaN or an infinity."""
    return [name for name, p in model.named_parameters() if not bool(p.detach().isfinite().all())]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _checksums(ckpt: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file of a checkpoint directory but its meta."""
    return {
        str(p.relative_to(ckpt)): _sha256(p)
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != META
    }


_NAME = re.compile(r"step-(\d+)|(\d+)-([a-z][a-z0-9_]*(?:-[a-z0-9_]+)*)")
"A checkpoint directory's name: ``step-<number>`` (the older scheme) or ``<number>-<label>``."


def checkpoint_name(number: int, label: str | None = None) -> str:
    """The directory name of checkpoint ``number``: ``<number, 4 digits>-<label>`` (``checkpoint``
    when no label is given); ``label`` is lower-case words joined by ``-``, e.g. ``sft-step-000060``."""
    name = f"{number:04d}-{label or 'checkpoint'}"
    if number < 0 or not _NAME.fullmatch(name):
        raise ValueError(f"checkpoint {number} {label!r}: a label is lower-case words joined by '-'")
    return name


def step_number(path: Path) -> int | None:
    """The number of a checkpoint directory (``0003-sft-step-000060``: 3; the older ``step-N``: N),
    None for any other name. It orders a directory's checkpoints."""
    m = _NAME.fullmatch(path.name)
    return None if m is None else int(m.group(1) or m.group(2))


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """The checkpoint directories under ``root`` (both naming schemes), oldest first by their
    number (not by name)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_number(p) is not None and p.is_dir()]
    return sorted(found, key=lambda p: (step_number(p), p.name))


def _prune(root: Path, newest: Path, keep: int, owner: str | None) -> None:
    """Remove the oldest of ``owner``'s checkpoints beyond ``keep``; never ``newest`` (just written)
    and never a checkpoint of another owner (another run's, kept by ``--fresh``)."""
    mine = [p for p in checkpoint_dirs(root) if p != newest and _owner(p) == owner]
    for old in mine[: max(len(mine) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def _owner(ckpt: Path) -> str | None:
    try:
        return json.loads((ckpt / META).read_text()).get("owner")
    except (OSError, ValueError):
        return None


def save_checkpoint(
    root: str | Path,
    step: int,
    model,
    optimizer=None,
    *,
    extra: dict | None = None,
    keep: int = 2,
    owner: str | None = None,
    label: str | None = None,
) -> Path:
    """Save model, optimizer, RNG and ``extra`` (JSON-able) as checkpoint number ``step`` of
    ``root`` (``root/<step>-<label>``, :func:`checkpoint_name`); return its path.

    Refuses (:class:`NonFiniteWeights`, nothing written) a model with a non-finite weight. The
    meta records every file's sha256 and ``finite: true``; it is written last, atomically.
    Retention keeps the ``keep`` newest checkpoints of ``owner`` by step number, the new one
    always among them, and leaves other owners' checkpoints alone.
    """
    from megatron.core import dist_checkpointing

    if not weights_finite(model):
        raise NonFiniteWeights(f"the model has non-finite weights: checkpoint {step} not written")
    root = Path(root)
    name = checkpoint_name(step, label)
    tmp = root / f".tmp-{name}"
    if dist.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    stepped = optimizer is not None and optimizer.step_count > 0
    state = _sharded_state(model, optimizer, is_loading=False, with_optimizer=stepped)
    layout = _layout(state["model"])
    with guarded_writer():
        dist_checkpointing.save(state, str(tmp))
    torch.save(_rng_state(), tmp / f"rng-{dist.rank()}.pt")
    dist.barrier()
    final = root / name
    if dist.rank() == 0:
        meta = {
            "step": step,
            "world_size": dist.world_size(),
            "optimizer_step": optimizer.step_count if optimizer is not None else None,
            "extra": extra or {},
            "owner": owner,
            "layer_spec": layout,
            "finite": True,
            "sha256": _checksums(tmp),
        }
        write_text(tmp / META, json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_text(root / "latest", name)
        _prune(root, final, keep, owner)
    dist.barrier()
    log.info("saved checkpoint %s", final)
    return final


_VERIFIED: dict[tuple[str, int, int, str], bool] = {}
"""(file, size, mtime_ns, expected sha256) -> matched: a resume checks the same files up to three
times (exists, run state, load); a file changed since is hashed again."""


def _matches(f: Path, digest: str) -> bool:
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns, digest)
    if key not in _VERIFIED:
        _VERIFIED[key] = _sha256(f) == digest
    return _VERIFIED[key]


def verify_checkpoint(ckpt: str | Path) -> str | None:
    """Why ``ckpt`` cannot be loaded (missing or unreadable meta, a file missing, truncated or
    changed since it was written, weights saved non-finite), or None when it is intact.

    Checkpoints written before checksums were recorded pass on their meta alone.
    """
    ckpt = Path(ckpt)
    try:
        meta = json.loads((ckpt / META).read_text())
    except FileNotFoundError:
        return "no meta.json (an unfinished or foreign directory)"
    except (OSError, ValueError) as e:
        return f"unreadable meta.json ({e})"
    if not isinstance(meta, dict) or "step" not in meta:
        return "meta.json has no step"
    if meta.get("finite") is False:
        return "its weights were non-finite"
    for rel, digest in (meta.get("sha256") or {}).items():
        f = ckpt / rel
        if not f.is_file():
            return f"{rel} is missing"
        if not _matches(f, digest):
            return f"{rel} is truncated or corrupt (sha256 mismatch)"
    return None


def find_checkpoint(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint under ``root`` (or ``root`` itself if it is one) and what was
    skipped on the way (``"<name>: <why>"``): a dangling ``latest``, a truncated or corrupt one.

    Candidates: the one ``latest`` names, then every checkpoint directory newest first. Rank 0 decides and
    every rank gets its answer.
    """
    root = Path(root)
    if dist.rank() != 0:
        found = dist.broadcast_object(None)
        return (None if found[0] is None else Path(found[0])), found[1]
    if (root / META).exists():
        why = verify_checkpoint(root)
        found = (None, [f"{root}: {why}"]) if why else (root, [])
    else:
        found = _search(root)
    dist.broadcast_object((None if found[0] is None else str(found[0]), found[1]))
    return found


def _search(root: Path) -> tuple[Path | None, list[str]]:
    skipped, candidates = [], []
    pointer = root / "latest"
    if pointer.is_file():
        named = pointer.read_text().strip()
        if not (root / named / META).exists():
            skipped.append(f"latest -> {named}: no such checkpoint")
        else:
            candidates.append(root / named)
    candidates += [p for p in reversed(checkpoint_dirs(root)) if p not in candidates]
    for ckpt in candidates:
        why = verify_checkpoint(ckpt)
        if why is None:
            return ckpt, skipped
        skipped.append(f"{ckpt.name}: {why}")
    return None, skipped


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest intact checkpoint under ``root`` (or ``root`` itself if it is one); see
    :func:`find_checkpoint`, which also says what it skipped."""
    return find_checkpoint(root)[0]


_SHAPE_MISMATCH = re.compile(
    r"shape mismatch for loaded \(([^)]*\)?)\) and expected \(([^)]*\)?)\) tensor for key (\S+)"
)


def shape_mismatch(e: BaseException) -> str | None:
    """``<key> is <shape> in the checkpoint and <shape> in the model`` when megatron-core refused a
    load for a tensor's shape (its message may sit inside torch's per-rank ``CheckpointException``);
    else None."""
    text = "".join(traceback.format_exception(e))
    m = _SHAPE_MISMATCH.search(text)
    if m is None:
        return None
    loaded, expected, key = m.groups()
    return f"{key} is {loaded} in the checkpoint and {expected} in the model"


def _read_checkpoint(ckpt: Path, model, optimizer):
    """Read checkpoint ``ckpt`` for ``model`` (and ``optimizer``): its meta, whether the optimizer's
    state is in it, the request and main-weight bookkeeping, and megatron-core's loaded state."""
    from megatron.core import dist_checkpointing

    meta = json.loads((ckpt / META).read_text())
    if optimizer is not None and meta.get("optimizer_step") is None:
        raise ValueError(f"checkpoint {ckpt} has no optimizer state; load it without an optimizer")
    # An optimizer saved before its first step has no state: loading it is a reset.
    with_optimizer = optimizer is not None and meta["optimizer_step"] > 0
    sharded = _sharded_state(model, optimizer, is_loading=True, with_optimizer=with_optimizer)
    _match_layout(sharded, ckpt, meta)
    request = _containers_copy(sharded)  # load fills ``sharded`` in place
    missing = _match_main_weights(sharded, ckpt) if with_optimizer else {}
    try:
        loaded = dist_checkpointing.load(sharded, str(ckpt))
    except BaseException as e:  # megatron's CheckpointingException, inside torch's (a BaseException)
        differs = shape_mismatch(e)
        if differs is None:
            raise
        raise CheckpointError(
            f"checkpoint {ckpt} does not fit this recipe's model: {differs}; load it with the model "
            "section it was saved with (the run's recipe.yaml) or start without it"
        ) from e
    return meta, with_optimizer, request, missing, loaded


def load_checkpoint(path: str | Path, model, optimizer=None, *, load_rng: bool = True) -> dict:
    """Load a checkpoint (a checkpoint directory, or a root with ``latest``) into this layout.

    From a root, the newest intact checkpoint is loaded (:func:`find_checkpoint`; a warning names
    what was skipped); :class:`CheckpointError` when there is none. Returns the meta dict
    (``step``, ``extra``, ``path``, ...). RNG state is restored only when the world size matches
    the one that saved it.
    """

    for attempt in range(3):
        ckpt, skipped = find_checkpoint(path)
        if skipped and ckpt is not None:
            log.warning("loading %s; skipped: %s", ckpt, "; ".join(skipped))
        if ckpt is None:
            why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            raise NoCheckpoint(
                f"no complete checkpoint at {path}{why}: give a checkpoint directory or a checkpoint root "
                "with one (checkpoint.load, --checkpoint, --resume)"
            )
        try:
            meta, with_optimizer, request, missing, loaded = _read_checkpoint(ckpt, model, optimizer)
            break
        except BaseException as e:  # torch's CheckpointException is one; re-raised unless pruned meanwhile
            if isinstance(e, (KeyboardInterrupt, SystemExit)) or not dist.all_ranks(
                not (ckpt / META).exists()
            ):
                raise  # an interrupt, or the checkpoint is still there: a real failure
            if Path(path).resolve() == ckpt.resolve() or attempt == 2:
                raise CheckpointError(
                    f"checkpoint {ckpt} was removed while it was read (a running run's retention pruned "
                    "it): load again, or give its run's checkpoint root to take the newest"
                ) from e
            log.warning(
                "%s was removed while it was read (pruned by its run): loading the newest again", ckpt
            )
    model.load_state_dict(loaded["model"], strict=False)
    if with_optimizer:
        _put_back(loaded, missing)
        weights = [p.detach().clone() for p in model.parameters()] if missing else []
        state = _own_common(request["optimizer"], loaded["optimizer"])
        optimizer.load_state_dict(state, int(meta["optimizer_step"]))
        if missing:  # no main weights saved (plain fp32 optimizer): they are the parameters
            with torch.no_grad():
                for p, w in zip(model.parameters(), weights):
                    p.copy_(w)
            optimizer.reload_model_params()
    elif optimizer is not None:
        optimizer.reset()
    rng = ckpt / f"rng-{dist.rank()}.pt"
    if load_rng and meta.get("world_size") == dist.world_size() and rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    meta["path"] = str(ckpt)
    return meta
