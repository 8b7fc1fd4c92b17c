"""RL-step throughput of moe-rl per phase, routing-replay and flip-probe overheads, world-size
scaling, and Hugging Face TRL's GRPOTrainer (GSPO) on the same model, in one run.

    .venv/bin/python benchmarks/throughput.py --preset smoke --no-trl   # < 60 s (the unit test)
    bash benchmarks/trl_env.sh && .venv/bin/python benchmarks/throughput.py --preset cpu  # <= 20 min
    .venv/bin/python benchmarks/throughput.py --preset gpu                # on a CUDA machine

What one measured RL step is: the trainer's own step, ``moe_rl.trainer.rl.rl_step`` (what
``moe_rl.trainer.loop`` runs), timed by a subclass of the trainer's ``StepTimer`` that adds CPU
seconds and peak memory per phase, on the arithmetic task of recipes/demo/base.yaml, from a
random initialisation. Its phases are the trainer's own ``time/*`` phases:

- rollout: prompt sampling and ``engine.generate`` (embedded engine, KV cache, routes captured);
- old_logprob: rewards, advantages and the pi_old forward (+ R2 route recording);
- train: the M minibatch forward/backward + AdamW steps, without the flip probes;
- probe: the flip probes inside train (natural-routing forwards of the probe sequences);
- sync: ``engine.update_weights`` (embedded: a version bump, no copy);
- sync_hf: what an out-of-process engine would receive, in process: every weight gathered to
  its full HF tensor (``PolicyHFSource.hf_tensors``, collective over TP/EP) and copied into the
  policy through ``load_hf_tensors``; measured after the step, not part of it;
- step: rollout + old_logprob + train + probe + sync, the loop's ``time/step``.

Tokens are response tokens of the rollout batch (all data-parallel ranks); tokens/s of a phase
is those tokens over the phase's seconds (median over the timed steps). Every phase records wall
seconds and the CPU seconds of the process (summed over ranks in multi-process runs): on a
machine shared with other jobs the wall time swings, CPU seconds at a fixed thread count do not.
Peak memory per phase: CPU: peak RSS (Linux VmHWM, reset before each phase by writing 5 to
/proc/self/clear_refs; ``ru_maxrss`` where that is unavailable); GPU:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (max over ranks).

Every algorithm (grpo, gspo, gspo_token) x routing mode (none, r2, r3) runs interleaved on one
policy, each repeat at the same step index (the same prompts and sampling seeds), so replay and
probe overheads are ratios measured in the same run. Against TRL the headline reads paired rounds
(:func:`trl_rounds`): moe-rl's GSPO step and TRL's, each in a fresh process, back to back, each
round on prompts and sampling seeds of its own (:func:`round_draw`). World
size: ``torchrun --nproc-per-node 2`` runs this file as a worker with DP=2 (each rank its own lean-decoder engine and half the
prompts; gradients all-reduced), EP=2 (DP=2, experts split; the lean decoder all-gathers
them once per rollout; full steps) and TP=2: the embedded engine refuses
TP > 1, so the TP=2 worker replays the rollouts that the world-1 run generated at the same step
(recorded to a file) and measures old_logprob, train, probe and syncs only.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` and `moe_rl` importable
    sys.path.insert(0, str(ROOT))
from benchmarks.common import TINY_MODEL, positive_int, round_order  # noqa: E402
from benchmarks.throughput_report import (  # noqa: E402
    PHASES,
    headline,
    matmul_peak_flops,
    own_gemms_vs_floor,
    plot,
    scaling,
    step_floor,
    table,
    trl_ratio,
)
from moe_rl.lab.results import write_json  # noqa: E402
from moe_rl.trainer.timer import StepTimer  # noqa: E402

if TYPE_CHECKING:
    from moe_rl.config import Recipe
    from moe_rl.trainer.context import Run

ALGOS = ("grpo", "gspo", "gspo_token")
ROUTINGS = ("none", "r2", "r3")
# fmt: off
ARCH_SIZES = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim",
              "moe_ffn_hidden_size", "num_experts", "moe_router_topk")
"The size fields a preset model sets (the rest are ModelConfig's defaults)."
MODELS = {
    # the tiny CPU policy of recipes/demo/base.yaml (1.8M parameters), and a 20M-parameter MoE
    "tiny": {k: TINY_MODEL[k] for k in ARCH_SIZES},
    "small": dict(hidden_size=256, num_layers=6, num_attention_heads=8, num_query_groups=4, head_dim=32,
                  moe_ffn_hidden_size=256, num_experts=16, moe_router_topk=2),
}
MICRO = {  # the smoke preset's stand-ins, so that a test runs in seconds
    "tiny": dict(hidden_size=32, num_layers=2, num_attention_heads=2, num_query_groups=2, head_dim=16,
                 moe_ffn_hidden_size=32, num_experts=4, moe_router_topk=2),
    "small": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=16,
                  moe_ffn_hidden_size=64, num_experts=8, moe_router_topk=2),
}
GEMM_FLUSH_MIB = 64
"""The "cold" GEMM timing writes this much scratch memory before each timed call: inputs and
weights leave the core's L2 (2 MiB per core here), as a step that streams every expert through
each layer leaves them."""
WORLD_COMBOS = (("gspo", "none", "recompute"), ("gspo", "r2", "recompute"), ("gspo", "r3", "recompute"))
PRESETS = {
    "smoke": dict(models=MICRO, warmup=1, repeats=1, world=(), world_combos=(("gspo", "none", "recompute"),),
                  trl_models=("tiny",), trl_rounds=1, train=dict(prompts_per_step=2, group_size=4, minibatches=2,
                                                   max_new_tokens=8, flip_probe_sequences=3)),
    "cpu": dict(models=MODELS, warmup=1, repeats=3, world=("dp2", "ep2", "tp2"), world_combos=WORLD_COMBOS,
                trl_models=("tiny", "small"), trl_rounds=5, train=dict(prompts_per_step=8, group_size=8, minibatches=4,
                                                         max_new_tokens=48, flip_probe_sequences=3)),
    "gpu": dict(models=MODELS, warmup=2, repeats=5, world=("dp2", "ep2", "tp2"), world_combos=WORLD_COMBOS,
                trl_models=("tiny", "small"), trl_rounds=3, train=dict(prompts_per_step=32, group_size=8, minibatches=4,
                                                         max_new_tokens=256, flip_probe_sequences=3)),
}
"""Probes: ``flip_probe_sequences`` is TrainConfig's default (3), as a user's run has it. trl_rounds:
paired rounds of moe-rl's gspo/none step and TRL's, measured back to back (:func:`trl_rounds`)."""
LAYOUTS = {"ep2": dict(expert_parallel=2, data_parallel=2), "tp2": dict(tensor_parallel=2),
           "dp2": dict(data_parallel=2)}
TRL_VENV = ROOT / ".venv-trl"
NOTES = [
    "On a machine shared with other jobs, compare CPU seconds (tokens_per_cpu_s, ratio_cpu): wall "
    "seconds include time other processes held the cores (cpu_utilisation = CPU s / wall s of a step).",
    "sync is the embedded engine's update_weights (a version bump: weights are shared in process); "
    "sync_hf is the full HF-named gather + load an out-of-process engine would receive, not in the step.",
    "old_logprob (moe-rl and TRL alike) is collect minus generate: pi_old forward, rewards, advantages.",
    "CPU peak memory is peak RSS of the process during the phase: it includes ~0.5 GiB of libraries "
    "and memory the allocator kept from earlier phases, so phase-to-phase differences are small.",
    "TP=2 replays the world-1 run's rollouts of the same step (the embedded engine refuses TP > 1): "
    "its step is old_logprob + train + probe + sync and is compared with the world-1 step less rollout.",
    "World-size runs use 2 processes x --threads each; on a 2-core machine they compete with each other "
    "and with other jobs, so scaling < 1 measures overhead of the layout, not a speedup ceiling.",
]
# fmt: on


# -- meters ------------------------------------------------------------------------------------
def _proc_kib(field: str) -> int | None:
    try:
        m = re.search(rf"{field}:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


class PeakMemory:
    """Peak memory of one phase in MiB: CUDA allocator peak, or peak RSS (VmHWM reset per phase)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.start_mib = 0.0
        self.resettable = False
        if not self.cuda:
            try:
                Path("/proc/self/clear_refs").write_text("5")
                self.resettable = _proc_kib("VmHWM") is not None
            except OSError:
                pass
        self.method = (
            "torch.cuda.max_memory_allocated (reset per phase)"
            if self.cuda
            else "peak RSS: VmHWM reset per phase via /proc/self/clear_refs"
            if self.resettable
            else "peak RSS: ru_maxrss (process high-water, not reset per phase)"
        )

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.start_mib = torch.cuda.memory_allocated() / 2**20
            return
        if self.resettable:
            Path("/proc/self/clear_refs").write_text("5")
        self.start_mib = (_proc_kib("VmRSS") or 0) / 1024

    def peak_mib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        if self.resettable:
            return _proc_kib("VmHWM") / 1024
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """Wall seconds since construction (CUDA synchronised at both ends), for whole runs."""

    def __init__(self):
        _cuda_sync()
        self.w = time.perf_counter()

    def seconds(self) -> float:
        _cuda_sync()
        return time.perf_counter() - self.w


def _cuda_sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseMeter(StepTimer):
    """The trainer's StepTimer, measuring more per phase: CPU seconds beside wall seconds (CUDA
    synchronised at every reading) and peak memory. A nested phase (the probe inside train) is
    excluded from the enclosing phase's seconds by StepTimer; peaks are not additive, so the
    enclosing phase's peak covers its nested phases too."""

    def __init__(self, mem: PeakMemory):
        super().__init__()
        self.mem = mem
        self.peak_mib: dict[str, float] = {}
        self.start_mib: dict[str, float] = {}
        self._peaks: list[float] = []  # peak so far of every open phase, innermost last

    def read(self) -> dict[str, float]:
        _cuda_sync()
        return {"s": time.perf_counter(), "cpu_s": time.process_time()}

    def on_enter(self, phase: str) -> None:
        if self._peaks:  # the meter is reset below: keep the enclosing phase's peak so far
            self._peaks[-1] = max(self._peaks[-1], self.mem.peak_mib())
        self.mem.reset()
        self._peaks.append(0.0)
        self.start_mib.setdefault(phase, self.mem.start_mib)

    def on_exit(self, phase: str) -> None:
        peak = max(self._peaks.pop(), self.mem.peak_mib())
        self.peak_mib[phase] = max(self.peak_mib.get(phase, 0.0), peak)
        if self._peaks:
            self._peaks[-1] = max(self._peaks[-1], peak)

    def phases(self) -> dict[str, dict[str, float]]:
        """``{phase: {"s", "cpu_s", "peak_mib", "start_mib"}}`` of everything recorded."""
        return {
            p: {**t, "peak_mib": self.peak_mib[p], "start_mib": self.start_mib[p]}
            for p, t in self.totals.items()
        }


# -- engines for measurement --------------------------------------------------------------------
class KeepingEngine:
    """The run's engine, keeping (rollouts, prompt ids) of every call while ``keep`` is a list
    (the world-1 run records what the TP=2 worker replays)."""

    def __init__(self, inner):
        self.inner = inner
        self.keep: list | None = None

    def generate(self, prompts, n, sampling):
        out = self.inner.generate(prompts, n, sampling)
        if self.keep is not None:
            self.keep.append((out, [list(p) for p in prompts]))
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RecordedEngine:
    """Rollouts recorded by a world-1 run, served at the same step (TP > 1 has no embedded engine)."""

    def __init__(self, path: str):
        self.steps = torch.load(path, weights_only=False)
        self.step = 0
        self.weight_version = "0"

    def generate(self, prompts, n, sampling):
        rollouts, ids = self.steps[self.step]
        if [list(p) for p in prompts] != ids:
            raise RuntimeError(f"recorded rollouts of step {self.step} were made for other prompts")
        return rollouts

    def update_weights(self, source, version):
        self.weight_version = str(version)
        return self.weight_version

    def close(self):
        pass


# -- one RL step -------------------------------------------------------------------------------
STEP_PHASES = ("rollout", "old_logprob", "train", "probe", "sync")
"The phases of the trainer's step (``time/step``); sync_hf is measured after it, not part of it."


def bench_step(run: Run, step: int, mem: PeakMemory) -> dict:
    """One measured RL step: the trainer's own ``rl_step`` timed by a :class:`PhaseMeter`, then
    sync_hf (every weight gathered to its HF tensor and loaded back: what an out-of-process engine
    would receive; not part of the step)."""
    from moe_rl.dist import all_reduce
    from moe_rl.megatron.hf import PolicyHFSource
    from moe_rl.trainer.rl import rl_step

    replayed = isinstance(run.engine, RecordedEngine)
    if replayed:
        run.engine.step = step
    timer = PhaseMeter(mem)
    probe_positions = [0]

    def count_probe_positions(module, args, kwargs):  # the input positions of the probes' forwards
        if timer.phase == "probe":
            probe_positions[0] += (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).numel()

    counting = run.policy.model.register_forward_pre_hook(count_probe_positions, with_kwargs=True)
    try:
        batch = rl_step(run, step, timer).batch
    finally:
        counting.remove()
    with timer.record("sync_hf"):
        source = PolicyHFSource(run.policy)
        source.load_hf_tensors(source.hf_tensors())
    rec = timer.phases()
    if replayed:  # no generation happened: the TP=2 step has no rollout phase
        del rec["rollout"]
    rec["step"] = {k: sum(rec[p][k] for p in STEP_PHASES if p in rec) for k in ("s", "cpu_s")}

    def total(x: torch.Tensor) -> float:
        return float(all_reduce(x.double().cpu(), run.info.dp_group))

    rec["tokens"] = total(batch.mask_BT.sum())
    # every input position of every sequence (prompt + response - 1): the forward work of one pass
    rec["positions"] = total(batch.valid_BS.sum())
    # what a padded [B, T - 1] forward computes; packing (train.packing) computes only `positions`
    rec["padded_positions"] = total(torch.tensor(float(batch.valid_BS.numel())))
    rec["sequences"] = total(torch.tensor(float(batch.tokens_BT.shape[0])))
    # what the flip probes and the routing share feed the model (a routes-only forward counted whole)
    rec["probe_positions"] = total(torch.tensor(float(probe_positions[0])))
    return rec


def reduce_over_ranks(rec: dict) -> dict:
    """Seconds and peaks: max over ranks; CPU seconds: summed over ranks (a no-op in a world of one)."""
    from moe_rl import dist

    if dist.world_size() == 1:
        return rec
    keys = [(p, k) for p in PHASES if p in rec for k in rec[p]]
    vals = torch.tensor([rec[p][k] for p, k in keys], dtype=torch.float64)
    mx = dist.all_reduce(vals.clone(), op=dist.ReduceOp.MAX)
    sm = dist.all_reduce(vals.clone())
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in rec.items()}
    for i, (p, k) in enumerate(keys):
        out[p][k] = float(sm[i] if k == "cpu_s" else mx[i])
    return out


# -- a model preset: every combo, interleaved --------------------------------------------------
def build_recipe(
    model: dict,
    train: dict,
    parallel: dict | None = None,
    out_dir: str = "/tmp/moe_rl_tp",
    draw: int = 0,
):
    """The benchmark's recipe: recipes/demo/base.yaml with ``model``, ``train`` and ``parallel``
    overrides. ``draw`` d > 0: the d-th other prompt and sampling stream, ``task.seed`` + d and
    ``train.seed`` + d (the weights, drawn from ``model.seed``, stay the same)."""
    from moe_rl.config import load_recipe, recipe_from_dict, to_dict

    data = to_dict(load_recipe(ROOT / "recipes/demo/base.yaml"))
    data["model"].update(model, max_seq_len=max(128, 32 + train["max_new_tokens"]))
    data["train"].update(train, stages=["rl"], out_dir=out_dir, eval_every=0)
    data["optim"].update(lr=1e-5)
    data["parallel"].update(parallel or {})
    data["task"]["seed"] += draw
    data["train"]["seed"] += draw
    return recipe_from_dict(data)


def round_draw(r: int) -> int:
    """Round ``r``'s prompts and sampling (:func:`build_recipe`'s ``draw``) for both of its sides:
    fresh ones per round, never the in-run measurement's (draw 0). With one stream every round
    timed the same three steps' prompts and sampling noise, and a figure that depends on what a
    step draws (the probe rows are the first group's: 1.13x the batch's mean row length in those
    three steps; fresh prompts alone left it there, the responses' lengths following the sampling
    noise more than the prompts) was that draw's, not the trainer's."""
    return r + 1


def streams(recipe: Recipe) -> dict:
    """What a side of a round sampled: its prompt stream and its sampling seed."""
    return {"task_seed": recipe.task.seed, "train_seed": recipe.train.seed}


def combo_name(algo: str, routing: str, old: str) -> str:
    """``algo/routing``; ``algo/none+rollout_logp`` for pi_old taken from the engine's log-probs."""
    return f"{algo}/{routing}" + ("+rollout_logp" if old == "rollout" else "")


def measure(
    recipe: Recipe,
    combos,
    *,
    warmup: int,
    repeats: int,
    rollouts_in: str | None = None,
    rollouts_out: str | None = None,
    export_dir: str | None = None,
    own_gemms: tuple[str, str, str] | None = None,
) -> dict:
    """Run every (algo, routing, old_logprobs) combo ``warmup + repeats`` times, interleaved;
    per-step records. ``own_gemms``: a combo whose GEMMs one more step records, then timed alone
    (:mod:`benchmarks.gemm_floor`)."""
    from moe_rl.trainer.context import Run

    base = Run(recipe)
    try:
        if export_dir:
            from moe_rl.megatron.hf import export_hf

            export_hf(base.policy, export_dir, tokenizer=base.tok)  # the TRL peer starts from these weights
        base.make_optimizer("rl")
        mem = PeakMemory(base.info.device)
        if rollouts_in:
            run, keeping = base.derive(engine=RecordedEngine(rollouts_in), engine_gives_routes=True), None
        else:
            base.ensure_engine()
            keeping = KeepingEngine(base.engine)
            run = base.derive(engine=keeping)
        recorded = [] if rollouts_out else None
        steps: dict[str, list] = {combo_name(*c): [] for c in combos}
        for rep in range(warmup + repeats):
            for combo in combos:
                if keeping is not None:  # the TP=2 worker replays the first combo's
                    keeping.keep = recorded if combo == combos[0] else None
                rec = reduce_over_ranks(bench_step(combo_run(run, *combo), rep, mem))
                if rep >= warmup:
                    steps[combo_name(*combo)].append(rec)
        if rollouts_out and run.info.rank == 0:
            torch.save(recorded, rollouts_out)
        gemms = None
        if own_gemms:
            from benchmarks.gemm_floor import GemmRecorder, own_gemm_seconds

            with GemmRecorder() as gemm_calls:
                bench_step(combo_run(run, *own_gemms), warmup + repeats, mem)
            gemms = {
                "combo": combo_name(*own_gemms),
                "warm": own_gemm_seconds(gemm_calls),
                "cold": own_gemm_seconds(gemm_calls, flush_mib=GEMM_FLUSH_MIB),
                "flush_mib": GEMM_FLUSH_MIB,
            }
        params = sum(p.numel() for p in run.policy.parameters())
        info = {
            "world_size": run.info.world_size,
            "tp": run.info.tp_size,
            "ep": run.info.ep_size,
            "dp": run.info.dp_size,
            "parameters_per_rank": params,
            "memory_meter": mem.method,
        }
    finally:
        base.close()
    out = {"layout": info, "combos": {k: summarize(v) for k, v in steps.items()}}
    return {**out, "own_gemms": gemms} if gemms else out


def combo_run(run: Run, algo: str, routing: str, old: str) -> Run:
    """``run`` derived for one combo: its algo, routing and pi_old source (optimizer shared)."""
    from dataclasses import replace

    return run.derive(algo=replace(run.recipe.algo, name=algo, routing=routing, old_logprobs=old))


def summarize(steps: list[dict]) -> dict:
    """Median seconds, tokens/s (wall and CPU) and peak memory per phase over the timed steps."""
    med = statistics.median
    out = {"steps": len(steps), "tokens": med([s["tokens"] for s in steps]), "phases": {}}
    for k in ("positions", "sequences", "padded_positions", "probe_positions"):
        out[k] = med([s[k] for s in steps])
    out["padding_share"] = 1.0 - out["positions"] / out["padded_positions"]
    for p in PHASES:
        if p not in steps[0]:
            continue
        d = {k: med([s[p][k] for s in steps]) for k in steps[0][p]}
        d["tokens_per_s"] = med([s["tokens"] / s[p]["s"] for s in steps]) if d["s"] > 0 else None
        d["tokens_per_cpu_s"] = med([s["tokens"] / s[p]["cpu_s"] for s in steps]) if d["cpu_s"] > 0 else None
        if "peak_mib" in d:
            d["delta_mib"] = d["peak_mib"] - d["start_mib"]
        out["phases"][p] = d
    out["wall_s_per_step"] = [s["step"]["s"] for s in steps]
    out["positions_per_step"] = {k: [s[k] for s in steps] for k in ("positions", "probe_positions")}
    out["cpu_s_per_step"] = {p: [s[p]["cpu_s"] for s in steps] for p in PHASES if p in steps[0]}
    out["cpu_utilisation"] = out["phases"]["step"]["cpu_s"] / out["phases"]["step"]["s"]
    return out


def overheads(combos: dict) -> dict:
    """Routing-replay and flip-probe overheads, as ratios of medians from the same run."""
    out = {"replay": {}, "probe": {}}

    def sec(c, *ps, key="s"):
        return sum(combos[c]["phases"][p][key] for p in ps)

    for name in combos:
        algo, routing = name.split("/")
        out["probe"][name] = {
            "probe_over_train": sec(name, "probe") / sec(name, "train"),
            "probe_over_step": sec(name, "probe") / sec(name, "step"),
            "probe_over_train_cpu": sec(name, "probe", key="cpu_s") / sec(name, "train", key="cpu_s"),
        }
        base = f"{algo}/none"
        if routing in ROUTINGS and routing != "none" and base in combos:
            out["replay"][name] = {
                "old_logprob": sec(name, "old_logprob") / sec(base, "old_logprob"),
                "train": sec(name, "train") / sec(base, "train"),
                "old_logprob_plus_train": sec(name, "old_logprob", "train")
                / sec(base, "old_logprob", "train"),
                "old_logprob_plus_train_cpu": (
                    sec(name, "old_logprob", "train", key="cpu_s")
                    / sec(base, "old_logprob", "train", key="cpu_s")
                ),
                "step": sec(name, "step") / sec(base, "step"),
            }
    return out


# -- subprocesses: torchrun workers and the TRL peer -------------------------------------------
def _env(threads: int) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONWARNINGS": "ignore",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _flags(**kw) -> list[str]:
    """``--some-flag value`` pairs of keyword arguments."""
    return [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _child_json(cmd: list[str], out: Path, threads: int) -> dict:
    """Run ``cmd`` (a child writing its JSON to ``out``) at ``threads``; that JSON, or an error."""
    out.unlink(missing_ok=True)  # a path written again (a round, a peer): never read an earlier one's
    res = subprocess.run(cmd, cwd=ROOT, env=_env(threads), capture_output=True, text=True)
    if res.returncode != 0 or not out.exists():
        return {"error": f"exit {res.returncode}", "stderr_tail": res.stderr[-3000:]}
    return json.loads(out.read_text())


def run_world(layout: str, preset: str, threads: int, tmp: Path, rollouts: str | None) -> dict:
    """``torchrun --nproc-per-node 2`` this file as a worker at ``layout``; its JSON (or an error)."""
    out = tmp / f"world-{layout}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(Path(__file__).resolve()),
        *_flags(worker=layout, preset=preset, threads=threads, out=out),
    ]
    if layout == "tp2":
        cmd += ["--rollouts", rollouts]
    clock = Clock()
    data = _child_json(cmd, out, threads)
    if "error" not in data:
        data["wall_s"] = clock.seconds()
    return data


def run_round(model: str, preset: str, threads: int, tmp: Path, draw: int) -> dict:
    """moe-rl's side of a paired round (:func:`trl_rounds`): this file in a fresh process measuring
    ``model``'s gspo/none step at ``draw`` (:func:`build_recipe`), as the TRL peer runs in one; its
    combo record (with the :func:`streams` its run sampled) or an error."""
    out = tmp / f"round-{model}.json"
    flags = _flags(round=model, preset=preset, threads=threads, out=out, draw=draw)
    return _child_json([sys.executable, str(Path(__file__).resolve()), *flags], out, threads)


def round_worker(args) -> None:
    """The process of :func:`run_round`: a fresh run of ``args.round``'s recipe, gspo/none."""
    p = PRESETS[args.preset]
    run_dir = tempfile.mkdtemp(prefix="round_", dir=Path(args.out).parent)  # removed with the caller's folder
    recipe = build_recipe(p["models"][args.round], p["train"], out_dir=run_dir, draw=args.draw)
    res = measure(recipe, [("gspo", "none", "recompute")], warmup=p["warmup"], repeats=p["repeats"])
    write_json(Path(args.out), {**res["combos"]["gspo/none"], **streams(recipe)}, indent=None)


def worker(args) -> None:
    """One rank of a world-size run: the tiny model at ``args.worker``'s layout."""
    p = PRESETS[args.preset]
    recipe = build_recipe(
        p["models"]["tiny"], p["train"], LAYOUTS[args.worker], out_dir=tempfile.mkdtemp(prefix="tp_worker_")
    )
    res = measure(
        recipe,
        p["world_combos"],
        warmup=p["warmup"],
        repeats=p["repeats"],
        rollouts_in=args.rollouts if args.worker == "tp2" else None,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        if args.worker == "tp2":
            res["note"] = "rollouts replayed from the world-1 run's embedded engine (TP > 1 has none)"
        write_json(Path(args.out), res, indent=None)


def trl_rounds(res: dict, p: dict, preset: str, threads: int, tmp: Path, device: str) -> None:
    """``p["trl_rounds"]`` paired rounds per TRL model, into ``res["trl"][model]["rounds"]``: moe-rl's
    gspo/none step (a fresh run of the same recipe, the weights TRL starts from, in a fresh process
    as TRL's peer runs in one: :func:`run_round`) and TRL's peer, back to back, in alternating
    order (moe-rl first in even rounds), each ``warmup + repeats`` steps. The machine drifts over
    minutes (the same TRL step has moved 11% between runs, and a process that has built and run
    many policies steps a few % slower than a fresh one); a round's ratio compares two fresh
    processes seconds apart, and the rounds give the ratio's spread. Each round draws its own
    prompts and sampling seed (:func:`round_draw`), the same for both of its sides (each side
    reports what it sampled, :func:`streams`: a round whose sides differ is an error, not a ratio)."""
    for r in range(p.get("trl_rounds", 0)):
        draw = round_draw(r)
        for name in p["trl_models"]:
            if name not in res["models"] or "median" not in res["trl"].get(name, {}).get("peer", {}):
                continue
            recipe = build_recipe(p["models"][name], p["train"], draw=draw)
            sides = {
                "moe_rl": functools.partial(run_round, name, preset, threads, tmp, draw),
                "trl": functools.partial(
                    run_trl, name, str(tmp / f"hf-{name}"), recipe, p, threads, tmp, device
                ),
            }
            order = round_order(sides, r)
            got = {side: sides[side]() for side in order}
            peer = got["trl"]
            want = streams(recipe)
            row = {"first": order[0], **want, "error": peer.get("error") or got["moe_rl"].get("error")}
            sampled = {side: {k: got[side].get(k) for k in want} for side in sides}
            if not row["error"] and any(v != want for v in sampled.values()):
                row["error"] = f"round {r} sampled {sampled}, not {want} on both sides"
            if not row["error"] and "median" in peer and "phases" in got["moe_rl"]:
                ours = got["moe_rl"]
                vs = trl_ratio(ours, peer)
                row.update(
                    ratio_cpu=vs["ratio_cpu"],
                    ratio_cpu_without_flip_probe=vs["ratio_cpu_without_flip_probe"],
                    moe_rl_cpu_s_per_step=ours["cpu_s_per_step"],
                    moe_rl_tokens=ours["tokens"],
                    moe_rl_positions_per_step=ours["positions_per_step"],
                    trl_step_cpu_s=[s["step_cpu_s"] for s in peer["steps"]],
                    trl_tokens=peer["median"]["tokens"],
                )
            res["trl"][name].setdefault("rounds", []).append(row)
            print(f"[throughput] round {r + 1} {name}: {row.get('ratio_cpu')}", flush=True)


def run_trl(
    model: str, export_dir: str, recipe: Recipe, p: dict, threads: int, tmp: Path, device: str
) -> dict:
    """The TRL peer in .venv-trl on the exported policy; its JSON (or an error)."""
    from moe_rl.config import to_dict

    out = tmp / f"trl-{model}-{threads}t.json"
    t = recipe.train
    flags = _flags(
        model=export_dir,
        out=out,
        task=json.dumps(to_dict(recipe.task)),
        prompts_per_step=t.prompts_per_step,
        group_size=t.group_size,
        minibatches=t.minibatches,
        max_new_tokens=t.max_new_tokens,
        temperature=t.temperature,
        lr=recipe.optim.lr,
        warmup=p["warmup"],
        steps=p["repeats"],
        threads=threads,
        seed=t.seed,
        device=device,
    )
    return _child_json(
        [str(TRL_VENV / "bin" / "python"), str(ROOT / "benchmarks" / "trl_peer.py"), *flags], out, threads
    )


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    ap.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads of every process (default 1)"
    )
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/throughput-...json)")
    ap.add_argument("--models", nargs="*", default=None, help="model presets to run (default: all)")
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL peer")
    ap.add_argument(
        "--world",
        nargs="*",
        default=None,
        choices=sorted(LAYOUTS),
        help="world-size layouts to run with torchrun (default: the preset's; none: skip)",
    )
    ap.add_argument("--worker", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    ap.add_argument("--rollouts", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--round", choices=sorted(MODELS), help=argparse.SUPPRESS)
    ap.add_argument("--draw", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _header(args, p: dict, device: str) -> dict:
    import megatron.core

    from benchmarks.common import commit, machine

    return {
        "bench": "throughput",
        "preset": args.preset,
        "machine": machine(),
        "commit": commit(),
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "device": device,
        "threads": torch.get_num_threads(),
        "loadavg_1m_start": os.getloadavg()[0],
        "settings": {
            **p["train"],
            "warmup_steps": p["warmup"],
            "timed_steps": p["repeats"],
            "trl_rounds": p.get("trl_rounds", 0),
            "algos": ALGOS,
            "routings": ROUTINGS,
            "world_combos": p["world_combos"],
            "init": "random (model.seed)",
            "lr": 1e-5,
            "old_logprobs": "recompute (every combo but gspo/none+rollout_logp: the engine's log-probs)",
            "recipe": "recipes/demo/base.yaml",
        },
        "units": "seconds and CPU seconds are medians over timed steps; tokens = response tokens of the "
        "rollout batch; peak_mib per phase (see memory_meter); sync_hf is not part of step",
        "notes": NOTES,
        "models": {},
        "world": {},
        "trl": {},
    }


def main(argv=None) -> dict:
    import logging
    import warnings

    args = _parse(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args)
        return {}
    if args.round:
        round_worker(args)
        return {}
    from benchmarks.common import result_path

    p = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = _header(args, p, device)
    path = result_path("throughput", args.preset, args.out)  # named by the commit measured, at the start
    clock = Clock()
    res["matmul_peak"] = matmul_peak_flops(torch.get_num_threads(), device)
    want_trl = not args.no_trl and (TRL_VENV / "bin" / "python").exists()
    world = p["world"] if args.world is None else tuple(args.world)
    if world and device == "cuda" and torch.cuda.device_count() < 2:
        res["world_skipped"], world = "needs 2 GPUs", ()
    # + GSPO with pi_old = the embedded engine's own log-probs (algo.old_logprobs=rollout: same
    # weights, same arithmetic, no old-policy forward)
    combos = [(a, g, "recompute") for a in ALGOS for g in ROUTINGS] + [("gspo", "none", "rollout")]
    with tempfile.TemporaryDirectory(prefix="throughput_") as tmpdir:
        tmp = Path(tmpdir)
        for name, dims in p["models"].items():
            if args.models and name not in args.models:
                continue
            export = str(tmp / f"hf-{name}") if want_trl and name in p["trl_models"] else None
            rollouts = str(tmp / "rollouts.pt") if name == "tiny" and "tp2" in world else None
            t0 = Clock()
            d = measure(
                build_recipe(dims, p["train"], out_dir=str(tmp / f"run-{name}")),
                combos,
                warmup=p["warmup"],
                repeats=p["repeats"],
                rollouts_out=rollouts,
                export_dir=export,
                own_gemms=("gspo", "none", "recompute"),
            )
            d.update(config=dims, overheads=overheads(d["combos"]), wall_s=t0.seconds())
            vocab = build_recipe(dims, p["train"]).model.vocab_size
            d["floor"] = step_floor(d["combos"]["gspo/none"], dims, vocab, res["matmul_peak"], None)
            d["floor"]["own_gemms"] = own_gemms_vs_floor(d["own_gemms"], d["combos"]["gspo/none"], d["floor"])
            res["models"][name] = d
            print(f"[throughput] {name}: {d['wall_s']:.0f} s", flush=True)
        if "tiny" in res["models"]:
            for layout in world:
                d = run_world(layout, args.preset, args.threads, tmp, str(tmp / "rollouts.pt"))
                d["scaling_vs_world1"] = scaling(d, res["models"]["tiny"]["combos"])
                res["world"][layout] = d
                print(
                    f"[throughput] world {layout}: {d.get('wall_s', 0):.0f} s {d.get('error', '')}",
                    flush=True,
                )
        for name in p["trl_models"] if want_trl else ():
            if name not in res["models"]:
                continue
            recipe = build_recipe(p["models"][name], p["train"])
            t0 = Clock()
            peer = run_trl(name, str(tmp / f"hf-{name}"), recipe, p, args.threads, tmp, device)
            ours = res["models"][name]["combos"]
            vs = trl_ratio(ours["gspo/none"], peer) if "median" in peer else None
            if vs is not None:
                vs["with_rollout_logprobs"] = trl_ratio(ours["gspo/none+rollout_logp"], peer)
                vs["floor"] = step_floor(
                    ours["gspo/none"],
                    p["models"][name],
                    recipe.model.vocab_size,
                    res["matmul_peak"],
                    peer["median"],
                )
            res["trl"][name] = {"peer": peer, "vs": vs, "wall_s": t0.seconds()}
            print(
                f"[throughput] TRL {name}: {res['trl'][name]['wall_s']:.0f} s {peer.get('error', '')}",
                flush=True,
            )
        if want_trl:
            trl_rounds(res, p, args.preset, args.threads, tmp, device)
        if want_trl and "dp2" in res["world"] and "combos" in res["world"]["dp2"] and "tiny" in res["models"]:
            # the whole machine: moe-rl DP=2 (2 processes x --threads) vs TRL at 2 x --threads
            recipe = build_recipe(p["models"]["tiny"], p["train"])
            peer = run_trl("tiny", str(tmp / "hf-tiny"), recipe, p, 2 * args.threads, tmp, device)
            dp2 = res["world"]["dp2"]["combos"]["gspo/none"]
            vs = trl_ratio(dp2, peer) if "median" in peer else None
            res["trl_whole_machine"] = {"peer": peer, "moe_rl": "dp2 (2 processes)", "vs": vs}
            print(f"[throughput] TRL tiny at {2 * args.threads} threads {peer.get('error', '')}", flush=True)
    if not want_trl:
        res["trl_skipped"] = "--no-trl" if args.no_trl else "no .venv-trl: bash benchmarks/trl_env.sh"
    res["wall_s"], res["loadavg_1m_end"] = clock.seconds(), os.getloadavg()[0]
    res["headline"] = headline(res)
    write_json(path, res, newline=True)
    plot(res, path.with_suffix(".png"))
    print(table(res))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return res


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
