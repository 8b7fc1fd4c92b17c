"""Studies: one folder per study (plan, driver, analysis, doc with the verdict first, tests, results).
A study imports ``moe_rl``; nothing in ``moe_rl`` imports a study (tests/unit/test_layering.py)."""
