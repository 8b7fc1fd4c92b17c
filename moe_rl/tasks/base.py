"""The Prompt record, the Task protocol, and the shared synthetic-task machinery.

Determinism: every random draw comes from a ``random.Random`` seeded by a blake2b hash of
the draw's coordinates (task, stream, seed, step, index), never from global state, so
``sample(step, batch_size, rng_seed)`` is identical across calls, processes and
algorithms, and item ``i`` of a batch does not depend on the batch size.

Held-out split: a prompt is held out when a blake2b hash of its text falls in the first
``heldout_fraction`` of the hash range. Training draws reject such prompts and held-out
draws accept only them, so the two sets are disjoint by construction, for any seed.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Protocol

from moe_rl.configlib import ConfigError
from moe_rl.tasks.config import TaskConfig


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One question: the text the model continues, the reference answer, and task metadata."""

    text: str
    "Prompt text given to the model (encode it, generate the response after it)."
    answer: str
    "Reference final answer (countdown: one valid expression; any valid one is rewarded)."
    metadata: dict = field(default_factory=dict, compare=False)
    "Task-specific data the reward and the demonstrations need (operands, numbers, record)."


class Task(Protocol):
    """A verifiable task. Demonstration responses do not contain the EOS token: append it."""

    name: str

    def sample(self, step: int, batch_size: int, rng_seed: int) -> list[Prompt]:
        """Training prompts of ``step``, a pure function of (config, rng_seed, step)."""
        ...

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """1.0 for a correct final answer, task.format_reward for a well-formed wrong one, else 0."""
        ...

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``n`` (prompt_text, response_text) pairs for SFT, drawn from the training split."""
        ...

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` held-out prompts (distinct; never returned by sample or demonstrations)."""
        ...

    def longest_prompts(self) -> list[str]:
        """Prompt texts at least as long as any the task asks (checked against model.max_seq_len)."""
        ...


def batch_rewards(task: Task, prompts: list[Prompt], responses: list[str]) -> list[float]:
    """The rewards of a rollout batch (``responses[i]`` answers ``prompts[i]``): the task's
    ``rewards`` in one call where it has one (the jsonl task: a batched reward function is called
    once), else ``reward`` per row."""
    many = getattr(task, "rewards", None)
    if many is not None:
        return list(many(prompts, responses))
    return [task.reward(p, r) for p, r in zip(prompts, responses, strict=True)]


# ---------------------------------------------------------------------------------------
# Shared machinery.

_HASH_BUCKETS = 1_000_000


def make_rng(*coords: object) -> random.Random:
    """A ``random.Random`` seeded by a hash of ``coords`` (ints and strings): no global state."""
    digest = hashlib.blake2b(repr(coords).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def is_heldout(text: str, fraction: float) -> bool:
    """Whether a prompt text belongs to the held-out split (hash of the text, not of any seed)."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, person=b"heldout").digest(), "little")
    return h % _HASH_BUCKETS < fraction * _HASH_BUCKETS


class SyntheticTask:
    """Sampling, demonstrations and the held-out split for tasks that generate their prompts.

    Subclasses implement ``generate(rng) -> Prompt``, ``reference_response(prompt, seed)``
    and ``reward``.
    """

    name = "synthetic"
    max_draws_per_prompt = 10_000
    "Rejection-sampling budget per prompt before the configuration is declared too small."
    max_heldout_repeats = 1000
    "Consecutive repeated held-out prompts after which the held-out space counts as exhausted."

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg

    def generate(self, rng: random.Random) -> Prompt:  # pragma: no cover - abstract
        raise NotImplementedError

    def reference_response(self, prompt: Prompt, seed: int = 0) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _draw(self, rng: random.Random, heldout: bool) -> Prompt:
        for _ in range(self.max_draws_per_prompt):
            p = self.generate(rng)
            if is_heldout(p.text, self.cfg.heldout_fraction) == heldout:
                return p
        split = "held-out" if heldout else "training"
        raise ConfigError(
            f"task {self.name}: no {split} prompt in {self.max_draws_per_prompt} draws; the prompt space "
            "is too small: raise the difficulty knobs (digits, operands, numbers) or task.heldout_fraction"
        )

    def sample(self, step: int, batch_size: int, rng_seed: int) -> list[Prompt]:
        """Training prompts of ``step``; item i depends only on (config, rng_seed, step, i)."""
        return [self._draw(make_rng(self.name, "train", rng_seed, step, i), False) for i in range(batch_size)]

    def demonstration_prompts(self, n: int, seed: int) -> list[tuple[Prompt, str]]:
        """Like :meth:`demonstrations`, with the :class:`Prompt` (for rewards and metadata)."""
        out = []
        for i in range(n):
            p = self._draw(make_rng(self.name, "demo", seed, i), False)
            trace_seed = make_rng(self.name, "trace", seed, i).getrandbits(32)
            out.append((p, self.reference_response(p, seed=trace_seed)))
        return out

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``n`` training-split prompts with reference responses (search traces where the task has them)."""
        return [(p.text, r) for p, r in self.demonstration_prompts(n, seed)]

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` distinct held-out prompts of one fixed stream (a prefix for smaller n)."""
        out: list[Prompt] = []
        seen: set[str] = set()
        rng = make_rng(self.name, "heldout")
        misses = 0
        while len(out) < n:
            p = self._draw(rng, True)
            if p.text in seen:
                misses += 1
                if misses > self.max_heldout_repeats:
                    raise ConfigError(
                        f"task {self.name}: only {len(out)} distinct held-out prompts exist (asked for {n}): "
                        "raise the difficulty knobs or task.heldout_fraction, or ask for fewer"
                    )
                continue
            seen.add(p.text)
            out.append(p)
            misses = 0
        return out
