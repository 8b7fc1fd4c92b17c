"""The routing-noise study: designs (a) to (d), the noise calibration, the kernel checks (README.md)."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
"This study's result files (JSON + PNG by machine, preset and commit; INDEX.md lists them)."
