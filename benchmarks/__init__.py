"""Performance benchmarks (``python -m benchmarks.NAME``), each against its committed baseline
(baselines.yaml, ``python -m benchmarks.check``); results in benchmarks/results/."""
