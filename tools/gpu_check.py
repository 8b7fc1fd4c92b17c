"""One command for a lent GPU (docs/gpu_check.md): everything this project needs CUDA for, measured
in one budgeted run whose JSON is rewritten after every section (a run cut short keeps what it
measured).

Sections, in order, each timed; a failure is recorded (traceback summary) and the next one runs:

- ``device``: torch / CUDA / Triton versions, the device, and its measured dense matmul rate
  (bf16 8192^3 ``torch.mm`` timed with CUDA events; fp32 on CPU). Every rate below divides by it.
- ``colocated``: colocated SGLang's two CUDA checks (``tools.gpu_colocated``): a push's CUDA IPC
  bucket opened by an unrelated process with SGLang's own deserializer, bit for bit; ``HostOffload``
  on CUDA storages, device memory freed and taken back (``torch.cuda.mem_get_info``), bit-equal.
- ``tests``: ``pytest tests/gpu`` in a subprocess (junit XML parsed): every test's id and outcome.
- ``rl_step``: one trainer ``rl_step`` of the tiny policy with the embedded engine for every
  algorithm (grpo, gspo, gspo_token) x routing (none, r2, r3), and a resume check: 2 steps in one
  run against 1 step, checkpoint, ``--resume``, 1 step (``moe_rl.trainer.run.run``). The same
  helpers are tests/gpu/test_gpu_rl_step.py's.
- ``moe_target``: the training pass in the regime users train (``benchmarks.moe_target``): a
  Qwen3-30B-A3B-shaped layer (hidden 2048, 64 experts top-8, vocabulary 151,936) with as many layers
  as fit the GPU with their optimizer, packed passes of 8k and 16k positions: tokens/s per GPU, MFU,
  the GPU's busy share and kernel launches per pass, per layer spec that runs here.
- ``kernels``: the fused log-prob kernel against the naive path and torch.compile of it
  (``benchmarks.kernels.bench_config``): N = 8k-32k tokens, H = 2048 / 4096, V = 151,936, bf16,
  forward and forward+backward, time, peak memory, the matmul floor; configurations in order of
  importance, each only while the section's budget allows it.
- ``moe_1b``: bf16 RL steps of a ~1.06B-parameter Qwen3-MoE-shaped policy (64 experts top-8):
  tokens/s per trainer phase (``time/<phase>``) and the training phase's model-FLOPs utilisation.
- ``mismatch``: rollout-vs-trainer routing disagreement, the embedded engine's bf16 copy on CUDA
  kernels against the fp32 trainer, on the shipped SFT start (``moe_rl.lab.mismatch.measure``).
- ``one_update``: design (e)'s GPU arm (``python -m studies.one_update --gpu-arm``, in its own
  process): GRPO' against GRPO + R3 one update at a time, the trainer in bf16 on CUDA, from the
  shipped start of design (b)'s cell. It needs 150 s or more: given less (what the 400 s leave), it
  is ``deferred`` to a call of its own (``--only one_update``), which its record names.

``--dry-run`` runs the same code on tiny shapes (CPU in CI, well under a minute).

    python -m tools.gpu_check                 # on the GPU: `make gpu-check` (docs/gpu_check.md)
    python -m tools.gpu_check --dry-run --out /tmp/x
    python -m tools.gpu_check --requirements  # the wheels `make gpu-wheels` downloads

Writes ``benchmarks/results/gpu_check-<machine>-<commit>.json`` + ``.png`` (``-dry`` after the
machine for a dry run; ``--out DIR`` elsewhere) with a top-level ``headline``, and copies the
JSON, the PNG and the pytest report into ``$OUT`` when it is set. SIGTERM (``make gpu-check``'s
``timeout``) ends the section in flight as an error and writes both; the exit status is 1 when a
section did not finish ok.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from tools.gpu_colocated import colocated_headline, section_colocated  # noqa: E402

ALGOS = ("grpo", "gspo", "gspo_token")
ROUTINGS = ("none", "r2", "r3")
SECTIONS = (
    "device",
    "tests",
    "rl_step",
    "moe_target",
    "colocated",
    "moe_1b",
    "kernels",
    "mismatch",
    "one_update",
)
"In the order of issue 'GPU truth': the standing check, then the target-regime MFU, then the rest."
SECTION_S = {
    "device": 20,
    "tests": 100,
    "rl_step": 45,
    "moe_target": 100,
    "colocated": 20,
    "moe_1b": 50,
    "kernels": 40,
    "mismatch": 25,
    "one_update": 240,
}
"""Each section's cap in seconds on the GPU (400 in all: `make gpu-check`'s budget, so that the first
call returns within 8 minutes with the machine's start and the install; the run's remaining budget
caps each too, so the last sections are the first to wait for the next GPU). In-process sections
check their cap between items (a mode, a kernel configuration, an RL step), so one long item can run
past it. ``one_update`` is beyond the 400 s: it takes what the others leave, and runs whole in a
call of its own (``--only one_update``, docs/gpu_check.md)."""
SECTION_MIN_S = {"one_update": 150}
"On the GPU, a section given less than this is deferred: its record names the call that runs it."
DRY_SECTION_S = {
    "device": 10,
    "tests": 40,
    "rl_step": 40,
    "moe_target": 30,
    "moe_1b": 30,
    "kernels": 30,
    "mismatch": 30,
    "colocated": 20,
    "one_update": 40,
}

# -- what the GPU machine lacks (`make gpu-wheels`) --------------------------------------------------
WHEELS_EXTRA = ("pytest", "pytest-timeout", "pip")
"What the check needs beyond pyproject's dependencies and build requirements (pip: a bootstrap)."
WHEELS_SKIP = ("torch", "triton", "megatron-core", "tensorboard", "numpy")
"""torch and triton: the GPU's own builds; megatron-core: downloaded without its dependencies (it
requires torch); tensorboard (the default train.loggers needs it) and numpy: on the lent image."""


def requirements(extra: tuple[str, ...] = ()) -> list[str]:
    """pyproject's dependencies and build requirements, less :data:`WHEELS_SKIP`, plus
    :data:`WHEELS_EXTRA` and ``extra``: what ``make gpu-wheels`` downloads for Python 3.12."""
    text = (ROOT / "pyproject.toml").read_text()
    reqs = []
    for key in ("dependencies", "requires"):
        block = re.search(rf"^{key} = \[(.*?)\]", text, re.M | re.S)
        reqs += re.findall(r'"([^"]+)"', block.group(1)) if block else []
    out = []
    for r in [*reqs, *WHEELS_EXTRA]:
        name = re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower()
        if name not in WHEELS_SKIP and r not in out:
            out.append(r)
    return out + [r for r in extra if r not in out]  # asked for: never skipped


# -- the run: sections, budget, atomic results ---------------------------------------------------------
class Check:
    """Sections run in order within one budget; the JSON is rewritten after each."""

    def __init__(self, out_dir: Path, dry: bool, budget_s: float, only: list[str] | None = None):
        from benchmarks.common import commit, machine

        self.dry, self.t0 = dry, time.perf_counter()
        self.deadline = self.t0 + budget_s
        self.machine, self.commit = machine(), os.environ.get("MOE_RL_COMMIT") or commit()
        part = "".join(f"-{name}" for name in only or ())  # a call of some sections: its own files
        stem = f"gpu_check-{self.machine}{'-dry' if dry else ''}{part}-{self.commit}"
        self.extra_files: list[Path] = []  # what a section wrote beside the JSON, copied to $OUT too
        out_dir.mkdir(parents=True, exist_ok=True)
        self.json_path, self.png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
        self.junit_path = out_dir / f"{stem}-pytest.xml"
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
        self.peak_flops = None  # section device's measured rate
        self.stopped = False  # SIGTERM (the make target's timeout): no further section
        self.doc: dict = {
            "benchmark": "gpu_check",
            "machine": self.machine,
            "commit": self.commit,
            "dry_run": dry,
            "budget_s": budget_s,
            "sections": {},
            "headline": {},
        }

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def run(self, name: str, fn: Callable[[Check, float], dict]) -> None:
        cap = min((DRY_SECTION_S if self.dry else SECTION_S)[name], self.left())
        rec: dict = {"status": "skipped", "seconds": 0.0}
        least = 5 if self.dry else max(5, SECTION_MIN_S.get(name, 0))
        if cap < least:
            rec["reason"] = f"budget: {self.left():.0f} s left of the run, {least} s needed"
            if name in SECTION_MIN_S:  # waits for a call of its own, which says so
                rec["status"] = "deferred"
                rec["reason"] += (
                    f'; make gpu-check GPU_CHECK_ARGS="--only {name}" GPU_CHECK_S={SECTION_S[name] + 30}'
                )
        else:
            print(f"== {name} (cap {cap:.0f} s)", flush=True)
            t0 = time.perf_counter()
            try:
                rec = {"status": "ok", **fn(self, cap)}
            except BaseException as e:  # recorded; the next section runs (KeyboardInterrupt too)
                rec = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
                # the whole chain: the first exception's frames are where it broke (a CUDA error
                # raised again while cleaning up would otherwise hide them)
                rec["traceback"] = traceback.format_exc().splitlines()[-150:]
                if isinstance(e, CheckFailed):
                    rec["partial"] = e.result
                print("\n".join(rec["traceback"]), flush=True)
                if isinstance(e, (SystemExit, Terminated)):
                    self.stopped = True
            rec["seconds"] = time.perf_counter() - t0
            print(f"== {name}: {rec['status']} in {rec['seconds']:.1f} s", flush=True)
        self.doc["sections"][name] = rec
        self.write()

    def write(self, final: bool = False) -> None:
        """The JSON (atomically; after every section), with ``final`` the PNG too; both to $OUT."""
        self.doc["wall_s"] = time.perf_counter() - self.t0
        self.doc["headline"] = headline(self.doc)
        atomic_write(self.json_path, json.dumps(self.doc, indent=1, default=str))
        if final:
            try:
                plot(self.doc, self.png_path)
            except Exception as e:  # the PNG is optional (matplotlib may be missing)
                self.doc["headline"]["png_error"] = f"{type(e).__name__}: {e}"[:300]
                atomic_write(self.json_path, json.dumps(self.doc, indent=1, default=str))
        out = os.environ.get("OUT")
        if out and Path(out).is_dir():
            for p in (self.json_path, self.png_path, self.junit_path, self.junit_path.with_suffix(".log"),
                      *self.extra_files):  # fmt: skip
                if p.exists():
                    shutil.copyfile(p, Path(out) / p.name)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def need_cuda(ck: Check) -> None:
    """The GPU sizes need CUDA: on CPU only the dry run's shapes run."""
    if device().type != "cuda" and not ck.dry:
        raise RuntimeError("this section's sizes need CUDA: use --dry-run on CPU")


def free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except RuntimeError as e:  # a sticky CUDA error (illegal access): the section's own error is the news
            print(f"free_cuda: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)


# -- a. device ----------------------------------------------------------------------------------------
def section_device(ck: Check, cap: float) -> dict:
    import platform

    import torch

    from benchmarks.common import matmul_rate

    dev = device()
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(dev),
    }
    for mod in ("triton", "megatron.core", "numpy"):
        try:
            out[mod] = __import__(mod, fromlist=["x"]).__version__
        except Exception as e:
            out[mod] = f"unavailable: {type(e).__name__}"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(
            name=p.name,
            capability=f"{p.major}.{p.minor}",
            memory_gib=p.total_memory / 2**30,
            multiprocessors=p.multi_processor_count,
        )
        n, dtype = (1024 if ck.dry else 8192), torch.bfloat16
    else:
        out["name"] = f"{platform.machine()} CPU, {os.cpu_count()} cores"
        n, dtype = (256 if ck.dry else 2048), torch.float32
    rate = matmul_rate(dev, n, dtype)
    ck.peak_flops = rate
    out.update(matmul={"n": n, "dtype": str(dtype).replace("torch.", ""), "tflops": rate / 1e12})
    free_cuda()
    return out


# -- b. tests/gpu --------------------------------------------------------------------------------------
def section_tests(ck: Check, cap: float) -> dict:
    import xml.etree.ElementTree as ET

    log = ck.junit_path.with_suffix(".log")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/gpu",
        "-v",
        "-rA",
        "-p",
        "no:cacheprovider",
        f"--junitxml={ck.junit_path}",
        f"--timeout={int(max(30, cap / 2))}",
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    ck.junit_path.unlink(missing_ok=True)  # never an earlier run's report
    timed_out = False
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=cap - 2
            ).returncode
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    tests, counts = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    if ck.junit_path.exists():
        for case in ET.parse(ck.junit_path).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    message = (el.get("message") or "")[:300]
                    break
            counts[outcome] += 1
            test_id = f"{case.get('classname')}::{case.get('name')}"
            tests.append(
                {
                    "id": test_id,
                    "outcome": outcome,
                    "seconds": float(case.get("time") or 0),
                    "message": message,
                }
            )
    else:  # cut short before pytest wrote its report: the -v lines of the tests that finished
        pattern = r"^(tests/gpu/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)"
        for test_id, outcome in re.findall(pattern, log.read_text(), re.M):
            outcome = {"FAILED": "failed", "ERROR": "error"}.get(outcome, outcome.lower())
            counts[outcome] += 1
            tests.append({"id": test_id, "outcome": outcome, "seconds": None, "message": ""})
    out = {"returncode": rc, "timed_out": timed_out, **counts, "tests": tests, "log": log.name}
    out["log_tail"] = log.read_text().splitlines()[-15:]
    if timed_out or not tests or counts["failed"] or counts["error"]:
        raise CheckFailed(f"pytest tests/gpu: {counts}, returncode {rc}, timed out {timed_out}", out)
    return out


class Terminated(BaseException):
    """SIGTERM arrived (``timeout`` in ``make gpu-check``): the section in flight records it, the
    JSON and PNG are written, and no further section starts."""


def _terminate(signum, frame):
    raise Terminated(f"signal {signum}: stopped by the run's time limit")


class CheckFailed(Exception):
    """A section that ran to its end and found something wrong: its measurements are kept."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


# -- c. rl_step (shared with tests/gpu/test_gpu_rl_step.py) --------------------------------------------
RL_KEYS = (
    "loss/pg",
    "grad_norm",
    "reward/mean",
    "adv/abs_mean",
    "entropy/mean",
    "flip/step/rate",
    "flip/rollout_vs_trainer/rate",
    "flip/rollout_vs_trainer/router_rate",
    "mismatch/abs_log_ratio",
    "weights/finite",
    "optim/skipped_updates",
    "time/step",
    "tokens_per_s",
)


def tiny_rl_recipe(
    out_dir: str | Path,
    algo: str = "gspo",
    routing: str = "none",
    *,
    algo_extra: dict | None = None,
    rollout: dict | None = None,
    **train,
):
    """The tiny policy (tests/tiny.py) on short arithmetic, RL stage only, on this process's device;
    ``algo_extra`` / ``rollout`` / ``train``: more keys of those sections."""
    from moe_rl.config import recipe_from_dict
    from tests.tiny import TINY_MODEL

    return recipe_from_dict(
        {
            "model": {**TINY_MODEL, "vocab_size": 104},  # the char tokenizer's vocabulary
            "optim": {"lr": 1e-3},
            "task": {"name": "arithmetic", "arithmetic": {"min_operands": 2, "max_operands": 2, "digits": 1}},
            "algo": {"name": algo, "routing": routing, **(algo_extra or {})},
            "rollout": dict(rollout or {}),
            "train": {
                "stages": ["rl"],
                "rl_steps": 1,
                "prompts_per_step": 2,
                "group_size": 8,
                "minibatches": 2,
                "max_new_tokens": 12,
                "eval_prompts": 4,
                "flip_probe_sequences": 2,
                "out_dir": str(out_dir),
                **train,
            },
        }
    )


def parity_reward(prompt, text: str) -> float:
    """A reward that differs within a group on a random policy (the parity of the text's CRC-32), so
    advantages and gradients are non-zero from the first step (all 8 samples of both prompts
    sharing a parity: p ~ 6e-5)."""
    import zlib

    return float(zlib.crc32(text.encode()) % 2)


def one_rl_step(out_dir: str | Path, algo: str, routing: str, **extra) -> dict:
    """One trainer ``rl_step`` of a fresh tiny run (embedded engine); its metrics (:data:`RL_KEYS`),
    which parameters the step moved (``moved``: routers and the rest, counted) and ``ok``: finite,
    a non-zero gradient, no skipped update, weights finite. ``extra``: :func:`tiny_rl_recipe`'s."""
    import torch

    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.run import Run
    from moe_rl.trainer.timer import StepTimer

    run = Run(tiny_rl_recipe(out_dir, algo, routing, **extra))
    try:
        run.task.reward = parity_reward
        run.ensure_engine()
        run.make_optimizer("rl")
        router_ids = {id(p) for r in run.policy.routers for p in r.parameters()}
        named = list(run.policy.model.named_parameters())
        before = [p.detach().clone() for _, p in named]
        result = rl_step(run, 0, StepTimer())
        moved = {"routers": [0, 0], "others": [0, 0]}  # [moved, all]
        for (_, p), b in zip(named, before):
            kind = moved["routers" if id(p) in router_ids else "others"]
            kind[0] += int(not torch.equal(p.detach(), b))
            kind[1] += 1
        device_name = str(next(run.policy.model.parameters()).device)
    finally:
        run.close()
    m = {k: result.metrics.get(k) for k in RL_KEYS}
    finite = all(v is None or math.isfinite(v) for v in m.values())
    ok = finite and m["grad_norm"] > 0 and m["optim/skipped_updates"] == 0 and m["weights/finite"] == 1
    return {"ok": bool(ok), "device": device_name, "moved": moved, **m}


EXTRA_MODES = {
    "grpo/r3+gates+noise": dict(
        algo="grpo",
        routing="r3",
        algo_extra={"replay_gate_weights": True},
        rollout={"route_noise": 0.5},
        route_noise=0.5,
    ),
    "gspo/r2+noise+jitter": dict(algo="gspo", routing="r2", route_noise=0.5, start_jitter=1e-7),
    "grpo/none+frozen_router": dict(algo="grpo", routing="none", freeze_router=True),
}
"""Issue 31's switches on CUDA, each with an effect :func:`extra_effect` checks: selection noise in
the engine and the trainer (per-device generators), R3 with the engine's gate weights replayed
(straight-through), a jittered start, the frozen-router parameter group."""


def extra_effect(name: str, res: dict, modes: dict) -> tuple[bool, str]:
    """Whether an :data:`EXTRA_MODES` run shows its switch's effect: under engine noise the engine's
    routes differ from the trainer's more than without it (its base mode); a frozen router stays
    bit for bit while every other weight moves; any other mode moves its routers."""
    moved = res["moved"]
    if name.endswith("frozen_router"):
        ok = moved["routers"][0] == 0 and moved["others"][0] == moved["others"][1]
        return ok, f"routers moved {moved['routers']}, others moved {moved['others']}"
    if not moved["routers"][0]:
        return False, f"routers moved {moved['routers']}"
    if "rollout" in EXTRA_MODES[name]:
        base = modes.get(name.split("+")[0], {}).get("flip/rollout_vs_trainer/rate")
        noisy = res.get("flip/rollout_vs_trainer/rate")
        ok = base is not None and noisy is not None and noisy > base
        return ok, f"rollout_vs_trainer flip rate {noisy} with engine noise, {base} without"
    return True, f"routers moved {moved['routers']}"


RESUME_KEYS = (
    "reward/mean",
    "loss/pg",
    "ratio/token_max",
    "grad_norm",
    "flip/step/rate",
    "response/len_mean",
)


def resume_check(out_dir: str | Path) -> dict:
    """2 RL steps in one run against 1 step, checkpoint, ``--resume`` to 2 steps (the trainer's
    ``run``): step 1's metrics and the final weights. ``ok``: equal (CPU: exactly; CUDA: metrics
    to 1e-4 relative and weights within a tenth of one Adam step, ``optim.lr``)."""
    from moe_rl.megatron.checkpoint import latest_checkpoint
    from moe_rl.trainer.metrics import read_metrics
    from moe_rl.trainer.run import run

    out_dir = Path(out_dir)
    ref = tiny_rl_recipe(out_dir / "ref", "grpo", "r2", rl_steps=2)
    cut1 = tiny_rl_recipe(out_dir / "cut", "grpo", "r2", rl_steps=1)
    cut2 = tiny_rl_recipe(out_dir / "cut", "grpo", "r2", rl_steps=2)
    run(ref)
    run(cut1)
    run(cut2, resume=True)
    rows = {}
    for name in ("ref", "cut"):
        steps = {r["step"]: r for r in read_metrics(out_dir / name / "metrics.jsonl", "rl")}
        rows[name] = steps
    exact = device().type == "cpu"
    diffs = {}
    for k in RESUME_KEYS:
        a, b = rows["ref"][1].get(k), rows["cut"][1].get(k)
        diffs[k] = None if a is None or b is None else abs(a - b) / max(abs(a), 1e-12)
    ckpts = [latest_checkpoint(out_dir / name / "checkpoints") for name in ("ref", "cut")]
    weights = final_weights(tiny_rl_recipe(out_dir / "compare"), ckpts)
    param_diff = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    lr = ref.optim.lr
    ok = (
        sorted(rows["cut"]) == [0, 1]
        and all(d is not None and (d == 0 if exact else d <= 1e-4) for d in diffs.values())
        and (param_diff == 0 if exact else param_diff <= 0.1 * lr)
    )
    return {
        "ok": bool(ok),
        "steps_after_resume": sorted(rows["cut"]),
        "step1_rel_diff": diffs,
        "max_abs_weight_diff": param_diff,
        "lr": lr,
    }


def final_weights(recipe, ckpts: list[Path]) -> list[dict]:
    """The model tensors of each checkpoint (fp32, CPU), loaded into one policy of ``recipe``."""
    from moe_rl.megatron.checkpoint import load_checkpoint
    from moe_rl.trainer.run import Run

    run = Run(recipe, write_recipe=False)
    try:
        out = []
        for ckpt in ckpts:
            load_checkpoint(ckpt, run.policy.model, load_rng=False)
            out.append(
                {
                    k: v.detach().float().cpu().clone()
                    for k, v in run.policy.model.state_dict().items()
                    if hasattr(v, "float")
                }
            )
        return out
    finally:
        run.close()


def section_rl_step(ck: Check, cap: float) -> dict:
    t_end = time.perf_counter() + cap
    modes, failed = {}, []

    def one(name: str, fn) -> None:
        if time.perf_counter() > t_end:
            modes[name] = {"ok": None, "skipped": "section budget"}
            return
        t0 = time.perf_counter()
        try:
            modes[name] = fn()
        except Exception as e:
            modes[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            modes[name]["traceback"] = traceback.format_exc().splitlines()[-8:]
        modes[name]["seconds"] = time.perf_counter() - t0
        if modes[name]["ok"] is False:
            failed.append(name)
        print(f"rl_step {name}: {modes[name]}", flush=True)

    def extra_mode(name: str, extra: dict) -> dict:
        res = one_rl_step(ck.work / "rl" / name.replace("/", "-"), **extra)
        ok, why = extra_effect(name, res, modes)
        return {**res, "effect_ok": ok, "effect": why, "ok": res["ok"] and ok}

    for algo in ALGOS:
        for routing in ROUTINGS:
            one(f"{algo}/{routing}", lambda a=algo, r=routing: one_rl_step(ck.work / "rl" / f"{a}-{r}", a, r))
    for name, extra in EXTRA_MODES.items():
        one(name, lambda n=name, x=extra: extra_mode(n, x))
    out = {"modes": modes}
    if time.perf_counter() < t_end:
        try:
            out["resume"] = resume_check(ck.work / "resume")
        except Exception as e:
            out["resume"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            out["resume"]["traceback"] = traceback.format_exc().splitlines()[-8:]
        print(f"resume: {out['resume']}", flush=True)
        if not out["resume"]["ok"]:
            failed.append("resume")
    else:
        out["resume"] = {"ok": None, "skipped": "section budget"}
    free_cuda()
    if failed:
        raise CheckFailed(f"rl_step failed: {', '.join(failed)}", out)
    return out


# -- d. the log-prob kernel table ------------------------------------------------------------------------
TILE_SWEEP = {(8192, 2048), (16384, 4096)}
"Configurations whose run also times the fused kernel at every tile of GPU_TILES (CUDA only)."
KERNEL_ORDER = ((8192, 2048), (32768, 4096), (16384, 4096), (32768, 2048), (16384, 2048), (8192, 4096))
"""Configurations in the order they run (each while the budget allows): the smallest first (it
warms torch.compile and Triton), then the largest (where the memory claim matters most), then the
rest. At the gpu preset's warmup 2 + iters 5 the full table is estimated at ~3-4 minutes on an
H100 / H200, torch.compile's compilations included, so its tail may be skipped under the cap."""


def section_kernels(ck: Check, cap: float) -> dict:
    import torch

    from benchmarks import kernels

    dev = device()
    t_end = time.perf_counter() + cap
    if ck.dry:
        # one small configuration, no torch.compile (a C++ toolchain on CPU), one timed call each
        smoke = {**kernels.PRESETS["smoke"], "v": 256, "warmup": 0, "iters": 1, "gspo_t": 16}
        cfg, todo, use_compile = smoke, [(32, 32)], False
    else:
        cfg, todo, use_compile = dict(kernels.PRESETS["gpu"]), list(KERNEL_ORDER), True
    need_cuda(ck)
    impls = kernels.make_impls(use_compile)
    rate = ck.peak_flops or kernels.bf16_rate(dev)
    runs, gspo, skipped, sweeps, per_unit = [], [], [], [], None
    for n, h in todo:
        # seconds per N x H of the last configuration; the first two also compile (torch.compile
        # specialises, then goes dynamic), so until then only a floor of 15 s left is asked
        estimate = 15.0 if per_unit is None else max(5.0, 1.2 * per_unit * n * h)
        if time.perf_counter() + estimate > t_end:
            skipped.append(f"{n}x{h}")
            continue
        t0 = time.perf_counter()
        try:
            run, g, sweep = kernels.bench_config(n, h, cfg, impls, dev, rate, tiles=(n, h) in TILE_SWEEP)
            if sweep:
                sweeps.append(tile_summary(sweep, run["derived"]))
        except Exception as e:  # recorded; the next configuration runs
            run = {"config": f"{n}x{h}", "n": n, "h": h, "error": f"{type(e).__name__}: {e}"[:500]}
            g = {"config": run["config"], "error": run["error"]}
            free_cuda()
        seconds = time.perf_counter() - t0
        if len(runs) >= 1:
            per_unit = seconds / (n * h)
        run["seconds"] = seconds
        runs.append(run)
        gspo.append(g)
        free_cuda()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "v": cfg["v"],
        "dtype": cfg["dtype"],
        "compile_baseline": use_compile,
        "targets": kernels.TARGETS,
        "runs": runs,
        "gspo": gspo,
        "skipped_for_budget": skipped,
        "tile_sweeps": sweeps,
    }


def tile_summary(sweep: dict, derived: dict) -> dict:
    """A tile sweep (``benchmarks.kernels.sweep_tiles``) with each tile's floor fractions and the
    fastest tile per pass against the default (``GPU_TILE``, the table's)."""
    from moe_rl.kernels.fused_logprob import GPU_TILE, GPU_TILES

    default = next(k for k, v in GPU_TILES.items() if v == GPU_TILE)
    out = {"config": sweep["config"], "default": default, "tiles": {}}
    for name, r in sweep.items():
        if name == "config":
            continue
        out["tiles"][name] = dict(r)
        for p in ("fwd", "fwd_bwd"):
            t = r.get(f"{p}_ms")
            if isinstance(t, float) and t > 0:
                out["tiles"][name][f"{p}_floor_fraction"] = derived[f"floor_{p}_ms"] / t
    for p in ("fwd", "fwd_bwd"):
        timed = {k: v[f"{p}_ms"] for k, v in out["tiles"].items() if isinstance(v.get(f"{p}_ms"), float)}
        if timed:
            best = min(timed, key=timed.get)
            out[f"best_{p}"] = {
                "tile": best,
                "ms": timed[best],
                "floor_fraction": derived[f"floor_{p}_ms"] / timed[best],
                "speedup_vs_default": timed.get(default, float("nan")) / timed[best],
            }
    return out


# -- d2. the training pass in the target regime ---------------------------------------------------------------
def section_moe_target(ck: Check, cap: float) -> dict:
    from benchmarks import moe_target

    need_cuda(ck)
    try:
        return moe_target.run(dry=ck.dry, peak_flops=ck.peak_flops, cap_s=cap)
    finally:
        free_cuda()


# -- e. a ~1B-parameter MoE RL step ------------------------------------------------------------------------
SMALL_1NODE = ROOT / "recipes/cluster/qwen3_moe_small_1node.yaml"
MOE_1B_LAYERS = 10
"""The 1B step: SMALL_1NODE's Qwen3-MoE shape (hidden 1024, 16 query / 4 key-value heads of 128, 64
experts top-8 of width 512, character vocabulary) at 10 of its 16 layers: 1.06B parameters, 0.18B
active per token."""


def moe_1b_model() -> dict:
    """The model section of the 1B step (SMALL_1NODE's, MOE_1B_LAYERS layers)."""
    from moe_rl.config import load_recipe, to_dict

    model = to_dict(load_recipe(SMALL_1NODE).model)
    return {**model, "num_layers": MOE_1B_LAYERS}


MOE_DRY = dict(
    vocab_size=104,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    moe_ffn_hidden_size=32,
    num_experts=8,
    moe_router_topk=4,
    max_seq_len=64,
)
MOE_TRAIN = dict(prompts_per_step=16, group_size=8, minibatches=2, max_new_tokens=128)
MOE_DRY_TRAIN = dict(prompts_per_step=2, group_size=2, minibatches=2, max_new_tokens=8)


def moe_recipe(out_dir: str | Path, dry: bool):
    from moe_rl.config import recipe_from_dict

    cuda = device().type == "cuda"
    return recipe_from_dict(
        {
            "model": {**(MOE_DRY if dry else moe_1b_model()), "dtype": "bfloat16" if cuda else "float32"},
            "optim": {"lr": 1e-5},
            "task": {"name": "arithmetic", "arithmetic": {"min_operands": 2, "max_operands": 4, "digits": 1}},
            "algo": {"name": "gspo", "routing": "none"},
            # the engine samples from the policy's own bf16 weights (router fp32, as the trainer's)
            "rollout": {"dtype": "bf16" if cuda else "fp32", "router_dtype": "fp32"},
            "train": {"stages": ["rl"], "out_dir": str(out_dir), **(MOE_DRY_TRAIN if dry else MOE_TRAIN)},
        }
    )


def param_counts(run) -> dict:
    """Total parameters, and active per token: expert weights x topk / experts, everything else
    once, the input embedding not at all (a lookup: no matmul FLOPs)."""
    m = run.recipe.model
    total = active = 0
    for name, p in run.policy.model.named_parameters():
        n = p.numel()
        total += n
        if ".experts." in name:
            active += n * m.moe_router_topk / m.num_experts
        elif "word_embeddings" not in name:
            active += n
    return {"total": total, "active": int(active)}


def section_moe_1b(ck: Check, cap: float) -> dict:
    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.run import Run
    from moe_rl.trainer.timer import StepTimer

    need_cuda(ck)
    t_end = time.perf_counter() + cap
    recipe = moe_recipe(ck.work / "moe", ck.dry)
    run = Run(recipe)
    steps = []
    try:
        run.task.reward = parity_reward
        run.ensure_engine()
        run.make_optimizer("rl")
        params = param_counts(run)
        for step in range(3):  # the first warms up (Triton, allocator); then timed while the budget allows
            if step > 0 and time.perf_counter() + 1.5 * steps[-1]["time/step"] > t_end:
                break
            sync()
            res = rl_step(run, step, StepTimer())
            sync()
            m = {k: v for k, v in res.metrics.items() if k.startswith("time/")}
            m["response_tokens"] = float(res.batch.mask_BT.sum())
            m["positions"] = float(res.batch.valid_BS.sum())
            m["sequences"] = res.batch.tokens_BT.shape[0]
            m["loss/pg"], m["grad_norm"] = res.metrics.get("loss/pg"), res.metrics.get("grad_norm")
            steps.append(m)
            print(f"moe_1b step {step}: {m}", flush=True)
        peak_mib = None
        import torch

        if torch.cuda.is_available():
            peak_mib = torch.cuda.max_memory_allocated() / 2**20
        profile = None
        if steps and time.perf_counter() + 2 * steps[-1]["time/train"] < t_end:
            try:
                profile = profile_train_pass(run, res.batch)
            except Exception as e:  # the steps' measurements stand without it
                profile = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"moe_1b profile: {profile}", flush=True)
    finally:
        run.close()
        free_cuda()
    timed = steps[1:] or steps
    last = timed[-1]
    per_phase = {}
    for phase in ("rollout", "old_logprob", "train", "probe", "sync", "step"):
        s = last.get(f"time/{phase}")
        if s is None:
            continue
        # rollout and the whole step: generated tokens (the trainer's tokens_per_s); the others:
        # every input position they compute (packed)
        tokens = last["response_tokens"] if phase in ("rollout", "step") else last["positions"]
        per_phase[phase] = {"seconds": s, "tokens": tokens, "tokens_per_s": tokens / s if s > 0 else None}

    def step_mfu(st: dict) -> float | None:
        t = st.get("time/train")
        return 6 * params["active"] * st["positions"] / t / ck.peak_flops if ck.peak_flops and t else None

    mfu = step_mfu(last)
    # every step after the first (which compiles and warms): a step's training time is mostly
    # per-pass overhead at these sizes, so its MFU moves with how many positions it happened to hold
    by_step = [
        {"positions": st["positions"], "time_train_s": st.get("time/train"), "mfu": step_mfu(st)}
        for st in steps[1:]
    ]
    return {
        "model": dict(recipe.model.__dict__),
        "train": {k: getattr(recipe.train, k) for k in (*MOE_TRAIN, "packing")},
        "params": params,
        "params_method": "active = expert weights x topk/num_experts + all other weights once; "
        "the input embedding excluded (a lookup)",
        "steps": steps,
        "timed_step": len(steps) - 1,
        "phases": per_phase,
        "train_mfu": mfu,
        "train_mfu_by_step": by_step,
        "mfu_method": "6 x active params x input positions trained (packed, every position once over "
        "the minibatches) / time/train / the device section's measured matmul rate; attention "
        "score FLOPs and the optimizer not counted",
        "peak_mib": peak_mib,
        "profile": profile,
    }


PROFILE_TOP = 12


def profile_train_pass(run, batch) -> dict:
    """One training forward + backward (the first micro-batch of the last step's first minibatch,
    packed as training packs it, natural routing) under ``torch.profiler``: wall time, the device's
    busy time (sum of its kernels' own time; CUDA only), kernel launches, and the top ops by
    self device time and by self host time. One pass, not a whole RL step: the first lease's
    whole-step profile outran the run's time limit in ``key_averages()``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction
    from moe_rl.trainer.rl import micro_batches, packed

    cfg = run.recipe.train
    rows = micro_batches(run, batch.lens_B, 0, batch.tokens_BT.shape[0] // cfg.minibatches)[0]
    tokens, mask = batch.tokens_BT[rows], batch.mask_BT[rows]

    def one_pass():
        pack = packed(run, tokens, batch.lens_B[rows])
        with RoutingSession(run.policy, RouterAction.NATURAL, pack=pack) as session:
            out = run.policy.logprobs(tokens, temperature=cfg.temperature, with_entropy=True, pack=pack)
            session.backward(-(out.logp_BT * mask).sum() / mask.sum())
        for p in run.policy.model.parameters():
            p.grad = None
        if hasattr(run.policy.model, "zero_grad_buffer"):
            run.policy.model.zero_grad_buffer()

    run.policy.train()
    one_pass()  # warm
    sync()
    t0 = time.perf_counter()
    one_pass()  # unprofiled: the profilers' own overhead is in their walls, not in this one
    sync()
    plain_wall = time.perf_counter() - t0
    host_python = python_profile(lambda: (one_pass(), sync()))
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        one_pass()
        sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()

    def self_device(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]

    def top(key) -> list[dict]:
        rows_ = sorted(events, key=key, reverse=True)[:PROFILE_TOP]
        return [
            {
                "name": e.key[:80],
                "count": e.count,
                "self_device_ms": self_device(e) / 1e3,
                "self_host_ms": e.self_cpu_time_total / 1e3,
            }
            for e in rows_
        ]

    busy_ms = sum(self_device(e) for e in kernels) / 1e3
    return {
        "rows": rows.stop - rows.start,
        "positions": int(batch.lens_B[rows].sum()),
        "wall_ms": wall * 1e3,
        "unprofiled_wall_ms": plain_wall * 1e3,
        "top_python": host_python,
        "device_busy_ms": busy_ms if cuda else None,
        "device_busy_fraction": busy_ms / (wall * 1e3) if cuda else None,
        "kernel_launches": sum(e.count for e in kernels) if cuda else None,
        "top_device": top(self_device) if cuda else [],
        "top_host": top(lambda e: e.self_cpu_time_total),
    }


def python_profile(fn, top: int = PROFILE_TOP) -> list[dict]:
    """The Python functions ``fn()`` spent its host time in (``cProfile``), the ``top`` by own
    time: where a host-bound pass goes between the ops ``torch.profiler`` sees."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})" if file != "~" else name,
            "calls": calls,
            "own_ms": own * 1e3,
            "cumulative_ms": cum * 1e3,
        }
        for (file, line, name), (_, calls, own, cum, _) in rows
    ]


# -- f. rollout-vs-trainer routing disagreement --------------------------------------------------------------
MISMATCH_CELLS = (("bf16", "same"), ("bf16", "fp32"))


def section_mismatch(ck: Check, cap: float) -> dict:
    from moe_rl.config import load_recipe
    from moe_rl.lab import mismatch
    from moe_rl.trainer.run import Run

    need_cuda(ck)
    t_end = time.perf_counter() + cap
    start = ROOT / "recipes" / "demo" / "start"
    recipe = load_recipe(
        ROOT / "recipes" / "demo" / "closest.yaml",
        [f"model.hf_path={start}", f"train.out_dir={ck.work / 'mismatch'}", "rollout.dtype=fp32"],
    )
    length, prompts, group = (8, 2, 2) if ck.dry else (256, 16, 8)
    run = Run(recipe)
    cells = {}
    try:
        for dtype, router in MISMATCH_CELLS:
            if cells and time.perf_counter() + 1.5 * max(c["seconds"] for c in cells.values()) > t_end:
                break
            t0 = time.perf_counter()
            cell = mismatch.measure(run, dtype, router, length, prompts, group)
            cell["seconds"] = time.perf_counter() - t0
            cells[f"{dtype}+router_{router}"] = cell
            print(f"mismatch {dtype} router {router}: flip/rate {cell.get('flip/rate')}", flush=True)
    finally:
        run.close()
        free_cuda()
    return {
        "model": "recipes/demo/start (the shipped SFT start: hidden 128, 4 layers, 8 experts top-2)",
        "trainer_dtype": recipe.model.dtype,
        "length": length,
        "prompts": prompts,
        "group": group,
        "cells": cells,
        "cpu_reference": "README: at most 0.30% of router decisions differ between a bf16 engine and "
        "the fp32 trainer on CPU (benchmarks/mismatch.py)",
        "r3_paper": mismatch.R3_PAPER,
    }


# -- g. design (e)'s GPU arm ----------------------------------------------------------------------------
ONE_UPDATE_START = ROOT / "recipes" / "demo" / "dial_start"
"Design (b)'s shipped MoE start (7 MiB, in the working tree that travels): the study's own cell."
ONE_UPDATE_STATES = 10
"States the GPU arm scores at most in its 240 s (a state run of 20 RL steps first)."


def section_one_update(ck: Check, cap: float) -> dict:
    """``python -m studies.one_update --gpu-arm`` in its own process (a study is run, never imported):
    GRPO' against GRPO + R3 one update at a time with the trainer in bf16 on CUDA, from the shipped
    start; its JSON + PNG kept beside this run's as ``one_update_gpu-<machine>-<commit>``."""
    root = ck.work / "one_update"
    log = ck.json_path.with_name(ck.json_path.stem + "-one_update.log")
    cmd = [sys.executable, "-m", "studies.one_update", "--gpu-arm", str(ONE_UPDATE_START), "--root", str(root),
           "--budget-s", f"{max(cap - 30, 10):.0f}"]  # fmt: skip
    cmd += (
        ["--smoke"]
        if ck.dry
        else ["--device", "cuda", "--dtype", "bfloat16", "--gpu-states", str(ONE_UPDATE_STATES)]
    )
    timed_out = False
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=cap).returncode
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    ck.extra_files.append(log)
    out = {
        "returncode": rc,
        "timed_out": timed_out,
        "log": log.name,
        "log_tail": log.read_text().splitlines()[-15:],
    }
    found = sorted(root.glob("one_update_gpu-*.json"))
    if rc != 0 or not found:
        raise CheckFailed(f"studies.one_update --gpu-arm: returncode {rc}, timed out {timed_out}", out)
    name = ck.json_path.stem.replace("gpu_check", "one_update_gpu", 1)
    for src in (found[-1], found[-1].with_suffix(".png")):
        if src.exists():
            dst = ck.json_path.with_name(name + src.suffix)
            shutil.copyfile(src, dst)
            ck.extra_files.append(dst)
    doc = json.loads(found[-1].read_text())
    start = str(ONE_UPDATE_START.relative_to(ROOT))
    return {**out, "start": start, "result": name + ".json", "headline": doc["headline"]}


SECTION_FNS = {
    "device": section_device,
    "colocated": section_colocated,
    "tests": section_tests,
    "rl_step": section_rl_step,
    "moe_target": section_moe_target,
    "kernels": section_kernels,
    "moe_1b": section_moe_1b,
    "mismatch": section_mismatch,
    "one_update": section_one_update,
}


# -- headline and picture ------------------------------------------------------------------------------------
def headline(doc: dict) -> dict:
    """The numbers one reads first, from whatever sections finished."""
    s = doc["sections"]
    h: dict = {"sections": {k: {"status": v["status"], "seconds": v.get("seconds")} for k, v in s.items()}}
    h["all_ok"] = bool(s) and all(v["status"] in ("ok", "deferred") for v in s.values())
    d = s.get("device", {})
    h["device"] = d.get("name")
    if "matmul" in d:
        h["matmul_tflops"] = d["matmul"]["tflops"]
        h["matmul_dtype"] = d["matmul"]["dtype"]
    c = _result(s.get("colocated"))
    if c:
        h["colocated"] = colocated_headline(c)
    t = _result(s.get("tests"))
    if t:
        h["tests"] = {k: t.get(k) for k in ("passed", "failed", "error", "skipped")}
    r = _result(s.get("rl_step"))
    if r:
        h["rl_step"] = {name: m.get("ok") for name, m in r.get("modes", {}).items()}
        h["rl_step"]["resume"] = r.get("resume", {}).get("ok")
    k = _result(s.get("kernels"))
    if k:
        h["kernels"] = {"targets": k.get("targets"), "skipped_for_budget": k.get("skipped_for_budget")}
        for run in k.get("runs", []):
            if "derived" not in run:
                h["kernels"][run["config"]] = {"error": run.get("error")}
                continue
            dv = run["derived"]
            h["kernels"][run["config"]] = {
                key: dv.get(f"{p}_{m}")
                for p in ("fwd", "fwd_bwd")
                for m in ("speedup_vs_naive", "memory_ratio_vs_naive", "floor_fraction")
                for key in [f"{p}_{m}"]
            }
            h["kernels"][run["config"]]["targets_met"] = dv.get("targets")
        for sw in k.get("tile_sweeps", []):
            h["kernels"][f"tiles {sw['config']}"] = {p: sw.get(f"best_{p}") for p in ("fwd", "fwd_bwd")}
    e = _result(s.get("moe_1b"))
    if e:
        h["moe_1b"] = {
            "params_total": e["params"]["total"],
            "params_active": e["params"]["active"],
            "tokens_per_s": {p: v["tokens_per_s"] for p, v in e.get("phases", {}).items()},
            "train_mfu": e.get("train_mfu"),
            "train_mfu_by_step": e.get("train_mfu_by_step"),
        }
        prof = e.get("profile") or {}
        if "wall_ms" in prof:
            h["moe_1b"]["train_pass_profile"] = {
                k: prof.get(k)
                for k in (
                    "positions",
                    "wall_ms",
                    "unprofiled_wall_ms",
                    "device_busy_fraction",
                    "kernel_launches",
                )
            }
    mt = _result(s.get("moe_target"))
    if mt:
        h["moe_target"] = {**mt.get("headline", {}), "not_measured": mt.get("not_measured")}
    f = _result(s.get("mismatch"))
    if f:
        h["rollout_vs_trainer"] = {
            name: {
                "flip_rate": c.get("flip/rate"),
                "router_rate": c.get("flip/router_rate"),
                "token_any": c.get("flip/token_any"),
                "k3": c.get("mismatch/k3"),
            }
            for name, c in f.get("cells", {}).items()
        }
    o = _result(s.get("one_update"))
    if o:
        oh = o.get("headline") or {}
        h["one_update"] = {
            k: oh.get(k) for k in ("Delta_R3", "states", "primary_minibatches", "cost_per_state")
        }
    return h


def _result(rec: dict | None) -> dict | None:
    """A section's measurements: its own when it finished, else what it kept before failing."""
    if not rec:
        return None
    if rec.get("status") == "ok":
        return rec
    return rec.get("partial")


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, s = doc["headline"], doc["sections"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    ax = axes[0][0]
    names = list(s)
    colors = {"ok": "tab:green", "error": "tab:red", "skipped": "tab:gray", "deferred": "tab:gray"}
    ax.barh(names, [s[n].get("seconds") or 0 for n in names], color=[colors[s[n]["status"]] for n in names])
    ax.invert_yaxis()
    ax.set(title="seconds per section (green ok, red error, grey skipped or deferred)", xlabel="s")
    ax = axes[0][1]
    kern = h.get("kernels", {})
    configs = [c for c in kern if "x" in c and isinstance(kern[c], dict)]
    metrics = [
        ("fwd_bwd_speedup_vs_naive", 2.0),
        ("fwd_bwd_memory_ratio_vs_naive", 4.0),
        ("fwd_bwd_floor_fraction", 0.6),
    ]
    for i, (m, target) in enumerate(metrics):
        vals = [kern[c].get(m) for c in configs]
        ys = [v / target if isinstance(v, (int, float)) else 0 for v in vals]
        ax.bar([j + i * 0.27 for j in range(len(configs))], ys, 0.27, label=f"{m} / {target}")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks([j + 0.27 for j in range(len(configs))], configs, rotation=20, fontsize=8)
    ax.set(title="fused log-prob kernel, fwd+bwd, over its target (>= 1 meets it)")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    moe = h.get("moe_1b", {})
    tps = {p: v for p, v in moe.get("tokens_per_s", {}).items() if v}
    ax.bar(list(tps), list(tps.values()))
    ax.set_yscale("log")
    mfu = moe.get("train_mfu")
    ax.set(
        title=f"~1B MoE RL step: tokens/s per phase (train MFU {mfu:.1%})"
        if mfu
        else "~1B MoE RL step: tokens/s per phase",
        ylabel="tokens/s",
    )
    ax = axes[1][1]
    f = _result(s.get("mismatch")) or {}
    for name, c in f.get("cells", {}).items():
        layers = sorted(int(k.rsplit("_", 1)[1]) for k in c if k.startswith("flip/layer_"))
        ax.plot(layers, [c[f"flip/layer_{i}"] for i in layers], marker="o", label=name)
    ax.set(title="rollout (engine) vs fp32 trainer: flip rate per layer", xlabel="layer")
    ax.legend(fontsize=8)
    t = h.get("tests", {})
    target = h.get("moe_target", {})
    mfu = target.get("mfu")
    fig.suptitle(
        f"gpu_check {doc['machine']} {doc['commit']}{' (dry run)' if doc['dry_run'] else ''}: "
        f"{h.get('matmul_tflops', 0):.3g} {h.get('matmul_dtype', '')} TFLOP/s; tests/gpu {t}"
        + (f"; target-regime MFU {mfu:.1%} ({target.get('layers')} layers)" if mfu else "")
    )
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (CI: CPU, < 60 s)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="result directory")
    ap.add_argument("--budget-s", type=float, default=None, help="whole run (default 400; dry run 120)")
    ap.add_argument("--only", nargs="*", choices=SECTIONS, help="these sections only")
    ap.add_argument(
        "--requirements", nargs="*", metavar="EXTRA", help="print the wheel requirements (+ EXTRA) and exit"
    )
    args = ap.parse_args(argv)
    if args.requirements is not None:
        print("\n".join(requirements(tuple(args.requirements))))
        return None
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    import torch

    if not torch.cuda.is_available():  # before triton's first import: kernels in its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import warnings

    warnings.filterwarnings("ignore")
    budget = args.budget_s or (120.0 if args.dry_run else 400.0)
    ck = Check(args.out, args.dry_run, budget, args.only)
    print(f"gpu_check: {ck.json_path} (budget {budget:.0f} s)", flush=True)
    import signal

    signal.signal(signal.SIGTERM, _terminate)
    for name in SECTIONS:
        if ck.stopped:
            break
        if args.only and name not in args.only:
            continue
        ck.run(name, SECTION_FNS[name])
    ck.write(final=True)
    shutil.rmtree(ck.work, ignore_errors=True)
    print(json.dumps(ck.doc["headline"], indent=1, default=str))
    print(f"wrote {ck.json_path}" + (f" and {ck.png_path}" if ck.png_path.exists() else " (no PNG)"))
    return ck.doc


def cli() -> None:
    """``main``; exit status 1 when a section did not finish ok (the JSON says which)."""
    doc = main()
    if doc is not None and not doc["headline"]["all_ok"]:
        sys.exit(1)


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(cli))
