"""Alias of :mod:`moe_rl.serve.embedded`, the default of ``rollout.sglang_module`` in older configs."""

from __future__ import annotations

import sys

from moe_rl.serve.embedded import build_engine, main

__all__ = ["build_engine", "main"]

if __name__ == "__main__":
    sys.exit(main())
