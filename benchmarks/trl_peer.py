"""The TRL peer of benchmarks/throughput.py: GSPO RL steps with Hugging Face TRL's GRPOTrainer.

Runs inside .venv-trl (``bash benchmarks/trl_env.sh``), never in the main venv;
benchmarks/throughput.py starts it as a subprocess and reads the JSON it writes:

    .venv-trl/bin/python benchmarks/trl_peer.py --model DIR --out peer.json \
        --task '{"name": "arithmetic", ...}' --prompts-per-step 8 --group-size 8 \
        --minibatches 4 --max-new-tokens 48 --warmup 1 --steps 3 --threads 1

The policy is ``DIR``: the moe-rl policy exported with ``moe_rl.megatron.hf.export_hf``
(a transformers ``Qwen3MoeForCausalLM`` with the same weights, plus the character
tokenizer). One moe-rl RL step maps onto TRL's knobs as

- rollout batch P x G: ``num_generations=G``, ``generation_batch_size = P * G`` (the
  ``per_device_train_batch_size`` x ``steps_per_generation`` product);
- M minibatches (M optimizer steps per rollout batch): ``per_device_train_batch_size =
  P * G / M``, ``steps_per_generation=M``, ``gradient_accumulation_steps=1``,
  ``num_iterations=1``; TRL then recomputes pi_old log-probs after generation, as moe-rl does;
- GSPO: ``importance_sampling_level="sequence"``, ``loss_type="grpo"`` (TRL's own advice for
  the paper's per-sequence objective), ``epsilon=3e-4``, ``epsilon_high=4e-4``, ``beta=0``.

Prompts are the moe-rl task's own ``task.sample(step, P, task.seed)`` for steps 0, 1, ... (the
dataset is not shuffled, so TRL's generation batch k holds moe-rl's step k prompts), each
written as ``<bos>`` + text (token for token what moe-rl feeds its engine); the reward is
the task's ``reward``. One RL step is timed from the end of the previous cycle of M
optimizer steps to the end of this one; the first ``--warmup`` cycles are not counted.

Phases, timed inside the trainer (same definitions as moe-rl where TRL has them):
rollout = ``_generate_single_turn`` (transformers ``generate`` with its KV cache);
old_logprob = the rest of ``_generate_and_score_completions`` (pi_old forward, rewards,
advantages); train = everything else of the M optimizer steps (forward, backward, AdamW,
the trainer's bookkeeping). There is no weight sync: TRL generates with the training model.
Peak memory per phase: ``benchmarks.throughput.PeakMemory``, the meter moe-rl's side uses (CPU:
the process's peak RSS, Linux VmHWM reset before each phase through /proc/self/clear_refs; GPU:
``torch.cuda.max_memory_allocated`` reset per phase). CPU seconds are the process's
``time.process_time``; threads are set by ``--threads`` (intra-op) and 1 inter-op thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", required=True, help="HF Qwen3-MoE directory (export_hf output, with tokenizer)"
    )
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--task", required=True, help="the moe-rl TaskConfig as JSON")
    ap.add_argument("--prompts-per-step", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--minibatches", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=1, help="RL steps run before timing starts")
    ap.add_argument("--steps", type=int, default=3, help="timed RL steps")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    return ap.parse_args(argv)


def _dataset(task_json: dict, prompts_per_step: int, steps: int, bos: str):
    """moe-rl's prompts of steps 0..steps-1 of the task's prompt stream (``task.seed``) in order,
    the task that scores them, and that stream's seed."""
    from datasets import Dataset

    from moe_rl.config import build_dataclass
    from moe_rl.tasks import TaskConfig, build_task

    task_cfg = build_dataclass(TaskConfig, task_json, "task")
    task = build_task(task_cfg)
    rows, prompts = [], {}
    for step in range(steps):
        for i, p in enumerate(task.sample(step, prompts_per_step, task_cfg.seed)):
            key = f"{step}:{i}"
            prompts[key] = p
            rows.append({"prompt": bos + p.text, "key": key})
    return Dataset.from_list(rows), task, prompts, task_cfg.seed


def _trainer_class(base):
    """GRPOTrainer with phase timers around its own methods (no change to what they do)."""
    import torch

    class TimedGRPOTrainer(base):
        def _timer_init(self, mem, device: str):
            self.mem, self.dev = mem, device
            self.phases: list[dict] = []  # one per generation cycle
            self.cur: dict | None = None

        def _sync(self):
            if self.dev == "cuda":
                torch.cuda.synchronize()

        def _generate_single_turn(self, *args, **kwargs):
            self._sync()
            self.mem.reset()
            w0, c0 = time.perf_counter(), time.process_time()
            out = super()._generate_single_turn(*args, **kwargs)
            self._sync()
            completion_ids = out[0]
            self.cur.update(
                rollout_s=time.perf_counter() - w0,
                rollout_cpu_s=time.process_time() - c0,
                rollout_peak_mib=self.mem.peak_mib(),
                tokens=sum(len(c) for c in completion_ids),
                sequences=len(completion_ids),
            )
            self.mem.reset()
            return out

        def _generate_and_score_completions(self, inputs):
            self.cur = {}
            self._sync()
            w0, c0 = time.perf_counter(), time.process_time()
            out = super()._generate_and_score_completions(inputs)
            self._sync()
            c = self.cur
            c["generate_and_score_s"] = time.perf_counter() - w0
            c["old_logprob_s"] = c["generate_and_score_s"] - c["rollout_s"]
            c["old_logprob_cpu_s"] = time.process_time() - c0 - c["rollout_cpu_s"]
            c["old_logprob_peak_mib"] = self.mem.peak_mib()
            c["train_peak_mib"] = 0.0
            self.phases.append(c)
            self.mem.reset()
            return out

    return TimedGRPOTrainer


def _cycle_callback(trainer, m: int):
    """Wall and CPU time of every cycle of ``m`` optimizer steps, and the train-phase peak RSS."""
    from transformers import TrainerCallback

    class Cycles(TrainerCallback):
        def __init__(self):
            self.last = (time.perf_counter(), time.process_time())
            self.cycles: list[tuple[float, float]] = []

        def on_step_begin(self, args, state, control, **kw):
            if trainer.phases and state.global_step % m != 0:
                trainer.mem.reset()  # the first step of a cycle resets inside generation

        def on_step_end(self, args, state, control, **kw):
            trainer._sync()
            ph = trainer.phases[-1]
            ph["train_peak_mib"] = max(ph["train_peak_mib"], trainer.mem.peak_mib())
            if state.global_step % m == 0:
                now = (time.perf_counter(), time.process_time())
                self.cycles.append((now[0] - self.last[0], now[1] - self.last[1]))
                self.last = now

    return Cycles()


def _median(xs):
    return statistics.median(xs) if xs else None


def main(argv=None) -> dict:
    args = _parse(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    sys.path.insert(0, str(ROOT))
    from benchmarks.throughput import PeakMemory  # the meter moe-rl's side uses (imports only torch)

    mem = PeakMemory(args.device)
    b = args.prompts_per_step * args.group_size
    if b % args.minibatches:
        raise SystemExit(f"--minibatches={args.minibatches} must divide P x G = {b}")
    total = args.warmup + args.steps
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    data, task, prompts, stream = _dataset(json.loads(args.task), args.prompts_per_step, total, tok.bos_token)

    def reward(completions, key, **kw):
        return [task.reward(prompts[k], c) for c, k in zip(completions, key)]

    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=tmp,
            num_generations=args.group_size,
            per_device_train_batch_size=b // args.minibatches,
            steps_per_generation=args.minibatches,
            gradient_accumulation_steps=1,
            num_iterations=1,
            max_completion_length=args.max_new_tokens,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            importance_sampling_level="sequence",
            loss_type="grpo",
            epsilon=3e-4,
            epsilon_high=4e-4,
            beta=0.0,
            scale_rewards="group",
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            max_steps=args.minibatches * total,
            router_aux_loss_coef=0.0,
            gradient_checkpointing=False,
            bf16=False,
            use_cpu=args.device == "cpu",
            use_vllm=False,
            shuffle_dataset=False,
            dataloader_num_workers=0,
            report_to=[],
            logging_steps=10**9,
            save_strategy="no",
            disable_tqdm=True,
            seed=args.seed,
        )
        trainer = _trainer_class(GRPOTrainer)(
            model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok
        )
        trainer._timer_init(mem, args.device)
        cycles = _cycle_callback(trainer, args.minibatches)
        trainer.add_callback(cycles)
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    timed = [
        {**ph, "step_s": s, "step_cpu_s": c}
        for ph, (s, c) in list(zip(trainer.phases, cycles.cycles))[args.warmup :]
    ]
    for t in timed:
        t["train_s"] = t["step_s"] - t["generate_and_score_s"]
        t["train_cpu_s"] = t["step_cpu_s"] - t["rollout_cpu_s"] - t["old_logprob_cpu_s"]
    keys = [k for k in (timed[0] if timed else {}) if k.endswith(("_s", "_mib")) or k == "tokens"]
    result = {
        "peer": "trl.GRPOTrainer",
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "threads": torch.get_num_threads(),
        "device": args.device,
        "memory_meter": mem.method,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "settings": {
            "num_generations": args.group_size,
            "generation_batch_size": cfg.generation_batch_size,
            "per_device_train_batch_size": cfg.per_device_train_batch_size,
            "steps_per_generation": cfg.steps_per_generation,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "num_iterations": cfg.num_iterations,
            "max_completion_length": cfg.max_completion_length,
            "importance_sampling_level": cfg.importance_sampling_level,
            "loss_type": cfg.loss_type,
            "epsilon": cfg.epsilon,
            "epsilon_high": cfg.epsilon_high,
            "beta": cfg.beta,
            "temperature": cfg.temperature,
            "learning_rate": cfg.learning_rate,
            "gradient_checkpointing": cfg.gradient_checkpointing,
            "bf16": cfg.bf16,
            "use_vllm": cfg.use_vllm,
        },
        "task_seed": stream,  # the prompt stream _dataset sampled (task.seed)
        "train_seed": cfg.seed,  # the trainer's seed: its sampling
        "warmup_steps": args.warmup,
        "steps": timed,
        "median": {k: _median([t[k] for t in timed]) for k in keys},
        "wall_s": wall,
    }
    med = result["median"]
    if med.get("step_s"):
        result["tokens_per_s"] = med["tokens"] / med["step_s"]
        result["tokens_per_cpu_s"] = med["tokens"] / med["step_cpu_s"]
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result.get(k) for k in ("tokens_per_s", "tokens_per_cpu_s", "median")}, indent=1))
    return result


if __name__ == "__main__":  # run in TRL's own venv (benchmarks/trl_env.sh), which has no moe_rl
    main()
