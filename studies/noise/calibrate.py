"""Calibrate routing noise at identical weights (moe_rl.lab.calibration): per-router, per-slot and
any-layer two-pass disagreement and k3 for each sigma, against the R3 paper's figures.

    python -m studies.noise.calibrate recipes/demo/closest.yaml [--sigmas 0,0.01,0.03,0.05,0.1]
        [--prompts 16] [--preset closest] [overrides ...]

Writes studies/noise/results/calibrate-<machine>-<preset>-<commit>.json + .png (``headline``: the
table, the smallest sigma reaching R3's 10% per router and the Megatron two-pass KL).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from moe_rl.argparsing import ArgParser, one_line_errors
from moe_rl.lab.calibration import DEFAULT_SIGMAS, calibrate, format_rows, plot
from moe_rl.lab.results import machine, result_path, write_json
from studies.noise import RESULTS


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m studies.noise.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "recipe", type=Path, help="the recipe whose start is calibrated (e.g. recipes/demo/closest.yaml)"
    )
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--sigmas", default=",".join(map(str, DEFAULT_SIGMAS)), help="comma-separated sigmas")
    p.add_argument("--prompts", type=int, default=16, help="prompts sampled (x train.group_size rollouts)")
    p.add_argument("--preset", default="closest", help="name of the preset in the result file name")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks with errors")
    args = p.parse_intermixed_args(argv)
    sigmas = [float(x) for x in args.sigmas.split(",") if x.strip()]
    if not sigmas or any(not math.isfinite(x) or x < 0 for x in sigmas):
        p.error(f"--sigmas {args.sigmas!r}: give finite numbers >= 0, e.g. 0,0.03,0.05")
    if args.prompts < 1:
        p.error(f"--prompts {args.prompts} must be >= 1")
    return one_line_errors(lambda: _calibrate(args, sigmas), args.verbose)


def _calibrate(args, sigmas: list[float]) -> int:
    from moe_rl.config import load_recipe
    from moe_rl.lab.runner import ensure_parallel

    recipe = load_recipe(args.recipe, [*args.overrides, "train.flip_probe_sequences=0"])
    ensure_parallel()
    t0 = time.perf_counter()
    table = calibrate(recipe, sigmas, args.prompts)
    print(format_rows(table["rows"]))
    print(
        f"R3's 10% per router from sigma={table['reaches_r3']}; KL 8e-4 from sigma={table['reaches_megatron_kl']}"
    )
    out = result_path("calibrate", args.preset, folder=RESULTS)
    png = out.with_suffix(".png")
    plot(table["rows"], png)
    write_json(
        out,
        {
            "bench": "calibrate",
            "machine": machine(),
            "recipe": str(args.recipe),
            "overrides": args.overrides,
            "wall_s": time.perf_counter() - t0,
            "headline": {
                "sigma_reaching_r3_per_router": table["reaches_r3"],
                "sigma_reaching_megatron_two_pass_kl": table["reaches_megatron_kl"],
                "start_entropy_per_token": table["rows"][0]["entropy"],
                "table": table["rows"],
            },
            **table,
            "plot": png.name,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
