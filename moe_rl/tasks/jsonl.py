"""User data: prompts and answers from a JSONL or parquet file, scored by a user reward function.

Each file is read by :mod:`moe_rl.tasks.data`: JSONL or parquet, in the plain layout
(``task.jsonl.prompt_field`` and ``answer_field``) or verl's RL layout (``data_source``, ``prompt``,
``reward_model.ground_truth``, ``extra_info``), chosen by ``task.jsonl.format`` (``auto``: per file).
A prompt is a string or a list of chat messages, rendered with the tokenizer's chat template when
it has one. The optional ``response_field`` names a demonstration response for SFT.

The reward is ``task.jsonl.reward_fn``, written as ``module:function`` (or
``path/to/file.py:function``): ``fn(response_text, answer, record) -> float`` or verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)`` returning a float or
``{"score": ...}``, optionally batched (:mod:`moe_rl.tasks.rewards`).

Training order is a seeded permutation of the training records per epoch: position
``step * batch_size + i`` of the stream, so a fixed batch size visits every record once
per epoch. Held-out records are those of ``heldout_path``, or else those whose prompt
text hashes into ``task.heldout_fraction``; training never sees a held-out prompt text.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from moe_rl.configlib import ConfigError
from moe_rl.tasks.base import Prompt, is_heldout, make_rng
from moe_rl.tasks.config import TaskConfig
from moe_rl.tasks.data import JsonlDataError, Row, answer_text, prompt_text, read_rows
from moe_rl.tasks.rewards import RewardError, RewardFn, RewardInput, import_reward_fn

__all__ = [
    "JsonlDataError",
    "JsonlTask",
    "RewardError",
    "answer_marker_match",
    "exact_match",
    "import_reward_fn",
]


def exact_match(response: str, answer: str, record: dict) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the answer."""
    return float(response.strip() == answer.strip())


def answer_marker_match(response: str, answer: str, record: dict) -> float:
    """1.0 when the text after the first ``A:``, up to the end of its line, equals the answer."""
    _, found, rest = response.partition("A:")
    return float(bool(found) and rest.split("\n", 1)[0].strip() == answer.strip())


class JsonlTask:
    """See the module docstring; knobs in :class:`moe_rl.tasks.config.JsonlConfig`."""

    name = "jsonl"
    uses_tokenizer = True
    "build_task passes the run's tokenizer: chat-message prompts are rendered with its template."

    def __init__(self, cfg: TaskConfig, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        c = cfg.jsonl
        self.reward_fn = RewardFn(c.reward_fn, c.reward_signature, c.reward_batched)
        train = [self._prompt(r) for r in self._read(c.path, "task.jsonl.path", c.response_field)]
        if c.heldout_path is not None:
            self._heldout = [self._prompt(r) for r in self._read(c.heldout_path, "task.jsonl.heldout_path")]
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

    def _read(self, path: str, what: str, response_field: str | None = None) -> list[Row]:
        c = self.cfg.jsonl
        extra = (response_field,) if response_field else ()
        return read_rows(
            path, what, fmt=c.format, prompt_field=c.prompt_field, answer_field=c.answer_field, extra=extra
        )

    def _prompt(self, row: Row) -> Prompt:
        c = self.cfg.jsonl
        text = prompt_text(row.prompt, row.where, c.prompt_field, self.tokenizer)
        meta = {"record": row.record, "line": row.line, "path": row.path, "where": row.where, "row": row}
        if c.response_field and c.response_field in row.record:
            meta["response"] = row.record[c.response_field]
        return Prompt(
            text=c.prompt_template.replace("{prompt}", text),
            answer=answer_text(row.ground_truth),
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

    @staticmethod
    def _input(prompt: Prompt, response_text: str) -> RewardInput:
        row: Row = prompt.metadata["row"]
        return RewardInput(
            response=response_text,
            answer=prompt.answer,
            ground_truth=row.ground_truth,
            data_source=row.data_source,
            extra_info=row.extra_info,
            record=row.record,
            where=row.where,
        )

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """The user function's value, as a float; a raise, a non-number or a non-finite value is a
        :class:`RewardError` naming the record."""
        return self.reward_fn.one(self._input(prompt, response_text))

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        """The values of a rollout batch: one call of a batched reward_fn, else one per row."""
        return self.reward_fn.many([self._input(p, r) for p, r in zip(prompts, responses, strict=True)])

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
