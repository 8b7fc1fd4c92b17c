"""Configuration of the verifiable tasks: one frozen, keyword-only dataclass per task.

The :class:`moe_rl.config.Recipe` composes :class:`TaskConfig` as its ``task`` section; the
tasks themselves (``moe_rl.tasks``) read it. Only ``moe_rl.configlib`` and ``moe_rl.names`` are
imported here, so the tasks never import the recipe module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moe_rl.configlib import check_choices, check_text, require, require_registered, require_seed
from moe_rl.names import TASK_NAMES


@dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """Multi-step integer arithmetic with a written-out scratchpad."""

    min_operands: int = 2
    "Fewest operands in a question (steps = operands - 1)."
    max_operands: int = 4
    "Most operands in a question; the response grows by about 10 characters per operand."
    digits: int = 2
    "Operands are drawn uniformly from 0 .. 10**digits - 1."
    operators: str = "+-"
    "Operators to draw from, a subset of '+-*' (multiplication binds tighter, as usual)."
    scratchpad: bool = True
    "Demonstrations write every intermediate step before the answer (false: only 'A:<n>')."

    def __post_init__(self) -> None:
        check_choices(self, "task.arithmetic")
        require(self.min_operands >= 2, f"task.arithmetic.min_operands must be >= 2, got {self.min_operands}")
        require(
            self.max_operands >= self.min_operands,
            f"task.arithmetic.max_operands={self.max_operands} is below task.arithmetic.min_operands="
            f"{self.min_operands}: raise max_operands or lower min_operands",
        )
        require(
            self.max_operands <= 64, f"task.arithmetic.max_operands must be <= 64, got {self.max_operands}"
        )
        require(1 <= self.digits <= 9, f"task.arithmetic.digits must be in 1..9, got {self.digits}")
        require(
            bool(self.operators) and set(self.operators) <= set("+-*"),
            f"task.arithmetic.operators={self.operators!r}: use a non-empty subset of '+-*'",
        )
        check_text(self, "task.arithmetic")


@dataclass(frozen=True, kw_only=True)
class CountdownConfig:
    """Reach a target from given numbers with + - * / and parentheses (each number at most once)."""

    num_numbers: int = 4
    "Numbers given in a question."
    max_number: int = 30
    "Given numbers are drawn uniformly from 1 .. max_number."
    max_target: int = 200
    "Targets lie in 1 .. max_target (built from a random expression, so always solvable)."
    operators: str = "+-*/"
    "Operators used to build targets and search traces, a subset of '+-*/'."
    use_all_numbers: bool = False
    "Targets are built from all the numbers, and a correct answer must use every one of them."
    max_failed_attempts: int = 2
    "Demonstrations show 0 .. this many failed tries before the solution (trace length)."

    def __post_init__(self) -> None:
        check_choices(self, "task.countdown")
        require(
            2 <= self.num_numbers <= 8, f"task.countdown.num_numbers must be in 2..8, got {self.num_numbers}"
        )
        require(self.max_number >= 2, f"task.countdown.max_number must be >= 2, got {self.max_number}")
        require(self.max_target >= 2, f"task.countdown.max_target must be >= 2, got {self.max_target}")
        require(
            bool(self.operators) and set(self.operators) <= set("+-*/"),
            f"task.countdown.operators={self.operators!r}: use a non-empty subset of '+-*/'",
        )
        require(
            "+" in self.operators or "*" in self.operators,
            f"task.countdown.operators={self.operators!r} cannot build targets: include '+' or '*'",
        )
        require(
            0 <= self.max_failed_attempts <= 16,
            f"task.countdown.max_failed_attempts must be in 0..16, got {self.max_failed_attempts}",
        )
        check_text(self, "task.countdown")


@dataclass(frozen=True, kw_only=True)
class JsonlConfig:
    """The user's own data: prompts and answers from a JSONL or parquet file (today's plain layout
    or verl's RL layout), scored by a user reward function (docs/design.md#your-own-data)."""

    path: str | None = None
    "JSONL file (one JSON object per line) or parquet file (*.parquet); required when task.name=jsonl."
    format: Literal["auto", "plain", "verl"] = "auto"
    """Layout of each file. plain: prompt_field and answer_field per record. verl: verl's RL layout
    (data_source, prompt, reward_model.ground_truth, extra_info; the answer is the ground truth).
    auto: verl when the file's first record (a parquet file: its columns) has a reward_model field,
    else plain."""
    prompt_field: str = "prompt"
    "Key of the prompt: a string, or a list of chat messages [{role, content}] (both layouts)."
    answer_field: str = "answer"
    "Key of the reference answer in the plain layout (any JSON value; strings kept, others JSON-encoded)."
    response_field: str | None = None
    "Key of a demonstration response for SFT (None: the task has no demonstrations)."
    reward_fn: str = "moe_rl.tasks.jsonl:exact_match"
    """module:function (or path/to/file.py:function): fn(response, answer, record) -> float, or
    verl's compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score": ...}."""
    reward_signature: Literal["auto", "plain", "verl"] = "auto"
    """How reward_fn takes its arguments (moe_rl.tasks.rewards.REWARD_SIGNATURES): plain
    (response, answer, record), verl (data_source=, solution_str=, ground_truth=, extra_info=), or
    auto: verl when the function has verl's parameter names, else plain."""
    reward_batched: bool = False
    """reward_fn takes lists and returns a list, called once per rollout batch: plain
    fn(responses, answers, records), verl compute_score(data_sources=, solution_strs=, ground_truths=,
    extra_infos=) (verl's BatchRewardManager)."""
    prompt_template: str = "{prompt}"
    "Prompt text given to the model; '{prompt}' is replaced by the prompt (chat messages: rendered)."
    heldout_path: str | None = None
    "JSONL or parquet file of held-out prompts (None: hold out task.heldout_fraction of path by prompt hash)."

    def __post_init__(self) -> None:
        check_choices(self, "task.jsonl")
        fn = self.reward_fn
        require(
            fn.count(":") >= 1 and all(fn.rpartition(":")[::2]),
            f"task.jsonl.reward_fn={fn!r}: write it as module:function, e.g. mypkg.rewards:score",
        )
        require(
            "{prompt}" in self.prompt_template,
            f"task.jsonl.prompt_template={self.prompt_template!r} must contain '{{prompt}}'",
        )
        for name in ("prompt_field", "answer_field"):
            require(bool(getattr(self, name)), f"task.jsonl.{name} must be a non-empty key")
        check_text(self, "task.jsonl")


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Which verifiable task to train on, its difficulty and length knobs, and its reward shape."""

    name: str = "arithmetic"
    "Task in moe_rl.tasks.TASKS (names in moe_rl.names.TASK_NAMES): arithmetic | countdown | jsonl."
    seed: int = 0
    "Seed of the training prompt stream (the trainer passes it to task.sample as rng_seed)."
    heldout_fraction: float = 0.05
    "Share of the prompt space (by prompt-text hash) reserved for held-out evaluation."
    format_reward: float = 0.0
    "Reward for a well-formed but wrong final answer (a correct one always scores 1.0)."
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    "Knobs of the arithmetic task."
    countdown: CountdownConfig = field(default_factory=CountdownConfig)
    "Knobs of the countdown task."
    jsonl: JsonlConfig = field(default_factory=JsonlConfig)
    "Knobs of the jsonl task."

    def __post_init__(self) -> None:
        check_choices(self, "task")
        require_registered(self.name, TASK_NAMES, "task.name")
        require_seed(self, "task", "seed")
        require(
            0.0 < self.heldout_fraction < 1.0,
            f"task.heldout_fraction={self.heldout_fraction} must be in (0, 1), e.g. 0.05",
        )
        require(
            0.0 <= self.format_reward < 1.0,
            f"task.format_reward={self.format_reward} must be in [0, 1) so a correct answer scores most",
        )
        require(
            self.name != "jsonl" or self.jsonl.path is not None,
            "task.name=jsonl needs task.jsonl.path: set it to a JSONL or parquet file of prompts and answers",
        )
        check_text(self, "task")
