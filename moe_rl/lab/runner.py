"""One runner for every experiment: an arm (a recipe plus overrides) in this process, in a child
process or through a launcher, resumed from its checkpoint, its end noted in an atomic status file,
many at a time in a pool, with the CPU seconds each took.

- :func:`run_recipe` runs ``moe-rl train base overrides`` in process (``launch`` None) or as
  ``launch base overrides`` (a command prefix: :func:`child_launch`, ``launch/torchrun.sh``,
  ``sbatch --wait launch/slurm.sbatch``), its child timed alone (:func:`run_child`);
- :func:`run_arm` runs one RL arm from a start and says how it ended; :func:`resumable_run` does
  so unless an earlier invocation finished it (:data:`STATUS_FILE`);
- :func:`in_pool` and :func:`run_when_ready` run many, ``jobs`` at a time;
- :func:`forwarding_signals` passes SIGTERM / SIGINT / SIGHUP on to every child run (each saves at
  its next step), :func:`stop_cleanly` ends the command with 128 + the signal;
- :func:`read_arm` reads an arm's metrics back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moe_rl.argparsing import run_main
from moe_rl.lab.report import load_arm
from moe_rl.lab.results import write_json
from moe_rl.trainer.signals import SIGNALS

log = logging.getLogger(__name__)

ARM_CHECKPOINT_EVERY = 10
"""An RL arm saves every this many steps (unless its overrides say otherwise), so that a killed
one resumes (:func:`run_arm`); saving does not change the run (tests/integration/test_lab_runner.py)."""
STATUS_FILE = "status.json"
"Written into a run's directory when it finishes (done or stopped): a rerun of the sweep skips it."


# -- processes and CPU time ----------------------------------------------------------------------
def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (comparable on a shared machine).
    The children's share counts every child reaped in between, those of concurrent runs too: a
    run in a child process is timed by :func:`run_child` instead."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_child(cmd: list[str], env: dict | None = None, *, log_file: Path | None = None) -> float:
    """``subprocess.run(cmd, check=True)`` (its output into ``log_file`` when given), returning the
    CPU seconds of that child and of the descendants it waited for: its own ``wait4`` resource
    usage, which runs going on beside it in other threads do not enter (as they enter
    :func:`cpu_seconds`)."""
    with (
        open(log_file, "a") if log_file else contextlib.nullcontext() as out
    ):  # a resumed run's log continues
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        _LIVE.add(proc)
        try:
            for stop in list(_FORWARDING):  # a stop asked for before this child was in _LIVE
                if stop.signum:
                    _send(proc, stop.signum)
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted: do not leave the child running
            proc.kill()
            proc.wait()
            raise
        finally:
            _LIVE.discard(proc)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return usage.ru_utime + usage.ru_stime


_LIVE: set[subprocess.Popen] = set()
"The child processes :func:`run_child` is waiting on (what :func:`forwarding_signals` signals)."
_FORWARDING: list[Forwarded] = []
"The :func:`forwarding_signals` blocks in force (a child started after a stop gets it too)."


class Forwarded:
    """What :func:`forwarding_signals` saw: ``signum``, the first stop signal (0: none yet)."""

    signum: int = 0


def _send(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(proc.pid, signum)


@contextlib.contextmanager
def forwarding_signals():
    """While inside, SIGTERM, SIGINT and SIGHUP sent to this process are passed on to every child
    :func:`run_child` is waiting on, and to any it starts later: each ``moe-rl train`` child saves
    at its next step and exits with 128 + the signal (trainer/signals.py), so none is orphaned.
    The first signal is recorded in the yielded :class:`Forwarded`: the caller starts no new run
    and ends with 128 + it (:func:`stop_cleanly`). A run in this process installs the trainer's
    own handlers while it trains (they stop it the same way). Outside the main thread (where Python
    installs no handlers) nothing is installed."""
    state = Forwarded()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def forward(signum, frame):
        if not state.signum:
            state.signum = signum
            log.warning(
                "%s received: passed on to %d running run(s); each stops after its step with a checkpoint",
                signal.Signals(signum).name,
                len(_LIVE),
            )
        for proc in list(_LIVE):
            _send(proc, signum)

    old = {s: signal.signal(s, forward) for s in SIGNALS}
    _FORWARDING.append(state)
    try:
        yield state
    finally:
        _FORWARDING.remove(state)
        for s, handler in old.items():
            signal.signal(s, handler)


def child_launch() -> str:
    """The launch prefix of a fresh ``moe-rl train`` process on this machine (this interpreter)."""
    return f"{shlex.quote(sys.executable)} -m moe_rl.cli train"


def local_launch(launch: str | None, jobs: int) -> str | None:
    """``launch``, or with ``jobs`` > 1 a fresh ``moe_rl.cli train`` process per run (None: in process)."""
    return launch or (child_launch() if jobs > 1 else None)


def arm_command(base: str | Path, overrides: list[str], out: str | Path, launch: str | None = None) -> str:
    """The shell command that runs one arm into ``out`` (what a ``--dry-run`` prints)."""
    prefix = shlex.split(launch) if launch else ["moe-rl", "train"]
    return shlex.join([*prefix, str(base), *overrides, f"train.out_dir={out}"])


def ensure_parallel() -> None:
    """A world-of-one process group for in-process runs (kept for every run of this process)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from moe_rl.config import ParallelConfig
        from moe_rl.megatron.parallel import init_parallel

        init_parallel(ParallelConfig(), seed=0)


# -- one run -------------------------------------------------------------------------------------
def run_recipe(
    base: str | Path,
    overrides: list[str],
    launch: str | None = None,
    *,
    resume: bool = False,
    fresh: bool = False,
    threads: int | None = None,
    log_file: Path | None = None,
) -> dict:
    """``moe-rl train base overrides``: in this process (``launch`` None) or as ``launch base overrides``
    (``resume``: ``--resume``, from the newest intact checkpoint of the run's directory; ``fresh``:
    ``--fresh``, a new run beside the checkpoints the directory holds, which are kept).

    ``launch`` is a command prefix, e.g. :func:`child_launch` (a fresh process per arm),
    ``launch/torchrun.sh`` (one node) or ``"sbatch --wait --nodes=3 launch/slurm.sbatch"`` (Slurm;
    ``--wait`` makes the harness wait for each arm). A launched run gets ``threads`` as
    ``OMP_NUM_THREADS`` when given, and writes its output into ``log_file`` when given.

    Returns, launched, ``{"cpu_s": ...}`` (:func:`run_child`: the launcher's process tree on this
    machine, so under ``sbatch`` the job's own CPU is not in it); in process, the run's result.
    """
    if launch:
        flags = ["--resume"] if resume else ["--fresh"] if fresh else []
        cmd = [*shlex.split(launch), str(base), *overrides, *flags]
        log.info("launching %s", shlex.join(cmd))
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        return {"cpu_s": run_child(cmd, env, log_file=log_file)}
    from moe_rl.config import load_recipe
    from moe_rl.trainer.run import run

    recipe = load_recipe(base, overrides)
    if recipe.parallel.world_size == 1:
        ensure_parallel()
    return run(recipe, resume=resume, fresh=fresh)


def run_arm(
    base: str | Path,
    overrides: list[str],
    out_dir: str | Path,
    *,
    start: Path | None = None,
    launch: str | None = None,
    resume: bool = True,
    checkpoint_every: int | None = ARM_CHECKPOINT_EVERY,
    threads: int | None = None,
    log_file: Path | None = None,
) -> dict:
    """One RL arm into ``out_dir`` (from SFT start ``start`` when given): a fresh one, or, with
    ``resume``, the same run resumed when ``out_dir`` holds its checkpoint (:func:`resumable`: e.g.
    a run stopped by SIGTERM, which saves at the next step). It saves every ``checkpoint_every``
    steps unless ``overrides`` say otherwise (None: as the recipe says). A fresh run into a folder
    that holds anything starts beside it (``moe-rl train --fresh``: earlier checkpoints are kept,
    ``metrics.jsonl`` continues with the new run's rows, which :func:`read_arm` reads): nothing in
    the folder is deleted (callers that must not start over, ``moe-rl compare``, refuse first).

    Returns ``{"status": "done" | "stopped" | "failed", "reason", "wall_s", "cpu_s", "resumed"}``
    (times of this attempt only); a run the trainer stops on purpose (repeated non-finite steps, a
    sentinel set to stop) is ``stopped``.
    """
    from moe_rl.trainer.loop import TrainingStopped

    out_dir = Path(out_dir)
    ov = arm_run_overrides(out_dir, overrides, start, checkpoint_every)
    resume = resume and resumable(out_dir, base, ov)
    fresh = not resume and holds_checkpoints(base, ov)
    if resume:
        log.info("resuming %s from its checkpoint", out_dir)
    elif fresh:
        log.info("%s holds an earlier run's checkpoints: a new run beside them (--fresh)", out_dir)
    t0, c0 = time.perf_counter(), cpu_seconds()
    status, reason, child = "done", None, {}
    try:
        done = run_recipe(base, ov, launch, resume=resume, fresh=fresh, threads=threads, log_file=log_file)
        child = done if launch else {}
    except TrainingStopped as e:
        status, reason = "stopped", str(e)
    except subprocess.CalledProcessError as e:
        status, reason = "failed", f"exit status {e.returncode}"
    return {
        "status": status,
        "reason": reason,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": child.get("cpu_s", cpu_seconds() - c0),
        "out_dir": str(out_dir),
        "resumed": resume,
    }


def run_of(recipe, *, any_start: bool = False) -> dict:
    """What makes ``recipe``'s run the run it is, as plain data: the resolved recipe less how often
    it saves (that does not change a run); ``any_start``: less where its SFT start was found too
    (``checkpoint.load``, ``model.hf_path``, ``train.stages``)."""
    from moe_rl.config import to_dict

    d = to_dict(recipe)
    skip = ("every", "keep", "load") if any_start else ("every", "keep")
    d["checkpoint"] = {k: v for k, v in d["checkpoint"].items() if k not in skip}
    if any_start:
        d["model"] = {k: v for k, v in d["model"].items() if k != "hf_path"}
        d["train"] = {k: v for k, v in d["train"].items() if k != "stages"}
    return d


def run_differences(saved: dict, asked: dict, prefix: str = "") -> list[str]:
    """``["train.temperature 1.0 -> 0.9", ...]``: the fields where two :func:`run_of` differ."""
    out = []
    for k in sorted(set(saved) | set(asked), key=str):
        a, b = saved.get(k), asked.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += run_differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} {_shown(a)} -> {_shown(b)}")
    return out


def _shown(v) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    return json.dumps(list(v) if isinstance(v, tuple) else v)[:40]


def differences(
    out_dir: Path, base: str | Path, overrides: list[str], *, any_start: bool = False
) -> list[str] | None:
    """How the run ``out_dir`` holds differs from the recipe ``base`` + ``overrides`` makes
    (:func:`run_differences`; ``[]``: the same run), or None when ``out_dir`` holds no run's
    ``recipe.yaml``. An unreadable saved recipe (an older layout) differs as ``["recipe.yaml: ..."]``."""
    from moe_rl.config import load_recipe

    saved = out_dir / "recipe.yaml"
    if not saved.exists():
        return None
    asked = run_of(load_recipe(base, overrides), any_start=any_start)
    try:
        return run_differences(run_of(load_recipe(saved), any_start=any_start), asked)
    except Exception as e:  # an unreadable or older recipe: not this run
        log.info("not the same run in %s: %s", out_dir, e)
        return [f"recipe.yaml unreadable ({str(e)[:80]})"]


def same_run(out_dir: Path, base: str | Path, overrides: list[str], *, any_start: bool = False) -> bool:
    """True when ``out_dir``'s saved ``recipe.yaml`` resolves to the recipe ``base`` + ``overrides``
    makes (:func:`run_of`; ``any_start``: wherever its SFT start was found, which a caller skipping
    a finished run need not know)."""
    try:
        return differences(out_dir, base, overrides, any_start=any_start) == []
    except Exception as e:  # the asked recipe does not load: not this run
        log.info("not the same run in %s: %s", out_dir, e)
        return False


def holds_checkpoints(base: str | Path, overrides: list[str]) -> bool:
    """Whether the checkpoint folder of the run ``base`` + ``overrides`` holds any checkpoint entry
    (intact or not): a new run there needs ``moe-rl train --fresh``."""
    from moe_rl.config import load_recipe
    from moe_rl.trainer.context import checkpoint_root
    from moe_rl.trainer.state import Checkpointer

    return bool(Checkpointer(checkpoint_root(load_recipe(base, overrides)), None, keep=1).any_written())


def resumable(out_dir: Path, base: str | Path, overrides: list[str]) -> bool:
    """True when ``out_dir`` holds an intact checkpoint of the run ``base`` + ``overrides`` would
    make: its saved ``recipe.yaml`` resolves to the same recipe (anything else starts over)."""
    from moe_rl.megatron.checkpoint import latest_checkpoint
    from moe_rl.trainer.state import resume_conflict

    if latest_checkpoint(out_dir / "checkpoints") is None:
        return False
    return same_run(out_dir, base, overrides) and resume_conflict(out_dir, out_dir / "checkpoints") is None


def arm_run_overrides(
    out_dir: Path, overrides: list[str], start: Path | None, checkpoint_every: int | None
) -> list[str]:
    """The overrides :func:`run_arm` trains with: how often to save, ``overrides``, the output
    folder and the SFT start's."""
    from moe_rl.lab.arms import start_overrides

    every = [] if checkpoint_every is None else [f"checkpoint.every={checkpoint_every}"]
    ov = [*every, *overrides, f"train.out_dir={out_dir}"]
    if start is not None:
        ov += ["train.stages=[rl]", *start_overrides(start)]
    return ov


def read_status(path: Path) -> dict | None:
    """A run's :data:`STATUS_FILE`, or None (with a warning naming it) when it cannot be read."""
    try:
        st = json.loads(path.read_text())
        if isinstance(st, dict) and "status" in st:
            return st
        raise ValueError("no 'status' field")
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s): running that arm again", path, e)
        return None


def resumable_run(
    label: str,
    base: str | Path,
    overrides: list[str],
    out: Path,
    *,
    start: Path | None = None,
    launch: str | None = None,
    **run_kw,
) -> dict:
    """:func:`run_arm` into ``out`` (``run_kw``: its other arguments) unless an earlier invocation
    finished this same run there.

    A run that ends (done or stopped) writes :data:`STATUS_FILE` into ``out`` (atomically:
    :func:`moe_rl.lab.results.write_json`); with that file present, and ``out``'s recipe the one asked for, the
    run is skipped and its status read back. A crash (``failed``) writes nothing, so the next
    invocation retries it; so does an unreadable status file or one of another run (a changed
    recipe or override), whose folder starts over.
    """
    done = Path(out) / STATUS_FILE
    if done.exists():  # finished in an earlier invocation: resume, do not rerun
        st = read_status(done)
        every = run_kw.get("checkpoint_every", ARM_CHECKPOINT_EVERY)
        ov = arm_run_overrides(Path(out), overrides, start, every)
        if st is not None and same_run(Path(out), base, ov, any_start=True):
            log.info("%s: already %s (%s)", label, st["status"], done)
            return st
        if st is not None:
            log.warning("%s: %s holds another run (its recipe differs): running this one", label, out)
        done.unlink(missing_ok=True)
    st = run_arm(base, overrides, out, start=start, launch=launch, **run_kw)
    log.info("%s: %s in %.0fs", label, st["status"], st["wall_s"])
    if st["status"] != "failed":  # a crash is retried by the next invocation
        write_json(done, {**st, "ended_at": time.time()}, indent=None)
    return st


def read_arm(out_dir: str | Path) -> dict:
    """``{"rl": rows, "eval": rows}`` of a finished (or stopped) arm; empty when it wrote nothing."""
    if not (Path(out_dir) / "metrics.jsonl").exists():
        return {"rl": [], "eval": []}
    return load_arm(out_dir)


# -- many runs -----------------------------------------------------------------------------------
def in_pool(fn, items: list, jobs: int) -> list:
    """``[fn(x) for x in items]`` with ``jobs`` at a time (threads: each waits on its own process).

    One at a time they run in the calling thread: an in-process run there gets the trainer's
    SIGINT / SIGTERM handling (Python installs signal handlers in the main thread only), so Ctrl-C
    stops the arm at its next step with a checkpoint and ends the sweep (:func:`stop_cleanly`)
    instead of being ignored until the arm's last step."""
    if jobs <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(fn, items))


def stop_cleanly(main) -> int:
    """``main()`` for a sweep's command line (:func:`moe_rl.argparsing.run_main`): a run stopped by
    a signal (after its checkpoint) ends the sweep with one line and 128 + the signal's number
    (rerunning the command resumes); a user error is one line and exit code 2."""
    return run_main(main, verbose=False)


def run_when_ready(items: list, *, jobs: int, ready, build, run) -> list:
    """``[run(x) for x in items]`` with ``jobs`` workers, where an item may first need a start that
    ``build(x)`` makes (``ready(x)``: its start exists). A free worker builds the start of the
    first pending item that lacks one when no build is under way (one at a time: SFT starts train
    in this process), else runs the first pending item that is ready, else waits. So starts are
    built as early as the order asks, and the other workers run what is ready meanwhile instead
    of waiting on a start. Results in the order of ``items``; the first error stops the workers
    and is raised."""
    pending = list(range(len(items)))
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    cond = threading.Condition()
    building = False

    def next_job():
        nonlocal building
        with cond:
            while not errors and pending:
                # one pass, each item asked once; it stops once nothing later can change the pick
                first_ready = None
                for i in pending:
                    if not ready(items[i]):
                        if not building:
                            building = True
                            return build, i
                    elif first_ready is None:
                        first_ready = i
                        if building:
                            break
                if first_ready is not None:
                    pending.remove(first_ready)
                    return run, first_ready
                cond.wait()
            return None

    def worker():
        nonlocal building
        while (job := next_job()) is not None:
            fn, i = job
            try:
                out = fn(items[i])
                if fn is run:
                    results[i] = out
                elif not ready(items[i]):
                    raise RuntimeError(f"building the start of {items[i]} left it not ready")
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                errors.append(e)
            finally:
                with cond:
                    if fn is build:
                        building = False
                    cond.notify_all()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [results[i] for i in range(len(items))]
