"""Multi-step integer arithmetic with a written-out scratchpad.

Prompt ``Q:37+58*2-19=``; reference response ``58*2=116;37+116=153;153-19=134;A:134``:
one ``a op b=c`` step per operator (multiplication first, then left to right), then the
final answer after ``A:``. The reward reads the first ``A:<integer>`` in the response;
anything after that integer is ignored.
"""

from __future__ import annotations

import random
import re

from moe_rl.tasks.base import Prompt, SyntheticTask

_ANSWER_RE = re.compile(r"A:\s*(-?\d+)")


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def solve_steps(operands: list[int], operators: list[str]) -> list[tuple[int, str, int, int]]:
    """Evaluation steps ``(a, op, b, result)``: '*' first (left to right), then '+'/'-' left to right."""
    vals, ops, steps = list(operands), list(operators), []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, op, b = vals[i], ops[i], vals[i + 1]
        c = _apply(a, op, b)
        steps.append((a, op, b, c))
        vals[i : i + 2] = [c]
        del ops[i]
    return steps


def parse_answer(response_text: str) -> int | None:
    """The integer after the first ``A:`` in the response, or None when there is none."""
    m = _ANSWER_RE.search(response_text)
    return int(m.group(1)) if m else None


class ArithmeticTask(SyntheticTask):
    """See the module docstring; knobs in :class:`moe_rl.tasks.config.ArithmeticConfig`."""

    name = "arithmetic"

    def generate(self, rng: random.Random) -> Prompt:
        c = self.cfg.arithmetic
        k = rng.randint(c.min_operands, c.max_operands)
        operands = [rng.randrange(10**c.digits) for _ in range(k)]
        operators = [rng.choice(c.operators) for _ in range(k - 1)]
        expr = str(operands[0]) + "".join(op + str(x) for op, x in zip(operators, operands[1:]))
        answer = solve_steps(operands, operators)[-1][3]
        return Prompt(
            text=f"Q:{expr}=",
            answer=str(answer),
            metadata={"operands": operands, "operators": operators},
        )

    def longest_prompts(self) -> list[str]:
        """The longest prompt texts this task asks: the most operands, each of the most digits."""
        c = self.cfg.arithmetic
        return [f"Q:{op.join([str(10**c.digits - 1)] * c.max_operands)}=" for op in c.operators]

    def reference_response(self, prompt: Prompt, seed: int = 0) -> str:
        """The scratchpad and answer (deterministic: ``seed`` is unused)."""
        steps = solve_steps(prompt.metadata["operands"], prompt.metadata["operators"])
        lines = [f"{a}{op}{b}={c}" for a, op, b, c in steps] if self.cfg.arithmetic.scratchpad else []
        return ";".join([*lines, f"A:{prompt.answer}"])

    def reward(self, prompt: Prompt, response_text: str) -> float:
        got = parse_answer(response_text)
        if got is None:
            return 0.0
        return 1.0 if str(got) == prompt.answer else self.cfg.format_reward
