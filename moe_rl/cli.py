"""The ``moe-rl`` command: train | check | serve | plan | export | bench | demo | compare | report. ``moe-rl -h``
lists them."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from moe_rl.argparsing import ArgParser, number_in, one_line_errors, text_value
from moe_rl.detected import detected
from moe_rl.errors import PathError, StopRequested, UserError, disk_full_at, is_disk_full
from moe_rl.lab.report import report
from moe_rl.lab.runner import forwarding_signals
from moe_rl.outputs import check_export_target
from moe_rl.quiet import quiet_dependencies
from moe_rl.serve.embedded import main as serve_main


def _setup_logging(verbose: bool) -> None:
    """Log lines as ``HH:MM:SS LEVEL name: message`` (DEBUG with ``-v``); megatron-core's loggers at
    WARNING and the dependencies' warnings no user caused off (:mod:`moe_rl.quiet`), unless
    ``verbose`` (then INFO, and every warning). Under
    torchrun or Slurm (``WORLD_SIZE`` > 1) each line names its rank, and ranks other than 0 log
    warnings and errors only, unless ``verbose``: one progress line per step, not one per rank."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1") or 1), os.environ.get("RANK", "0")
    where = f"[rank {rank}] " if world > 1 else ""
    quiet_rank = world > 1 and rank != "0" and not verbose
    logging.basicConfig(
        level=logging.WARNING if quiet_rank else logging.DEBUG if verbose else logging.INFO,
        format=f"%(asctime)s {where}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("moe_rl.rank").setLevel(logging.INFO)  # each rank's one start line
    quiet_dependencies(verbose)  # megatron-core's INFO lines and the warnings it causes: -v shows them


SUMMARY_KEYS: dict[str, tuple[str, ...]] = {
    "sft": ("loss", "grad_norm", "step_s"),
    "rl": (
        "reward/mean",
        "reward/accuracy",
        "eval/accuracy",
        "response/len_mean",
        "entropy/mean",
        "flip/step/rate",
        "flip/drift/rate",
        "clip/token_frac",
        "mismatch/k3",
        "experts/load_imbalance",
        "grad_norm",
        "time/step",
    ),
}
"The metrics ``moe-rl train`` prints at the end, per stage (every metric is in metrics.jsonl)."
SUMMARY_PERCENT = ("reward/accuracy", "eval/accuracy", "flip/step/rate", "flip/drift/rate", "clip/token_frac")
"The rates among them: shown in percent with a % sign (metrics.jsonl keeps the fractions)."


def summary_table(results: dict[str, dict[str, float]], seconds: float, out_dir: str) -> str:
    """The final summary of ``moe-rl train``: a line with the wall time and where every metric is,
    then a ``stage  metric  last`` table of the :data:`SUMMARY_KEYS` each stage logged, at its last
    step (RL's ``eval/accuracy``: the final evaluation; rates in percent, :data:`SUMMARY_PERCENT`)."""
    table = [
        (stage, key, float(metrics[key]))
        for stage, metrics in results.items()
        for key in SUMMARY_KEYS.get(stage, ())
        if isinstance(metrics.get(key), (int, float))
    ]
    head = f"done in {seconds:.1f}s; every metric: {out_dir}/metrics.jsonl"
    if not table:
        return head
    width = max(len("metric"), *(len(key) for _, key, _ in table))
    out, shown = [head, f"{'stage':<5}  {'metric':<{width}}  last"], set()
    for stage, key, v in table:
        value = f"{v:.2%}" if key in SUMMARY_PERCENT else f"{v:.4g}"
        out.append(f"{'' if stage in shown else stage:<5}  {key:<{width}}  {value}")
        shown.add(stage)
    return "\n".join(out)


def cmd_train(args) -> int:
    from moe_rl.config import load_recipe
    from moe_rl.preflight import preflight
    from moe_rl.trainer.run import run

    recipe = load_recipe(args.recipe, args.overrides)
    preflight(recipe)  # data, lengths, held-out split: refused before any process group starts
    t0 = time.perf_counter()
    # a stop signal after a step: a clean save and 128 + the signal (trainer/signals.py, one_line_errors)
    results = run(recipe, resume=args.resume, fresh=args.fresh)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 prints it
        print(summary_table(results, time.perf_counter() - t0, recipe.train.out_dir), flush=True)
    return 0


def cmd_check(args) -> int:
    """Load and validate a recipe (and its task's data) without starting anything; print it resolved,
    then what it detected (the model, tokenizer, data layout, reward signature, run) as YAML comments."""
    import yaml

    from moe_rl.config import load_recipe, to_dict
    from moe_rl.preflight import check_hf_path, preflight

    recipe = load_recipe(args.recipe, args.overrides)
    tokenizer = recipe.model.tokenizer
    check_hf_path(recipe)  # the folder it starts from: here, with config.json and weights
    tok = task = None
    if tokenizer == "char" or Path(tokenizer).is_dir():
        tok, task = preflight(recipe)
    else:  # a cluster recipe checked on another machine: its fields are checked, its data cannot be
        logging.getLogger("moe_rl").warning(
            "model.tokenizer=%s is not here: the task's data, prompt lengths and held-out split are "
            "checked by moe-rl train, not now",
            tokenizer,
        )
    print(yaml.safe_dump(to_dict(recipe), sort_keys=False))
    print("# detected:\n" + "\n".join(f"#   {line}" for line in detected(recipe, tok, task)))
    return 0


def cmd_demo(args) -> int:
    """``moe-rl compare`` with the demo's arms (DEMO_ARMS) on its recipe."""
    from moe_rl.lab.arms import DEMO_ARMS
    from moe_rl.lab.compare import STATUS_EVERY

    args.arms, args.status_every = ",".join(DEMO_ARMS), str(STATUS_EVERY)
    return cmd_compare(args)


def compare_parser() -> argparse.ArgumentParser:
    """``moe-rl compare``'s own parser: options and overrides in any order (parse_intermixed_args)."""
    p = ArgParser(
        prog="moe-rl compare",
        description="Arms of the arm table side by side on RECIPE, N seeds each, from one SFT start "
        "(trained once when the recipe has an sft stage); live progress; a seed-paired table "
        "(compare.csv / .md / .json) and compare.png in --out. Rerunning the command skips the "
        "runs that finished and continues the stopped ones.",
    )
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="section.field=value, for every run (and the SFT start)")
    p.add_argument(
        "--arms",
        default="GRPO,GRPO+R3,GSPO",
        help="comma-separated arms of moe_rl/lab/arms.py ARMS: GRPO, GRPO+R2, GRPO+R3, GRPO+TIS, GSPO, "
        "GSPO+R2 (default: %(default)s); the first is the one the others are compared with",
    )
    p.add_argument(
        "--seeds",
        default="1",
        help="seeds (paired replicates) of every arm: a count N (seeds 0..N-1) or the seeds themselves, "
        "comma-separated: 9001,9002,9003 (one alone: 9001,) (default: 1)",
    )
    p.add_argument(
        "--jobs",
        default=None,
        help="runs at a time (default: one per arm; 1: one after another, in this process)",
    )
    p.add_argument(
        "--out",
        default=None,
        type=text_value,
        help="where the runs and the results go (default: the recipe's train.out_dir)",
    )
    p.add_argument("--status-every", default="20", help="seconds between status lines (default: 20)")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="train again the runs of --out whose recipe differs from this one (refused otherwise), "
        "beside what they hold: their checkpoints and metrics rows are kept",
    )
    return p


def cmd_compare(args) -> int:
    from moe_rl.lab.compare import parse_arms, parse_count, parse_seeds, run_compare

    if not Path(args.recipe).is_file():
        raise PathError(
            f"compare recipe {args.recipe} is not a file: give a recipe such as recipes/compare_tiny.yaml"
        )
    arms = parse_arms(args.arms)
    seeds = parse_seeds(args.seeds)
    jobs = None if args.jobs is None else parse_count(args.jobs, "--jobs", "how many runs train at a time")
    try:
        every = number_in(0.0)(str(args.status_every))
    except argparse.ArgumentTypeError:
        raise UserError(f"--status-every {args.status_every!r}: give a number of seconds > 0") from None
    # a stop signal: every run saved, then 128 + the signal (StopRequested, one_line_errors)
    done = run_compare(
        args.recipe,
        args.overrides,
        arms=arms,
        seeds=seeds,
        jobs=jobs,
        out=args.out,
        status_every=every,
        fresh=args.fresh,
    )
    files = done["files"]
    print(f"\n{done['table']}\n")
    print(
        f"{done['wall_s']:.0f}s; table: {files['md']}, {files['csv']}, {files['json']}; picture: {files['png']}"
    )
    if done["failed"]:
        names = ", ".join(f"{j.label} ({j.log_file})" for j in done["failed"])
        print(
            f"moe-rl: {len(done['failed'])} run(s) failed: {names}; the same command retries them",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_report(args) -> int:

    bad = [r for r in args.runs if r.startswith("=") or r.endswith("=")]
    if bad:
        raise UserError(f"run {bad[0]!r}: write NAME=DIR or DIR")
    named = [r.split("=", 1) if "=" in r else (r.rstrip("/").split("/")[-1], r) for r in args.runs]
    seen: dict[str, str] = {}
    for name, run in named:
        if name in seen:
            raise UserError(
                f"two runs are named {name!r} ({seen[name]}, {run}): a report shows one curve per name; "
                "write NAME=DIR for each"
            )
        seen[name] = run
    runs = seen
    out = Path(args.out)
    png = (
        out if out.suffix or out.is_dir() else out.with_suffix(".png")
    )  # matplotlib adds .png to a bare name
    table, _ = report(runs, png)
    print(table)
    print(f"curves: {png}; table: {png.with_suffix('.csv')}, {png.with_suffix('.md')}")
    return 0


def cmd_export(args) -> int:
    """Export a recipe's policy as an HF Qwen3-MoE checkpoint: from ``--checkpoint``, else the
    newest intact checkpoint of the recipe's run (``checkpoint.dir``, else
    ``train.out_dir/checkpoints``), else the recipe's ``checkpoint.load``, else its
    ``model.hf_path``; a randomly initialised policy only with ``--random-init``. A run folder
    holding checkpoints none of which is intact is refused (naming why each was skipped), not
    passed over for the recipe's start.

    The destination is checked first (:func:`moe_rl.outputs.check_export_target`): a new or
    empty directory, a file or an earlier export only with ``--overwrite``, and never one of the
    inputs it reads (``--checkpoint``, the run's checkpoints, ``checkpoint.load``,
    ``model.hf_path``) nor any run's folder or checkpoint folder, nor a path inside one. The
    export is written beside it and renamed into place; a non-finite policy is refused.
    """
    import torch

    from moe_rl.config import load_recipe
    from moe_rl.megatron.checkpoint import CheckpointError, NonFiniteWeights, load_checkpoint
    from moe_rl.megatron.hf import export_hf
    from moe_rl.megatron.parallel import destroy_parallel, init_parallel
    from moe_rl.megatron.policy import build_policy
    from moe_rl.tasks import load_tokenizer

    recipe = load_recipe(args.recipe, args.overrides)
    if args.checkpoint and not Path(args.checkpoint).exists():
        raise PathError(
            f"--checkpoint {args.checkpoint} does not exist: give a checkpoint root or a checkpoint "
            "directory (e.g. checkpoints/0003-sft-step-000060)"
        )
    source, what = _export_source(args, recipe)
    reads = {"--checkpoint": args.checkpoint, "checkpoint.load": recipe.checkpoint.load}
    reads["model.hf_path"] = recipe.model.hf_path
    if what == "the run's newest checkpoint":
        reads[what] = source
    check_export_target(args.out, overwrite=args.overwrite, reads={k: v for k, v in reads.items() if v})
    owns_dist = not torch.distributed.is_initialized()  # in-process callers keep their groups
    info = init_parallel(recipe.parallel, seed=recipe.train.seed)
    try:
        policy = build_policy(recipe.model, recipe.parallel, info)
        if source and what != "model.hf_path":  # build_policy imported model.hf_path
            load_checkpoint(source, policy.model, load_rng=False)
        dtype_name = args.dtype or recipe.model.dtype  # the dtype the policy trained in, unless asked
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
        with _replacing_file(Path(args.out)):
            export_hf(policy, args.out, tokenizer=load_tokenizer(recipe.model.tokenizer), dtype=dtype)
    except NonFiniteWeights as e:
        raise CheckpointError(f"{source or 'the initial policy'}: {e}") from None
    except Exception as e:  # a full disk, however the writer reported it: one line naming the export
        if is_disk_full(e) and not getattr(e, "filename", None):
            raise disk_full_at(args.out) from e
        raise
    finally:
        if owns_dist:
            destroy_parallel()
    why = "--dtype" if args.dtype else "model.dtype, the dtype the policy trained in; --dtype to choose"
    print(
        f"exported to {args.out} from "
        + (f"{source} ({what})" if source else what)
        + f" in {dtype_name} ({why})"
    )
    return 0


def _export_source(args, recipe) -> tuple[str | None, str]:
    """What ``moe-rl export`` reads (see :func:`cmd_export`): (path, what it is); (None, "the
    randomly initialised policy") only with ``--random-init``."""
    from moe_rl.megatron.checkpoint import CheckpointError, find_checkpoint
    from moe_rl.trainer.context import checkpoint_root
    from moe_rl.trainer.state import Checkpointer

    if args.checkpoint:
        return str(args.checkpoint), "--checkpoint"
    root = checkpoint_root(recipe)
    entries = Checkpointer(root, None, keep=1).any_written()
    if entries:
        newest, skipped = find_checkpoint(root)
        if newest is None:
            raise CheckpointError(
                f"the run's checkpoints in {root} are none of them intact (skipped: {'; '.join(skipped)}): "
                "give --checkpoint DIR to export another one"
            )
        return str(newest), "the run's newest checkpoint"
    if recipe.checkpoint.load:
        return recipe.checkpoint.load, "checkpoint.load"
    if recipe.model.hf_path:
        return recipe.model.hf_path, "model.hf_path"
    if args.random_init:
        return None, "the randomly initialised policy"
    raise UserError(
        f"{args.recipe}: nothing to export but the randomly initialised policy: {root} holds no checkpoint "
        "of this recipe's run (train it first, or point train.out_dir / checkpoint.dir at the run); give "
        "--checkpoint DIR (or checkpoint.load / model.hf_path in the recipe), or --random-init to export "
        "it anyway"
    )


@contextlib.contextmanager
def _replacing_file(out):
    """An existing file at ``out`` (``--overwrite``) is set aside, removed after a good export and
    put back after a failed one."""
    if not out.is_file():
        yield
        return
    aside = out.with_name(f".{out.name}.replaced-{uuid.uuid4().hex[:8]}")
    out.rename(aside)
    try:
        yield
    except BaseException:
        aside.rename(out)
        raise
    aside.unlink()


def cmd_bench(args) -> int:
    """Run benchmarks/<name>.py of the checkout moe-rl runs from, with its own arguments: ``python -m
    benchmarks.<name>`` in a child process (:func:`moe_rl.lab.runner.run_child`) that finds the
    checkout's ``benchmarks`` package, in this working directory; its exit status is the command's."""
    from moe_rl.lab.arms import ROOT
    from moe_rl.lab.runner import run_child

    helpers = {"common", "trl_peer"}  # modules the benchmarks share, not benchmarks
    if args.name in helpers or not (ROOT / "benchmarks" / f"{args.name}.py").exists():
        names = sorted(
            p.stem
            for p in (ROOT / "benchmarks").glob("*.py")
            if not p.stem.startswith("_") and p.stem not in helpers
        )
        raise UserError(f"no benchmark {args.name!r}; available: {', '.join(names)}")

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    with forwarding_signals() as stop:  # a stop signal reaches the benchmark, which ends cleanly
        try:
            run_child(
                [sys.executable, "-m", f"benchmarks.{args.name}", *args.args],
                {**os.environ, "PYTHONPATH": path},
            )
        except subprocess.CalledProcessError as e:
            code = e.returncode if e.returncode >= 0 else 128 - e.returncode  # killed: 128 + signal
            if stop.signum and e.returncode != 128 + stop.signum:  # else it said its own stop line
                raise StopRequested(
                    stop.signum, f"benchmark {args.name} stopped (exit status {code})"
                ) from None
            return code
    if stop.signum:
        raise StopRequested(stop.signum, f"benchmark {args.name} finished as the stop signal came")
    return 0


def _add_export(sub) -> None:
    """``moe-rl export``."""
    e = sub.add_parser("export", help="write the policy as a Hugging Face Qwen3-MoE checkpoint")
    e.add_argument("recipe")
    e.add_argument("out")
    e.add_argument("overrides", nargs="*")
    e.add_argument(
        "--checkpoint",
        default=None,
        type=text_value,
        help="moe-rl checkpoint to export (a checkpoint root or one checkpoint directory; default: the "
        "newest checkpoint of the recipe's run, else its checkpoint.load, else its model.hf_path)",
    )
    e.add_argument(
        "--random-init",
        action="store_true",
        help="export the randomly initialised policy when nothing else is given",
    )
    e.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="the weights' dtype in the export (default: model.dtype, the dtype the policy trained in)",
    )
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing file, non-empty folder or run directory at OUT (never the checkpoint exported)",
    )
    e.set_defaults(fn=cmd_export)


def _add_demo(sub) -> None:
    """``moe-rl demo``."""
    d = sub.add_parser(
        "demo",
        help="GRPO, GRPO + R2 and the chaos null on countdown with a fast router, 3 seeds each (moe-rl "
        "compare on recipes/demo/dial_demo.yaml)",
    )
    d.add_argument(
        "--recipe",
        default="recipes/demo/dial_demo.yaml",
        type=text_value,
        help="the demo recipe (see recipes/demo)",
    )  # moe_rl.lab.demo.DEFAULT_RECIPE (a test holds them equal; importing it here costs torch)
    d.add_argument("--out", default="runs/demo", type=text_value, help="where the runs and compare.* go")
    d.add_argument("--jobs", default="2", help="runs at a time (default: 2)")
    d.add_argument(
        "--seeds",
        default="3",
        help="seeds per arm: a count N (0..N-1) or seeds, 9001,9002,9003 (default: 3, DEMO_SEEDS)",
    )
    d.add_argument("--fresh", action="store_true", help="as moe-rl compare --fresh")
    d.add_argument("overrides", nargs="*")
    d.set_defaults(fn=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="moe-rl", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="run a recipe's stages (sft, rl)")
    t.add_argument("recipe")
    t.add_argument("overrides", nargs="*", help="section.field=value")
    t.add_argument("--resume", action="store_true", help="continue from the run's newest intact checkpoint")
    t.add_argument(
        "--fresh",
        action="store_true",
        help="start over in a train.out_dir holding an earlier run's checkpoints: they are kept "
        "(never pruned), new ones are numbered after them, metrics.jsonl continues",
    )
    t.set_defaults(fn=cmd_train)
    c = sub.add_parser("check", help="validate a recipe and print it resolved")
    c.add_argument("recipe")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=cmd_check)
    _add_export(sub)
    _add_demo(sub)
    sub.add_parser(
        "compare",
        help="arms side by side on a recipe, N seeds each, from one SFT start; seed-paired table and "
        "picture; moe-rl compare -h",
    )
    b = sub.add_parser("bench", help="run a benchmark: moe-rl bench NAME --preset P (see benchmarks/)")
    b.add_argument("name")
    b.add_argument("args", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    sub.add_parser("serve", help="SGLang-protocol server around the embedded engine; moe-rl serve -h")
    sub.add_parser(
        "plan", help="layout, parameter counts and per-GPU memory of a recipe (no GPU needed); moe-rl plan -h"
    )
    rp = sub.add_parser("report", help="plot and tabulate run directories (NAME=DIR or DIR)")
    rp.add_argument("runs", nargs="+")
    rp.add_argument(
        "--out", default="runs/report.png", type=text_value, help="the curves (.png); the table beside it"
    )
    rp.set_defaults(fn=cmd_report)
    return p


def _check_port(argv: list[str]) -> None:
    """``moe-rl serve``'s ``--port`` is a port number (else the bind fails deep in uvicorn)."""
    for i, a in enumerate(argv):
        value = a.partition("=")[2] if a.startswith("--port=") else None
        if a == "--port" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and not (value.isdigit() and int(value) <= 65535):
            raise UserError(f"--port {value}: give a port number in 0..65535 (0: a free port)")


def _dispatch(argv: list[str], verbose: bool) -> int:
    if argv[:1] == ["plan"]:  # its own parser: moe-rl plan RECIPE [overrides] [--num-gpus N ...]
        from moe_rl.plan import command as plan_command

        return plan_command(argv[1:])
    if argv[:1] == ["serve"]:  # SGLang's launch_server flags: moe-rl serve --model-path P [--port N]
        _setup_logging(verbose)
        _check_port(argv[1:])

        return serve_main(argv[1:])
    if argv[:1] == ["compare"]:  # its own parser: options and overrides in any order
        _setup_logging(verbose)
        return cmd_compare(compare_parser().parse_intermixed_args(argv[1:]))
    args = build_parser().parse_args(["-v", *argv] if verbose else argv)
    _setup_logging(args.verbose)
    return args.fn(args)


def main(argv: list[str] | None = None) -> int:
    """Run a command; a :class:`moe_rl.errors.UserError` (or a full disk) becomes one line on
    stderr and exit code 2 (``-v``: with its traceback); any other exception is a bug and keeps it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = argv[:1] in (["-v"], ["--verbose"])
    argv = argv[1:] if verbose else argv
    return one_line_errors(lambda: _dispatch(argv, verbose), verbose)


if __name__ == "__main__":
    sys.exit(main())
