"""The ``moe-rl`` command: train | check | plan-free helpers. ``moe-rl -h`` lists them."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    import warnings

    warnings.filterwarnings("ignore", module="megatron")  # TE/Apex fallbacks are expected on CPU


def cmd_train(args) -> int:
    from moe_rl.config import load_recipe
    from moe_rl.trainer.run import run

    recipe = load_recipe(args.recipe, args.overrides)
    t0 = time.perf_counter()
    results = run(recipe, resume=args.resume)
    logging.getLogger("moe_rl").info("done in %.1fs: %s", time.perf_counter() - t0,
                                     json.dumps({k: {m: round(v, 4) for m, v in d.items()
                                                     if isinstance(v, float)} for k, d in results.items()}))
    return 0


def cmd_check(args) -> int:
    """Load and validate a recipe without starting anything; print it resolved."""
    import yaml

    from moe_rl.config import load_recipe, to_dict

    recipe = load_recipe(args.recipe, args.overrides)
    print(yaml.safe_dump(to_dict(recipe), sort_keys=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-rl", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="run a recipe's stages (sft, rl)")
    t.add_argument("recipe")
    t.add_argument("overrides", nargs="*", help="section.field=value")
    t.add_argument("--resume", action="store_true", help="continue from the run's newest checkpoint")
    t.set_defaults(fn=cmd_train)
    c = sub.add_parser("check", help="validate a recipe and print it resolved")
    c.add_argument("recipe")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=cmd_check)
    return p


def main(argv: list[str] | None = None) -> int:
    from moe_rl.config import ConfigError

    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"moe-rl: configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
