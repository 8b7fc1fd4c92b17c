"""Verifiable tasks (prompts, rewards, SFT demonstrations, held-out prompts) and tokenizers.

``TASKS`` maps a task name to its class; :func:`build_task` builds the one a
:class:`TaskConfig` names (the task configs live in ``moe_rl.tasks.config``). Every task
follows the :class:`Task` protocol.
"""

from __future__ import annotations

from moe_rl.configlib import require_registered
from moe_rl.tasks.arithmetic import ArithmeticTask
from moe_rl.tasks.base import Prompt, Task, batch_rewards
from moe_rl.tasks.config import ArithmeticConfig, CountdownConfig, JsonlConfig, TaskConfig
from moe_rl.tasks.countdown import CountdownTask
from moe_rl.tasks.jsonl import JsonlTask
from moe_rl.tasks.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

TASKS: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "jsonl": JsonlTask,
}


def build_task(cfg: TaskConfig, tokenizer: Tokenizer | None = None) -> Task:
    """The task ``cfg.name`` names, built from ``cfg``; an unknown name lists the valid ones. A task
    class with ``uses_tokenizer`` also gets ``tokenizer`` (the jsonl task renders chat prompts with it)."""
    require_registered(cfg.name, TASKS, "task.name")
    cls = TASKS[cfg.name]
    return cls(cfg, tokenizer=tokenizer) if getattr(cls, "uses_tokenizer", False) else cls(cfg)


__all__ = [
    "TASKS",
    "ArithmeticConfig",
    "CharTokenizer",
    "CountdownConfig",
    "HFTokenizer",
    "JsonlConfig",
    "Prompt",
    "Task",
    "TaskConfig",
    "Tokenizer",
    "batch_rewards",
    "build_task",
    "load_tokenizer",
]
