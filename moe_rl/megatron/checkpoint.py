"""Atomic, resharding checkpoints with megatron.core.dist_checkpointing.

Layout of ``root/``::

    step-00000012/        one checkpoint: dist_checkpointing files (model + optimizer),
                          meta.json (step, extra state), rng-<rank>.pt per rank
    latest                name of the newest complete checkpoint (written last, atomically)

Every rank writes into ``root/.tmp-step-N``; after a barrier rank 0 renames it to
``step-N`` and then replaces ``latest``. A crash mid-save leaves only a ``.tmp-*``
directory behind, which the next save removes; ``latest`` still names the previous
checkpoint. Weights, Adam moments and fp32 main weights are ShardedTensors (megatron-core's
``optimizer.sharded_state_dict``; the distributed optimizer's ``fully_sharded_model_space``
format), so a checkpoint saved at one TP/EP/DP layout loads into another with its optimizer
state.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from moe_rl import dist

log = logging.getLogger(__name__)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    import dataclasses

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


def save_checkpoint(
    root: str | Path, step: int, model, optimizer=None, *, extra: dict | None = None, keep: int = 2
) -> Path:
    """Save model, optimizer, RNG and ``extra`` (JSON-able) as ``root/step-N``; return its path."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    name = f"step-{step:08d}"
    tmp = root / f".tmp-{name}"
    if dist.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    stepped = optimizer is not None and optimizer.step_count > 0
    dist_checkpointing.save(
        _sharded_state(model, optimizer, is_loading=False, with_optimizer=stepped), str(tmp)
    )
    torch.save(_rng_state(), tmp / f"rng-{dist.rank()}.pt")
    dist.barrier()
    final = root / name
    if dist.rank() == 0:
        meta = {
            "step": step,
            "world_size": dist.world_size(),
            "optimizer_step": optimizer.step_count if optimizer is not None else None,
            "extra": extra or {},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / "latest", name)
        done = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    log.info("saved checkpoint %s", final)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one)."""
    root = Path(root)
    if (root / "meta.json").exists():
        return root
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "meta.json").exists() else None


def load_checkpoint(path: str | Path, model, optimizer=None, *, load_rng: bool = True) -> dict:
    """Load a checkpoint (a ``step-N`` dir, or a root with ``latest``) into this layout.

    Returns the meta dict (``step``, ``extra``, ...). RNG state is restored only when the
    world size matches the one that saved it.
    """
    from megatron.core import dist_checkpointing

    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(
            f"no complete checkpoint at {path} (expected meta.json or a "
            "'latest' pointer): check checkpoint.load / --resume"
        )
    meta = json.loads((ckpt / "meta.json").read_text())
    if optimizer is not None and meta.get("optimizer_step") is None:
        raise ValueError(f"checkpoint {ckpt} has no optimizer state; load it without an optimizer")
    # An optimizer saved before its first step has no state: loading it is a reset.
    with_optimizer = optimizer is not None and meta["optimizer_step"] > 0
    sharded = _sharded_state(model, optimizer, is_loading=True, with_optimizer=with_optimizer)
    request = _containers_copy(sharded)  # load fills ``sharded`` in place
    missing = _match_main_weights(sharded, ckpt) if with_optimizer else {}
    loaded = dist_checkpointing.load(sharded, str(ckpt))
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
    return meta
