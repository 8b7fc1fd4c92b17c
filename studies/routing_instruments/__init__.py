"""Issue 3's routing instruments on the tiny policy (README.md)."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
"This study's result files (JSON + PNG by machine, preset and commit; INDEX.md lists them)."
