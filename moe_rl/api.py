"""The Python API (docs/api.md): build a run from a recipe file or a dict, train it, evaluate it,
read its metrics; your own data (a list of dicts, a ``datasets.Dataset``) and reward function (a
Python callable) without writing files yourself.

    import moe_rl

    recipe = moe_rl.load_recipe("recipes/tiny.yaml", ["train.sft_steps=20"])   # or recipe_from_dict({...})
    results = moe_rl.train(recipe)               # every stage, as `moe-rl train`: last metrics per stage
    rows = moe_rl.read_metrics(recipe.train.out_dir, "sft")
    print(moe_rl.evaluate(recipe))               # held-out greedy accuracy of the run's newest checkpoint

It behaves as the command line does: the same checks before anything starts, progress lines (phase,
step / total, s/step, ETA) on stderr when no logging is configured, megatron-core's warnings and the
dependencies' no user caused hidden (``verbose=True`` shows them), resumable runs. Training starts
child processes (megatron-core's checkpoint writer): a script calls it under
``if __name__ == "__main__":``, and one that does not is told so in one line
(:func:`moe_rl.mainguard.check_main_guard`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_rl.config import load_recipe, recipe_from_dict, to_dict
from moe_rl.configlib import ConfigError
from moe_rl.mainguard import check_main_guard
from moe_rl.preflight import preflight
from moe_rl.trainer.metrics import read_metrics as read

if TYPE_CHECKING:
    from moe_rl.config import Recipe

__all__ = ["evaluate", "load_recipe", "read_metrics", "recipe_from_dict", "train", "with_data"]

DATA_DIR = "data"
"Where :func:`with_data` writes rows given in Python: ``<train.out_dir>/data/{train,heldout}.jsonl``."


def _show_progress(verbose: bool) -> None:
    """Progress lines on stderr (INFO) when the caller configured no logging; dependencies quiet."""
    from moe_rl.quiet import quiet_dependencies

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
        )
    quiet_dependencies(verbose)


def _rows(data: Any, what: str) -> list[dict]:
    """Records of ``data``: a list (or iterable) of dicts, or anything with ``to_list()`` (a
    ``datasets.Dataset``, a pyarrow Table) giving one."""
    rows = data.to_list() if hasattr(data, "to_list") else list(data)
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None or not rows:
        got = "no records" if not rows else f"record {bad} is a {type(rows[bad]).__name__}"
        raise ConfigError(f"{what}: expected a list of dicts or a datasets.Dataset, got {got}")
    return rows


def _plain(value: Any) -> Any:
    """A numpy scalar or array (as a Dataset's rows may hold) as plain JSON values."""
    for attr in ("tolist", "item"):
        if hasattr(value, attr):
            return getattr(value, attr)()
    raise TypeError(f"{type(value).__name__} is not JSON: give str, numbers, lists or dicts")


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(
        "".join(json.dumps(r, default=_plain, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    os.replace(tmp, path)
    return os.path.abspath(path)  # a recipe's input paths are absolute (moe_rl.config.RECIPE_PATHS)


def reward_spec(fn: str | Callable) -> str:
    """``task.jsonl.reward_fn`` for ``fn``: a string as it is; a function of an importable module as
    ``module:name`` (child processes import it too); any other callable (one defined in a script or
    a notebook, a lambda, a closure) registered here, in this process, as ``moe_rl.api:<name>``."""
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise ConfigError(f"reward={fn!r}: give a function or a 'module:function' string")
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and qual.isidentifier():
        return f"{module}:{qual}"
    name = "reward_" + re.sub(r"\W", "_", qual or "fn") + f"_{id(fn):x}"
    globals()[name] = fn
    return f"{__name__}:{name}"


def with_data(
    recipe: Recipe, *, data: Any = None, heldout: Any = None, reward: str | Callable | None = None
) -> Recipe:
    """``recipe`` on your own data and reward: ``task.name=jsonl`` with ``data`` (training prompts)
    and ``heldout`` (evaluation prompts; None: held out by ``task.heldout_fraction``) written as
    JSONL under ``<train.out_dir>/data`` (either layout of docs/design.md#your-own-data: ``prompt`` +
    ``answer``, or verl's), and ``reward`` as ``task.jsonl.reward_fn`` (:func:`reward_spec`; its
    signature, plain or verl's, found by its parameter names). Nothing given: ``recipe`` itself."""
    if data is None and heldout is None and reward is None:
        return recipe
    folder = Path(recipe.train.out_dir) / DATA_DIR
    jsonl: dict[str, Any] = {}
    if data is not None:
        jsonl["path"] = _write_jsonl(folder / "train.jsonl", _rows(data, "data"))
    if heldout is not None:
        jsonl["heldout_path"] = _write_jsonl(folder / "heldout.jsonl", _rows(heldout, "heldout"))
    if reward is not None:
        jsonl["reward_fn"] = reward_spec(reward)
    task = replace(recipe.task, name="jsonl", jsonl=replace(recipe.task.jsonl, **jsonl))
    return replace(recipe, task=task)


def train(
    recipe: Recipe | str | Path | dict,
    overrides: Iterable[str] = (),
    *,
    data: Any = None,
    heldout: Any = None,
    reward: str | Callable | None = None,
    resume: bool = False,
    fresh: bool = False,
    hooks: Iterable = (),
    verbose: bool = False,
) -> dict[str, dict[str, float]]:
    """Run every stage of ``recipe`` (a :class:`~moe_rl.config.Recipe`, a recipe file, or a dict of
    sections; ``overrides`` as ``section.field=value``) as ``moe-rl train`` does, optionally on your
    own ``data`` / ``heldout`` / ``reward`` (:func:`with_data`); the last metrics of each stage
    (``{"sft": {...}, "rl": {...}}``; every row: :func:`read_metrics`). ``resume``, ``fresh``: as
    ``--resume`` / ``--fresh``; ``hooks``: called after each optimizer step
    (:mod:`moe_rl.trainer.hooks`). A stop signal ends it with
    :class:`~moe_rl.trainer.signals.StopRequested` after a checkpoint."""
    check_main_guard("moe_rl.train")
    _show_progress(verbose)
    recipe = with_data(_recipe(recipe, overrides), data=data, heldout=heldout, reward=reward)
    from moe_rl.trainer.run import run

    preflight(recipe)
    return run(recipe, resume=resume, fresh=fresh, hooks=hooks)


def _recipe(recipe: Recipe | str | Path | dict, overrides: Iterable[str]) -> Recipe:
    overrides = list(overrides)
    if isinstance(recipe, (str, Path)):
        return load_recipe(recipe, overrides)
    if isinstance(recipe, dict):
        return recipe_from_dict(recipe, overrides)
    if overrides:
        return recipe_from_dict(to_dict(recipe), overrides)
    return recipe


def evaluate(
    recipe: Recipe | str | Path | dict,
    overrides: Iterable[str] = (),
    *,
    checkpoint: str | Path | None = None,
    prompts: int | None = None,
    verbose: bool = False,
) -> dict[str, float]:
    """Greedy accuracy on ``prompts`` (default ``train.eval_prompts``) held-out prompts of the
    task, as the RL stage evaluates: of ``checkpoint`` (a checkpoint or a checkpoint root), else the
    run's newest checkpoint, else the recipe's start (``checkpoint.load``, ``model.hf_path``, random
    weights). Writes nothing into the run. ``{"eval/accuracy": ...}``."""
    from moe_rl.megatron.checkpoint import latest_checkpoint, load_checkpoint
    from moe_rl.trainer.context import Run, checkpoint_root
    from moe_rl.trainer.loop import evaluate as evaluate_run

    _show_progress(verbose)
    recipe = _recipe(recipe, overrides)
    train_cfg = replace(recipe.train, samples_every=0, eval_prompts=prompts or recipe.train.eval_prompts)
    recipe = replace(recipe, train=train_cfg)
    run = Run(recipe, write_recipe=False)
    try:
        source = checkpoint or latest_checkpoint(checkpoint_root(recipe)) or recipe.checkpoint.load
        if source:
            load_checkpoint(source, run.policy.model, load_rng=False)
        run.ensure_engine()
        return evaluate_run(run, 0)
    finally:
        run.close()


def read_metrics(run_dir: str | Path, stage: str | None = None) -> list[dict]:
    """Every row of a run's ``metrics.jsonl`` (``stage``: ``sft``, ``rl`` or ``rl_eval`` only), as
    written: rates as fractions (0.27 = 27%)."""
    return read(Path(run_dir) / "metrics.jsonl", stage)
