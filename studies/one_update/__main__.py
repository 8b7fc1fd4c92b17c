"""``python -m studies.one_update``: design (e)'s command line (studies/one_update/driver.py says what
each mode does)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from moe_rl.argparsing import ArgParser, one_line_errors
from studies.one_update import driver, gpu


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m studies.one_update", description=driver.__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write-plan", action="store_true", help="write the pre-registration, then stop")
    mode.add_argument("--calibrate", action="store_true", help="calibrate the engine's routing noise")
    mode.add_argument("--states", action="store_true", help="make the states (no scoring), then stop")
    mode.add_argument("--report", action="store_true", help="analyse what is scored")
    mode.add_argument(
        "--gpu-arm", metavar="START", help="the GPU arm (gpu.py) from the SFT start START, into --root"
    )
    p.add_argument(
        "--smoke", action="store_true", help="a tiny size: the whole study, or the GPU arm one state"
    )
    p.add_argument("--root", type=Path, default=None, help=f"runs folder (default {driver.ROOT})")
    p.add_argument(
        "--out", type=Path, default=None, help="result file (default: studies/one_update/results/)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the trainer runs")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the trainer's dtype")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    p.add_argument("--budget-s", type=float, default=540.0, help="--gpu-arm: its whole budget (default 540)")
    p.add_argument(
        "--gpu-states", type=int, default=30, help="--gpu-arm: states to score at most (default 30)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks with errors")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    return one_line_errors(lambda: (gpu.command if args.gpu_arm else driver.command)(args), args.verbose)


if __name__ == "__main__":
    sys.exit(main())
