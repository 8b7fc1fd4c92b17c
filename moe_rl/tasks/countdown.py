"""Countdown: combine the given numbers with + - * / and parentheses to reach a target.

Prompt ``N:3,7,25,50 T:96\n``. A reference response is a search trace: a few failed tries
(``a op b=c`` steps, then ``no``), the solution steps, and the answer expression::

    25+7=32,32+50=82 no
    25+7=32,32*3=96
    A:(25+7)*3

Targets are built from a random expression over the numbers, so every question is
solvable. The reward parses the expression after the first ``A:`` with a small
recursive-descent parser (never ``eval``) over integers, ``+ - * /`` and parentheses,
evaluates it exactly with fractions, and checks that every literal is one of the given
numbers, each used at most as often as it is given (all of them with ``use_all_numbers``).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

from moe_rl.tasks.base import Prompt, SyntheticTask

_ANSWER_RE = re.compile(r"A:([0-9+\-*/() \t]*)")
_TOKEN_RE = re.compile(r"[ \t]*(?:([0-9]+)|([-+*/()]))")
MAX_EXPRESSION_CHARS = 256
"Longer answers are rejected as malformed (bounds the parser's work and recursion)."


class ExpressionError(ValueError):
    """The answer is not a well-formed expression, or divides by zero."""


def _tokenize(text: str) -> list[str]:
    toks, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            raise ExpressionError(f"unexpected character {text[pos]!r} at {pos}")
        num = m.group(1)
        if num is not None and len(num) > 1 and num[0] == "0":
            raise ExpressionError(f"number {num} has a leading zero")
        toks.append(num if num is not None else m.group(2))
        pos = m.end()
    return toks


class _Parser:
    """expr := term (('+'|'-') term)* ; term := atom (('*'|'/') atom)* ; atom := INT | '(' expr ')'."""

    def __init__(self, toks: list[str]) -> None:
        self.toks, self.i, self.literals = toks, 0, []

    def _peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def expr(self) -> Fraction:
        v = self.term()
        while self._peek() in ("+", "-"):
            op = self.toks[self.i]
            self.i += 1
            w = self.term()
            v = v + w if op == "+" else v - w
        return v

    def term(self) -> Fraction:
        v = self.atom()
        while self._peek() in ("*", "/"):
            op = self.toks[self.i]
            self.i += 1
            w = self.atom()
            if op == "/" and w == 0:
                raise ExpressionError("division by zero")
            v = v * w if op == "*" else v / w
        return v

    def atom(self) -> Fraction:
        t = self._peek()
        self.i += 1
        if t is None:
            raise ExpressionError("expression ends early")
        if t.isdigit():
            self.literals.append(int(t))
            return Fraction(int(t))
        if t == "(":
            v = self.expr()
            if self._peek() != ")":
                raise ExpressionError("missing ')'")
            self.i += 1
            return v
        raise ExpressionError(f"unexpected {t!r}")


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """Exact value of an integer expression and the integer literals it uses, in order.

    Raises :class:`ExpressionError` for anything but integers, ``+ - * /`` and balanced
    parentheses (no unary minus), for leading zeros, for division by zero, and for
    expressions over :data:`MAX_EXPRESSION_CHARS` characters.
    """
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    toks = _tokenize(text)
    if not toks:
        raise ExpressionError("empty expression")
    p = _Parser(toks)
    value = p.expr()
    if p.i != len(toks):
        raise ExpressionError(f"unexpected {toks[p.i]!r} after a complete expression")
    return value, p.literals


def check_expression(text: str, numbers: list[int], target: int, *, use_all: bool = False) -> str | None:
    """None when ``text`` reaches ``target`` with the given numbers; otherwise the reason it fails."""
    try:
        value, used = evaluate(text)
    except ExpressionError as e:
        return f"malformed: {e}"
    have, want = Counter(numbers), Counter(used)
    for n, k in want.items():
        if n not in have:
            return f"uses {n}, which is not a given number"
        if k > have[n]:
            return f"uses {n} {k} times but it is given {have[n]} time(s)"
    if use_all and want != have:
        return "does not use every given number"
    if value != target:
        return f"evaluates to {value}, not {target}"
    return None


def _combine(rng: random.Random, pool: list, ops: str) -> tuple:
    """Combine two random pool items (value, expr, is_leaf) with a random valid operator, in place."""
    i, j = rng.sample(range(len(pool)), 2)
    (a, ea, la), (b, eb, lb) = sorted((pool[i], pool[j]), key=lambda t: -t[0])  # a >= b
    valid = [op for op in ops if op in "+*" or (op == "-" and a > b) or (op == "/" and b > 1 and a % b == 0)]
    op = rng.choice(valid)
    c = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
    expr = f"{ea if la else f'({ea})'}{op}{eb if lb else f'({eb})'}"
    for k in sorted((i, j), reverse=True):
        del pool[k]
    pool.append((c, expr, False))
    return a, op, b, c


def _steps_text(steps: list[tuple]) -> str:
    return ",".join(f"{a}{op}{b}={c}" for a, op, b, c in steps)


class CountdownTask(SyntheticTask):
    """See the module docstring; knobs in :class:`moe_rl.tasks.config.CountdownConfig`."""

    name = "countdown"

    def generate(self, rng: random.Random) -> Prompt:
        c = self.cfg.countdown
        for _ in range(1000):
            numbers = [rng.randint(1, c.max_number) for _ in range(c.num_numbers)]
            k = c.num_numbers if c.use_all_numbers else rng.randint(2, c.num_numbers)
            pool = [(n, str(n), True) for n in rng.sample(numbers, k)]
            steps = [_combine(rng, pool, c.operators) for _ in range(k - 1)]
            target, expr, _ = pool[0]
            if 1 <= target <= c.max_target and target not in numbers:
                return Prompt(
                    text=f"N:{','.join(map(str, numbers))} T:{target}\n",
                    answer=expr,
                    metadata={"numbers": numbers, "target": target, "steps": steps},
                )
        raise RuntimeError(  # pragma: no cover - reachable only with extreme knobs
            "countdown: no target in 1..task.countdown.max_target after 1000 tries: raise max_target"
        )

    def longest_prompts(self) -> list[str]:
        """The longest prompt text this task asks: every number and the target at their largest."""
        c = self.cfg.countdown
        return [f"N:{','.join([str(c.max_number)] * c.num_numbers)} T:{c.max_target}\n"]

    def reference_response(self, prompt: Prompt, seed: int = 0) -> str:
        """Failed tries (0 .. max_failed_attempts, drawn from ``seed``), the solution, the answer."""
        c, meta = self.cfg.countdown, prompt.metadata
        rng = random.Random(seed)
        lines = []
        for _ in range(rng.randint(0, c.max_failed_attempts)):
            pool = [(n, str(n), True) for n in meta["numbers"]]
            steps = [_combine(rng, pool, c.operators) for _ in range(rng.randint(1, len(pool) - 1))]
            if all(s[3] != meta["target"] for s in steps):
                lines.append(_steps_text(steps) + " no")
        lines.append(_steps_text(meta["steps"]))
        lines.append(f"A:{prompt.answer}")
        return "\n".join(lines)

    def reward(self, prompt: Prompt, response_text: str) -> float:
        m = _ANSWER_RE.search(response_text)
        if m is None:
            return 0.0
        meta = self.cfg.countdown
        why = check_expression(
            m.group(1), prompt.metadata["numbers"], prompt.metadata["target"], use_all=meta.use_all_numbers
        )
        if why is None:
            return 1.0
        return 0.0 if why.startswith("malformed") else self.cfg.format_reward
