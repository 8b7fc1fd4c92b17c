"""The fixed collapse criterion: when a run's reward curve counts as collapsed.

One definition for ``moe-rl demo``'s report and the studies (``studies/collapse/collapse.py``,
``studies/collapse/phase.py``, whose plan fixed these constants before any run); the trainer's in-run
sentinel applies the same step rule (:func:`moe_rl.trainer.sentinel.reward_drop`) to raw rewards.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from moe_rl.trainer.sentinel import reward_drop


# -- the collapse criterion (fixed before the runs) -----------------------------------------------
@dataclass(frozen=True)
class Criterion:
    """Constants of :func:`collapse_verdict`."""

    smooth: int = 5
    "Trailing mean over this many RL steps (full windows only) before anything is compared."
    drop_frac: float = 0.5
    "A run falls when its smoothed reward drops below this fraction of its best so far ..."
    window: int = 10
    "... and it has collapsed when it stays below for this many consecutive steps (no recovery)."
    min_best: float = 0.05
    "A run whose best smoothed reward never exceeds this was never good: it cannot collapse."


CRITERION = Criterion()
"The criterion every reported verdict uses; fixed in code before any run."


@dataclass(frozen=True)
class Verdict:
    """What :func:`collapse_verdict` found in one reward curve."""

    state: str
    "collapsed | fine | never_good | unresolved (below the threshold at the end, for < window steps)."
    step: int | None
    "First step (index into the curve) of the sustained drop; None unless collapsed or unresolved."
    best: float
    "Best smoothed reward."
    best_step: int | None
    "Step at which the best smoothed reward was reached (the last step of its window)."
    final: float
    "Smoothed reward at the last step."

    @property
    def collapsed(self) -> bool:
        return self.state == "collapsed"


def smoothed(xs: list[float], k: int) -> list[float]:
    """Trailing means over full windows: element i is the mean of ``xs[i : i + k]`` (step i + k - 1)."""
    return [sum(xs[i : i + k]) / k for i in range(len(xs) - k + 1)]


def collapse_verdict(rewards: list[float], c: Criterion = CRITERION) -> Verdict:
    """Did the run with per-step mean rewards ``rewards`` collapse?

    The curve is smoothed by a trailing mean over ``c.smooth`` steps (full windows only, so one
    lucky first batch cannot set the best). Step t *falls* when its smoothed reward is below
    ``c.drop_frac`` x the best smoothed reward up to t. The run has **collapsed** when it falls
    at some t and stays below that threshold for ``c.window`` consecutive smoothed steps
    (t .. t + window - 1), i.e. it did not recover within the window. A run whose best smoothed
    reward never exceeds ``c.min_best`` is **never_good** (nothing to collapse from); a run that
    falls and stays below until its last step, but for fewer than ``window`` steps, is
    **unresolved**; every other run is **fine**. Non-finite rewards count as 0. Steps in the
    verdict are indices into ``rewards`` (the last step of the smoothing window).
    """
    xs = [float(x) if x is not None and math.isfinite(float(x)) else 0.0 for x in rewards]
    s = smoothed(xs, c.smooth)
    if not s:
        return Verdict("never_good", None, math.nan, None, math.nan)
    off = c.smooth - 1
    best_i = max(range(len(s)), key=s.__getitem__)
    if s[best_i] <= c.min_best:
        return Verdict("never_good", None, s[best_i], best_i + off, s[-1])
    best, below, run_start = None, 0, None
    for t, v in enumerate(s):  # the sentinel's rule (reward_drop), over the smoothed curve
        best, below = reward_drop(best, below, v, drop_frac=c.drop_frac, min_best=c.min_best)
        run_start = t - below + 1 if below else None
        if below >= c.window:
            return Verdict("collapsed", run_start + off, s[best_i], best_i + off, s[-1])
    state = "unresolved" if run_start is not None else "fine"
    return Verdict(state, None if run_start is None else run_start + off, s[best_i], best_i + off, s[-1])


def criterion_doc(c: Criterion = CRITERION) -> dict:
    """The criterion as a result file records it: its constants, the rule in words, what else counts."""
    also = "runs the trainer stopped (repeated non-finite steps)"
    return {**asdict(c), "doc": collapse_verdict.__doc__.strip(), "also_collapsed": also}


def held_out_drop(evals: list[float], c: Criterion = CRITERION) -> bool:
    """Secondary check: final held-out greedy accuracy below ``drop_frac`` x the SFT start's."""
    if len(evals) < 2 or not evals[0] > c.min_best:
        return False
    return evals[-1] < c.drop_frac * evals[0]
