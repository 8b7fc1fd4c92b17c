"""Small statistics the experiments share: means over what was measured, least-squares fits."""

from __future__ import annotations

import math


def mean(xs) -> float:
    """Mean of the finite numbers in ``xs`` (nan when there are none)."""
    v = [float(x) for x in xs if x is not None and x == x and abs(float(x)) != math.inf]
    return sum(v) / len(v) if v else math.nan


def lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """The least-squares solution ``c`` of ``rows @ c = ys`` (e.g. ``[1, log x]`` rows: a power law)."""
    import numpy as np

    sol, *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(ys, dtype=float), rcond=None)
    return [float(x) for x in sol]
