"""Benchmark commands (run as ``python -m benchmarks.NAME``); results in benchmarks/results/."""
