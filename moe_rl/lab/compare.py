"""``moe-rl compare RECIPE --arms GRPO,GRPO+R3,GSPO --seeds N``: arms of the arm table side by side
on a user's recipe, N seeds each, from one start; a seed-paired table and a picture at the end.

- **Arms** are :data:`moe_rl.lab.arms.ARMS` (an unknown name is one line listing them), each the
  recipe plus the arm's ``algo`` overrides, as ``moe-rl train`` takes them.
- **Seeds**: replicate ``s`` of every arm samples with the same ``train.seed`` and ``task.seed``
  (:func:`moe_rl.lab.arms.arm_overrides`), so within a seed the arms differ only in ``algo``; each
  seed is one paired comparison.
- **One start**: a recipe whose ``train.stages`` has ``sft`` gets its SFT start trained once
  (:func:`moe_rl.lab.starts.warm_start`, into ``<out>/starts/<sft_key>``, or a finished or shipped
  start of the same SFT signature); every arm then runs ``train.stages=[rl]`` from it. A recipe
  without an SFT stage runs the arms from the start it names (``model.hf_path`` or
  ``checkpoint.load``).
- **Resumable**: every run goes through :func:`moe_rl.lab.runner.resumable_run`, so the same
  command again skips the runs that finished and resumes the ones stopped with a checkpoint.
- **Live**: one line per run as it starts and ends, and every ``status_every`` seconds a status
  line with each running run's step/steps, reward and latest held-out accuracy, read from its
  ``metrics.jsonl``. A run's own output goes to ``<out>/<arm>/s<seed>.log``.
- **Signals**: SIGTERM / SIGINT / SIGHUP are passed on to every child run
  (:func:`moe_rl.lab.runner.forwarding_signals`): each saves at its next step, no further run
  starts, and the command ends with 128 + the signal; the same command continues.
- **Result**: per arm the final reward (mean of the last 5 steps), the final held-out accuracy, its
  mean over training (AUC), the share of RL steps with a token ratio to pi_old outside [0.5, 2]
  (where routing's ratio outliers show) and the flip rates per router (``flip/step/router_rate``,
  ``flip/drift/router_rate``, means over the steps), averaged over seeds, and each arm's
  difference to the first arm paired by seed (:func:`moe_rl.lab.stats.paired`: mean, 95% t
  interval, sign-flip p), printed and written as ``compare.csv``, ``compare.md`` and
  ``compare.json`` beside ``compare.png`` (reward, held-out accuracy and the running share of
  ratio-outlier steps per arm: the median over seeds with a min-max band).

With ``jobs`` 1 the runs train one after another in this process (the trainer's own signal
handling stops them); with more, each is a ``moe-rl train`` child process, ``jobs`` at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from moe_rl.config import load_recipe
from moe_rl.errors import PathError, UserError
from moe_rl.lab.arms import COMPARE_ARMS, DEMO_ARMS, arm_dir
from moe_rl.lab.compare_checks import (
    MARKER,
    Job,
    check_arms,
    check_out,
    check_reruns,
    claim_out,
    job_overrides,
)
from moe_rl.lab.compare_plot import plot
from moe_rl.lab.report import summarize
from moe_rl.lab.results import csv_text, json_safe, write_json, write_text
from moe_rl.lab.runner import (
    STATUS_FILE,
    forwarding_signals,
    in_pool,
    local_launch,
    read_arm,
    resumable_run,
)
from moe_rl.lab.starts import cached_start, sft_key, warm_start
from moe_rl.lab.stats import auc, mean, outlier_steps, paired
from moe_rl.lab.status import STATUS_EVERY, StatusLines, fmt
from moe_rl.trainer.run_lock import hold_run_dir
from moe_rl.trainer.signals import StopRequested

log = logging.getLogger(__name__)

METRICS: dict[str, str] = {
    "reward": "final reward (mean of the last 5 RL steps)",
    "accuracy": "final held-out greedy accuracy",
    "auc": "held-out greedy accuracy averaged over training (trapezoid area over the RL steps "
    "between the first and last evaluation, divided by their distance)",
    "outlier_steps": "share of RL steps with any token ratio to pi_old outside [0.5, 2]",
    "flip_step": "flip/step/router_rate (mean over RL steps)",
    "flip_drift": "flip/drift/router_rate (mean over RL steps)",
}
"The table's per-run values, each averaged over an arm's seeds and paired by seed against the first arm."
FINISHED = ("done", "stopped")
"A run's end that has results (``stopped``: the trainer ended it on purpose, e.g. non-finite steps)."


# -- the command line's values -----------------------------------------------------------------------
def parse_arms(text: str) -> list[str]:
    """``"GRPO,gspo"`` -> ``["GRPO", "GSPO"]`` (names of :data:`ARMS`, any case); an unknown, repeated
    or missing name is a one-line error listing the arms."""
    by_key = {name.lower(): name for name in COMPARE_ARMS}
    names = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in names):
        raise UserError(f"--arms {text!r}: give comma-separated arms of {', '.join(COMPARE_ARMS)}")
    out = []
    for t in names:
        if t.lower() not in by_key:
            raise UserError(f"--arms: unknown arm {t!r}: use one of {', '.join(COMPARE_ARMS)}")
        if by_key[t.lower()] in out:
            raise UserError(f"--arms: {by_key[t.lower()]} is named twice: give each arm once")
        out.append(by_key[t.lower()])
    return out


def parse_seeds(text: str | int) -> list[int]:
    """``--seeds``: a count N (seeds 0 .. N-1, the first N) or the seeds themselves, comma-separated
    (``9001,9002,9003``; one seed alone: ``9001,``). Seed s trains with ``train.seed`` FIRST_SEED + s
    and ``task.seed`` s in every arm (:func:`moe_rl.lab.arms.arm_overrides`); a bad value, a repeated
    one or a negative one is a one-line error."""
    text = str(text).strip()
    if "," not in text:
        return list(range(parse_count(text, "--seeds", "how many seeds each arm runs")))
    parts = [t.strip() for t in text.split(",")]
    parts = parts[:-1] if parts[-1] == "" else parts
    if not parts or not all(t.isdigit() for t in parts):
        raise UserError(
            f"--seeds {text!r}: give a count (3) or seeds >= 0 separated by commas (9001,9002,9003)"
        )
    seeds = [int(t) for t in parts]
    if len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {text!r} names a seed twice: give each once")
    return seeds


def seeds_text(seeds: list[int]) -> str:
    """``3 seeds (0-2)``, ``1 seed (9001)``, ``2 seeds (9001, 9005)``."""
    n = len(seeds)
    run = seeds == list(range(seeds[0], seeds[0] + n)) if seeds else False
    which = f"{seeds[0]}-{seeds[-1]}" if run and n > 2 else ", ".join(map(str, seeds))
    return f"{n} seed{'' if n == 1 else 's'} ({which})"


MAX_COUNT = 10_000
"The most seeds per arm, or runs at a time, a comparison takes (more is a typo, not a plan)."


def parse_count(text: str | int, flag: str, what: str) -> int:
    """``text`` as a whole number in 1 .. :data:`MAX_COUNT` for ``flag``; anything else is a
    one-line error saying ``what`` it counts."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < 1:
        raise UserError(f"{flag} {text!r}: give a whole number >= 1 ({what})")
    if value > MAX_COUNT:
        raise UserError(f"{flag} {text!r}: give at most {MAX_COUNT} ({what})")
    return value


# -- the runs -------------------------------------------------------------------------------------
def plan_jobs(arms: list[str], seeds: int | list[int], out: Path) -> list[Job]:
    """Every arm's every seed (a count N: seeds 0 .. N-1), seed by seed (the first seed of every arm
    first: a comparison cut short still has whole seeds to pair)."""
    seeds = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    return [Job(a, s, out / arm_dir(a) / f"s{s}") for s in seeds for a in arms]


@contextlib.contextmanager
def _output_into(log_file: Path, in_process: bool):
    """A run in this process writes its output into ``log_file`` instead of the terminal: log
    records (the root logger's handlers swapped for one on the file), progress bars and warnings
    (``sys.stderr``); a child's output is its launcher's (``log_file`` too)."""
    if not in_process:
        yield
        return
    with open(log_file, "a") as f, contextlib.redirect_stderr(f):
        handler = logging.StreamHandler(f)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        root = logging.getLogger()
        saved = root.handlers[:]
        root.handlers = [handler]
        try:
            yield
        finally:
            root.handlers = saved


@contextlib.contextmanager
def _lab_quiet():
    """The runner's and the starts' INFO lines (launch commands, resumes) off the terminal while the
    comparison prints its own."""
    names = ("moe_rl.lab.runner", "moe_rl.lab.starts")
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


# -- the table --------------------------------------------------------------------------------------
def run_values(run_dir: str | Path) -> dict:
    """A finished run's values of :data:`METRICS` (nan when it has none), its RL steps and its
    held-out accuracy at the start."""
    arm = read_arm(run_dir)
    s = summarize("", arm)
    rl = arm["rl"]
    return {
        "steps": s["steps"],
        "reward": s["reward_last"],
        "accuracy": s["eval_end"],
        "auc": auc(
            [(r["step"], r["eval/accuracy"]) for r in arm["eval"] if r.get("eval/accuracy") is not None]
        ),
        "outlier_steps": outlier_steps(rl),
        "accuracy_start": s["eval_start"],
        "flip_step": mean(r.get("flip/step/router_rate") for r in rl),
        "flip_drift": mean(r.get("flip/drift/router_rate") for r in rl),
    }


def seed_table(values: dict[str, dict[int, dict]], arms: list[str]) -> list[dict]:
    """One row per arm: its number of seeds, each of :data:`METRICS` averaged over them, and (after
    the first arm) ``diff``: per metric, :func:`moe_rl.lab.stats.paired` of the differences to the
    first arm over the seeds both ran, each difference within one seed."""
    ref = values.get(arms[0], {})
    rows = []
    for arm in arms:
        per = values.get(arm, {})
        row: dict = {"arm": arm, "seeds": len(per), "seed_list": sorted(per)}
        for m in METRICS:
            row[m] = mean(per[s][m] for s in sorted(per))
        if arm != arms[0]:
            common = sorted(set(per) & set(ref))
            row["vs"] = arms[0]
            row["diff"] = {m: paired([per[s][m] - ref[s][m] for s in common]) for m in METRICS}
        rows.append(row)
    return rows


PERCENT = ("accuracy", "auc", "outlier_steps", "flip_step", "flip_drift")
"""The rates among :data:`METRICS`: fractions in compare.json and compare.csv (data, as metrics.jsonl),
shown in percent in the printed and Markdown tables and the picture, their differences in points."""
SPECS = {
    "reward": ".3f",
    "accuracy": ".1f",
    "auc": ".1f",
    "outlier_steps": ".1f",
    "flip_step": ".3f",
    "flip_drift": ".3f",
}
"Each metric's shown precision (rates in percent)."
HEADS = {
    "reward": "reward",
    "accuracy": "held-out acc",
    "auc": "acc AUC",
    "outlier_steps": "ratio-outlier steps",
    "flip_step": "flip/step",
    "flip_drift": "flip/drift",
}
UNITS = {
    "accuracy": "%",
    "auc": "%",
    "outlier_steps": "% of steps",
    "flip_step": "% of routers",
    "flip_drift": "% of routers",
}
"The unit each shown value is in (a reward is a reward); a difference of rates is in points (pts)."
DIFFS = ("reward", "auc", "outlier_steps")
"The paired differences the terminal table prints (the Markdown table and the CSV hold every metric's)."


def head(m: str) -> str:
    """A mean's column heading with its unit: ``held-out acc (%)``."""
    return f"{HEADS[m]} ({UNITS[m]})" if m in UNITS else HEADS[m]


def diff_head(m: str, ref: str) -> str:
    """A paired difference's column heading with its unit: ``acc AUC - GRPO (pts) [95% CI]``."""
    return f"{HEADS[m]} - {ref}" + (" (pts)" if m in PERCENT else "") + " [95% CI]"


def _shown(m: str, v):
    return 100 * v if m in PERCENT and isinstance(v, (int, float)) else v


def cell(m: str, v) -> str:
    """Metric ``m``'s mean as shown (rates in percent)."""
    return fmt(_shown(m, v), SPECS[m])


def diff_cell(m: str, d: dict | None) -> str:
    """A paired difference as shown, ``mean [lo, hi]`` (rates in points)."""
    if not d or not d["n"]:
        return "-"
    spec = "+" + SPECS[m]
    text = format(_shown(m, d["mean"]), spec)
    if d["n"] < 2:
        return f"{text} (1 seed)"
    lo, hi = (format(_shown(m, x), spec) for x in d["ci95"])
    return f"{text} [{lo}, {hi}]"


def format_table(rows: list[dict], *, diffs: tuple[str, ...] = DIFFS) -> str:
    """The terminal table: per arm its seeds and the :data:`METRICS` means, then its paired
    difference to the first arm for ``diffs`` (mean [95% CI]); every heading names its unit."""
    ref = rows[0]["arm"]
    heads = ["arm", "seeds", *(head(m) for m in METRICS), *(diff_head(m, ref) for m in diffs)]
    cells = [
        [
            r["arm"],
            str(r["seeds"]),
            *(cell(m, r[m]) for m in METRICS),
            *(diff_cell(m, r.get("diff", {}).get(m)) for m in diffs),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]

    def line(cs: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cs, widths)))

    top = line(heads)
    return "\n".join([top, "-" * len(top), *(line(c) for c in cells)])


def markdown_table(rows: list[dict]) -> str:
    """The table as Markdown: every metric's mean and every paired difference to the first arm."""
    ref = rows[0]["arm"]
    heads = ["arm", "seeds", *(head(m) for m in METRICS), *(diff_head(m, ref) for m in METRICS)]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(["---", *["---:"] * (len(heads) - 1)]) + "|"]
    for r in rows:
        cells = [
            r["arm"],
            str(r["seeds"]),
            *(cell(m, r[m]) for m in METRICS),
            *(diff_cell(m, r.get("diff", {}).get(m)) for m in METRICS),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def csv_rows(rows: list[dict]) -> list[dict]:
    """The table as flat CSV rows: the means, then per metric the paired difference's ``mean``,
    ``ci_lo``, ``ci_hi``, ``n`` and ``p`` (empty for the first arm)."""
    out = []
    for r in rows:
        flat = {"arm": r["arm"], "seeds": r["seeds"], **{m: r[m] for m in METRICS}}
        for m in METRICS:
            d = r.get("diff", {}).get(m)
            flat[f"d_{m}_vs"] = r.get("vs", "")
            vals = (d["mean"], d["ci95"][0], d["ci95"][1], d["n"], d["p"]) if d else ("",) * 5
            flat.update(
                dict(zip((f"d_{m}_mean", f"d_{m}_ci_lo", f"d_{m}_ci_hi", f"d_{m}_n", f"d_{m}_p"), vals))
            )
        out.append(json_safe(flat))
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    write_text(path, csv_text(csv_rows(rows)))


# -- the command --------------------------------------------------------------------------------------
def _start(
    recipe: Path, overrides: list[str], out: Path, launch: str | None, progress: StatusLines, stop
) -> Path | None:
    """The SFT start every run begins from (trained once into ``<out>/starts``) when the recipe has
    an SFT stage; None when it names its own start; a recipe with neither is refused."""
    base = load_recipe(recipe, overrides)
    if "sft" not in base.train.stages:
        if not (base.model.hf_path or base.checkpoint.load):
            raise UserError(
                f"{recipe}: train.stages has no sft and neither model.hf_path nor checkpoint.load names a "
                "start: the arms would begin from random weights. Add sft to train.stages or name a start"
            )
        return None
    cache = out / "starts"
    hit = cached_start(recipe, overrides, cache=cache)
    if hit is not None:
        progress.line(f"SFT start: reusing {hit[0]}")
        return hit[0]
    root = cache / sft_key(load_recipe(recipe, [*overrides, "train.stages=[sft]"]))
    logf = out / "sft.log"
    out.mkdir(parents=True, exist_ok=True)
    progress.started("SFT start", root, "sft", base.train.sft_steps, logf)
    try:
        with _output_into(logf, launch is None):
            ckpt, info = warm_start(recipe, overrides, cache=cache, launch=launch, root=root, log_file=logf)
    except StopRequested:
        progress.ended_run(
            "SFT start", "stopped by a signal, saved (the same command continues it)", counts=False
        )
        raise
    except subprocess.CalledProcessError as e:
        if stop.signum:
            import signal

            name = signal.Signals(stop.signum).name
            progress.ended_run(
                "SFT start", "stopped by a signal, saved (the same command continues it)", counts=False
            )
            raise StopRequested(
                stop.signum, f"{name} received: the SFT start saved at its next step"
            ) from None
        raise UserError(
            f"the SFT start failed (exit status {e.returncode}): its output is in {logf}"
        ) from None
    progress.ended_run(
        "SFT start",
        f"done in {info['wall_s']:.0f}s, final loss {info['final_loss']:.3f} ({ckpt})",
        counts=False,
    )
    return ckpt


def run_compare(
    recipe: str | Path,
    overrides: list[str] = (),
    *,
    arms: list[str] | None = None,
    seeds: int | list[int] = 1,
    jobs: int | None = None,
    out: str | Path | None = None,
    status_every: float = STATUS_EVERY,
    stream=None,
    fresh: bool = False,
) -> dict:
    """Run (or reuse) the start and every arm's every seed; write the table, picture and JSON
    under ``out`` (default: the recipe's ``train.out_dir``), which the command holds
    (:func:`moe_rl.trainer.run_lock.hold_run_dir`) until it ends. ``jobs``: runs at a time
    (default: one per arm). Folders of ``out`` holding runs of another recipe are refused
    (:func:`check_reruns`) unless ``fresh``. Returns ``{"table", "rows", "failed", "out", "files",
    "wall_s"}``; a stop signal raises :class:`~moe_rl.trainer.signals.StopRequested` once every
    child saved (:func:`moe_rl.lab.runner.stop_cleanly` turns it into 128 + the signal)."""
    recipe, overrides = Path(recipe), list(overrides)
    arms = list(arms or DEMO_ARMS)
    if not recipe.is_file():
        raise PathError(
            f"compare recipe {recipe} is not a file: give a recipe such as recipes/compare_tiny.yaml"
        )
    steps = check_arms(recipe, overrides, arms)
    out = Path(out if out is not None else load_recipe(recipe, overrides).train.out_dir)
    seeds = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    planned = plan_jobs(arms, seeds, out)
    jobs = max(1, min(jobs or len(arms), len(planned)))
    launch = local_launch(None, jobs)  # one at a time: in this process; else a child per run
    threads = max(1, (os.cpu_count() or 1) // jobs) if launch else None
    check_out(out, command="compare", marker=MARKER, writes="a folder per arm, its start and compare.*")
    plan = _Plan(recipe, overrides, arms, seeds, out, planned, steps, jobs, launch, threads)
    with hold_run_dir(out, rank=0, what="compare --out"):
        check_reruns(out, planned, recipe, overrides, fresh=fresh)
        return _compare_runs(plan, status_every, stream)


@dataclass(frozen=True)
class _Plan:
    """What :func:`run_compare` decided before anything runs."""

    recipe: Path
    overrides: list[str]
    arms: list[str]
    seeds: list[int]
    out: Path
    planned: list[Job]
    steps: dict[str, int]
    jobs: int
    launch: str | None
    threads: int | None


def _compare_runs(plan: _Plan, status_every: float, stream) -> dict:
    """:func:`run_compare`'s runs, in a held ``out``: the start, every job, the results."""
    recipe, overrides, arms, seeds, out, planned = (
        plan.recipe,
        plan.overrides,
        plan.arms,
        plan.seeds,
        plan.out,
        plan.planned,
    )
    steps, jobs, launch, threads = plan.steps, plan.jobs, plan.launch, plan.threads
    t0 = time.perf_counter()
    progress = StatusLines(len(planned), status_every, stream, jobs=jobs)
    how = f"{threads} thread(s) each" if threads else "in this process"
    progress.line(
        f"compare {', '.join(arms)} x {seeds_text(seeds)} of {recipe} into {out}: "
        f"{len(planned)} runs, {jobs} at a time ({how})"
    )
    ended: dict[Job, dict] = {}
    with forwarding_signals() as stop, _lab_quiet(), progress:
        start = _start(recipe, overrides, out, launch, progress, stop)
        claim_out(out, recipe, overrides, marker=MARKER)

        def one(job: Job) -> None:
            if stop.signum:  # stopping: start nothing new
                return
            job.out.parent.mkdir(parents=True, exist_ok=True)
            finished = (job.out / STATUS_FILE).exists()  # most likely skipped: no "started" line
            progress.started(job.label, job.out, "rl", steps[job.arm], job.log_file, quiet=finished)
            kw = {"resume": True, "checkpoint_every": None, "threads": threads, "log_file": job.log_file}
            ov = job_overrides(overrides, job)
            try:
                with _output_into(job.log_file, launch is None):
                    st = resumable_run(job.label, recipe, ov, job.out, start=start, launch=launch, **kw)
            except StopRequested:
                progress.ended_run(job.label, "stopped by a signal, saved (the same command continues it)")
                raise
            except Exception as e:  # a run in this process crashed: the others still run
                with open(job.log_file, "a") as f:
                    traceback.print_exc(file=f)
                st = {"status": "failed", "reason": f"{type(e).__name__}: {e}"}
            ended[job] = st
            if st["status"] in FINISHED:
                v = run_values(job.out)
                when = "finished earlier, skipped" if "ended_at" in st else f"{st['wall_s']:.0f}s"
                when += ", resumed" if st.get("resumed") and "ended_at" not in st else ""
                progress.ended_run(
                    job.label,
                    f"{st['status']} ({when}): {v['steps']} steps, reward {fmt(v['reward'])}, "
                    f"held-out acc {fmt(v['accuracy_start'], '.1%')} -> {fmt(v['accuracy'], '.1%')}",
                    wall_s=None if "ended_at" in st else st["wall_s"],
                )
            elif stop.signum:
                progress.ended_run(job.label, "stopped by a signal, saved (the same command continues it)")
            else:
                progress.ended_run(job.label, f"FAILED ({st['reason']}): its output is in {job.log_file}")

        in_pool(one, planned, jobs)
        if stop.signum:
            cut = sum(1 for j in planned if j in ended and ended[j]["status"] not in FINISHED)
            name = signal.Signals(stop.signum).name
            raise StopRequested(
                stop.signum, f"{name} received: {cut} running run(s) saved at their next step"
            )
    return write_results(recipe, overrides, arms, seeds, out, planned, ended, time.perf_counter() - t0, jobs)


def write_results(recipe, overrides, arms, seeds, out, planned, ended, wall, jobs) -> dict:
    """The table, ``compare.csv``, ``compare.md``, ``compare.json`` and ``compare.png`` of the runs
    that finished (``ended``: each run's status)."""
    finished = [j for j in planned if ended.get(j, {}).get("status") in FINISHED]
    failed = [j for j in planned if j not in finished]
    values: dict[str, dict[int, dict]] = {a: {} for a in arms}
    curves: dict[str, dict[int, dict]] = {a: {} for a in arms}
    for j in finished:
        values[j.arm][j.seed] = {**run_values(j.out), "out": str(j.out)}
        curves[j.arm][j.seed] = read_arm(j.out)
    rows = seed_table(values, arms)
    files = {k: out / f"compare.{k}" for k in ("csv", "md", "json", "png")}
    write_csv(files["csv"], rows)
    write_text(
        files["md"],
        f"# moe-rl compare: {', '.join(arms)} x {seeds_text(seeds)}\n\n`{recipe}` {' '.join(overrides)}\n\n"
        + markdown_table(rows)
        + f"\nDifferences to {arms[0]}: paired by seed, mean [95% t interval] over the seeds both arms ran.\n\n"
        + "".join(f"- {HEADS[m]}: {text}\n" for m, text in METRICS.items()),
    )
    plot({a: c for a, c in curves.items() if c}, files["png"])
    doc = {
        "recipe": str(recipe),
        "overrides": overrides,
        "arms": arms,
        "seeds": seeds,
        "reference": arms[0],
        "metrics": METRICS,
        "rows": rows,
        "runs": {a: {str(s): v for s, v in sorted(values[a].items())} for a in arms},
        "failed": [
            {"arm": j.arm, "seed": j.seed, "log": str(j.log_file), **ended.get(j, {})} for j in failed
        ],
        "wall_s": wall,
        "jobs": jobs,
        "cpu_count": os.cpu_count(),
    }
    write_json(files["json"], doc)
    return {
        "table": format_table(rows),
        "rows": rows,
        "failed": failed,
        "out": out,
        "files": files,
        "wall_s": wall,
    }
