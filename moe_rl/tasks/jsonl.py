"""User data: prompts and answers from a JSONL file, scored by a user reward function.

Each non-blank line is a JSON object. ``task.jsonl.prompt_field`` names the prompt
string, ``answer_field`` the reference answer, and the optional ``response_field`` a
demonstration response for SFT. The reward is ``task.jsonl.reward_fn``, written as
``module:function`` (or ``path/to/file.py:function``) and called as
``fn(response_text, answer, record) -> float``, where ``record`` is the line's object.

Training order is a seeded permutation of the training records per epoch: position
``step * batch_size + i`` of the stream, so a fixed batch size visits every record once
per epoch. Held-out records are those of ``heldout_path``, or else those whose prompt
text hashes into ``task.heldout_fraction``; training never sees a held-out prompt text.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import numbers
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from moe_rl.configlib import ConfigError
from moe_rl.errors import UserError
from moe_rl.tasks.base import Prompt, is_heldout, make_rng
from moe_rl.tasks.config import TaskConfig


class JsonlDataError(ConfigError):
    """A JSONL file or record that cannot be used; the message names the file and line."""

    kind = "data error"


class RewardError(UserError):
    """The user reward function raised or returned something other than a finite number; the
    message names the record (file and line) and what came back."""

    kind = "reward error"


def exact_match(response: str, answer: str, record: dict) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the answer."""
    return float(response.strip() == answer.strip())


def answer_marker_match(response: str, answer: str, record: dict) -> float:
    """1.0 when the text after the first ``A:``, up to the end of its line, equals the answer."""
    _, found, rest = response.partition("A:")
    return float(bool(found) and rest.split("\n", 1)[0].strip() == answer.strip())


def import_reward_fn(spec: str) -> Callable[[str, str, dict], float]:
    """Import ``module:function`` or ``path/to/file.py:function``; errors say what to fix."""
    where = f"task.jsonl.reward_fn={spec!r}"
    module_name, _, fn_name = spec.rpartition(":")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ConfigError(f"{where}: file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"moe_rl_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise ConfigError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ConfigError(
                f"{where}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
                "put it on PYTHONPATH or write path/to/file.py:function"
            ) from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ConfigError(f"{where}: module {module_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise ConfigError(f"{where}: {module_name}.{fn_name} is not callable")
    return fn


def _answer_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def read_records(path: str | Path, cfg_fields: tuple[str, ...], what: str) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; every object must hold ``cfg_fields``."""
    p = Path(path)
    if p.is_dir():
        raise JsonlDataError(f"{what}={str(path)!r} is a folder: give the JSONL file inside it")
    if not p.is_file():
        raise JsonlDataError(f"{what}={str(path)!r}: file does not exist")
    out = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise JsonlDataError(
                    f"{p}:{lineno}: not UTF-8 text (byte {e.start} of the line): save the file as UTF-8"
                ) from e
            if line.strip():
                out.append((lineno, _parse_record(p, lineno, line, cfg_fields)))
    if not out:
        raise JsonlDataError(f"{what}={str(path)!r}: the file has no records")
    return out


def _parse_record(p: Path, lineno: int, line: str, cfg_fields: tuple[str, ...]) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise JsonlDataError(f"{p}:{lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(rec, dict):
        raise JsonlDataError(f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}")
    for name in cfg_fields:
        if name not in rec:
            raise JsonlDataError(
                f"{p}:{lineno}: missing field {name!r} (keys: {', '.join(sorted(rec)) or 'none'}); "
                "fix the line or set task.jsonl.*_field to the right key"
            )
    return rec


class JsonlTask:
    """See the module docstring; knobs in :class:`moe_rl.tasks.config.JsonlConfig`."""

    name = "jsonl"

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        c = cfg.jsonl
        self.reward_fn = import_reward_fn(c.reward_fn)
        needed = (c.prompt_field, c.answer_field) + ((c.response_field,) if c.response_field else ())
        train = [self._prompt(c.path, n, r) for n, r in read_records(c.path, needed, "task.jsonl.path")]
        if c.heldout_path is not None:
            held = read_records(c.heldout_path, needed[:2], "task.jsonl.heldout_path")
            self._heldout = [self._prompt(c.heldout_path, n, r) for n, r in held]
            held_texts = {p.text for p in self._heldout}
            self._train = [p for p in train if p.text not in held_texts]
        else:
            self._heldout = [p for p in train if is_heldout(p.text, cfg.heldout_fraction)]
            self._train = [p for p in train if not is_heldout(p.text, cfg.heldout_fraction)]
        if not self._train:
            raise ConfigError(
                f"task.jsonl.path={c.path!r}: no training records are left after the held-out split; "
                "add records or lower task.heldout_fraction"
            )
        self._perm = lru_cache(maxsize=4)(self._permutation)

    def _prompt(self, path: str, lineno: int, rec: dict) -> Prompt:
        c = self.cfg.jsonl
        text = rec[c.prompt_field]
        if not isinstance(text, str):
            raise JsonlDataError(f"{path}:{lineno}: field {c.prompt_field!r} must be a string, got {text!r}")
        meta = {"record": rec, "line": lineno, "path": path}
        if c.response_field and c.response_field in rec:
            meta["response"] = rec[c.response_field]
        return Prompt(
            text=c.prompt_template.replace("{prompt}", text),
            answer=_answer_text(rec[c.answer_field]),
            metadata=meta,
        )

    def _permutation(self, rng_seed: int, stream: str, epoch: int) -> list[int]:
        order = list(range(len(self._train)))
        make_rng(self.name, stream, rng_seed, epoch).shuffle(order)
        return order

    def _at(self, rng_seed: int, stream: str, position: int) -> Prompt:
        epoch, i = divmod(position, len(self._train))
        return self._train[self._perm(rng_seed, stream, epoch)[i]]

    @property
    def num_train(self) -> int:
        """Training records (after removing held-out prompts)."""
        return len(self._train)

    def sample(self, step: int, batch_size: int, rng_seed: int) -> list[Prompt]:
        """Positions step*batch_size .. +batch_size-1 of the per-epoch shuffled training stream."""
        return [self._at(rng_seed, "train", step * batch_size + i) for i in range(batch_size)]

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """The user function's value, as a float; a raise, a non-number or a non-finite value is a
        :class:`RewardError` naming the record."""
        meta = prompt.metadata
        where = (
            f"task.jsonl.reward_fn={self.cfg.jsonl.reward_fn} on the record at {meta['path']}:{meta['line']}"
        )
        try:
            value = self.reward_fn(response_text, prompt.answer, meta["record"])
        except (Exception, SystemExit) as e:  # sys.exit() in a reward ended the run with no word
            raise RewardError(
                f"{where} raised {type(e).__name__}: {e} (response {response_text[:60]!r})"
                + (": a reward function must return a number, not exit" if isinstance(e, SystemExit) else "")
            ) from e
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"{where} returned {value!r} ({type(value).__name__}): it must return a finite number, e.g. 0.0 or 1.0"
            )
        return float(value)

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``n`` (prompt, response) pairs from the response field, cycling through shuffled epochs."""
        if not self.cfg.jsonl.response_field:
            raise ConfigError(
                "the jsonl task has no demonstrations: set task.jsonl.response_field to the key "
                "holding a reference response"
            )
        out = []
        for k in range(n):
            p = self._at(seed, "demo", k)
            out.append((p.text, str(p.metadata["response"])))
        return out

    def longest_prompts(self) -> list[str]:
        """Every prompt text of the file(s): the model must hold the longest."""
        return [p.text for p in (*self._train, *self._heldout)]

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` held-out records in file order (fewer when the split is smaller)."""
        return self._heldout[:n]
