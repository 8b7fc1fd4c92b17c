"""``moe-rl plan`` for colocated SGLang engines: every phase of a step on the shared GPUs, and the
host memory of a node.

The phases as :mod:`moe_rl.trainer.colocate` runs them. Per GPU, with E the engine's weights
(bytes of rollout.dtype x parameters / rollout.sglang.tp), P = rollout.sglang.mem_fraction x GPU
memory (SGLang's static pool: its weights and KV cache, so the KV cache is P - E), S the trainer's
weights + gradients + optimizer state, W its weights, B the push's buffers (one bucket of
:data:`PUSH_BUCKET_BYTES` and the largest full tensor a rank gathers, the embedding), and K what
the trainer keeps on the GPU through the engines' phases (nothing with
rollout.sglang.offload_trainer; else S, and in a push its gradients and optimizer state, K'):

    launch         P + K             the engines start (weights, KV cache, CUDA graphs), then release
    rollout        P + K             the trainer's state (weights too) waits on the host
    rollout>train  max(P + K, S)     the engines release everything, then the trainer's state is back
    train          the trainer's sum (weights, gradients, optimizer, activations: moe_rl.plan)
    train>push     max(S, W + E + K')  gradients and optimizer state leave, the engines' weights come
    push           W + E + B + K'    the weights alone (the KV cache waits for the next rollout)
    push>train     max(W + E + B + K', S)  the engines release their weights, the trainer's state is back

Every transition releases before it acquires, between barriers on every rank, so none holds more
than the larger of its two sides. A layout fits when every phase is within the plan's budget and
the KV cache P - E is positive.

Host memory per node (G trainer ranks there, one per GPU): each rank's pinned arena holds its
offloaded weights and optimizer state (the gradients are freed without a copy), W + O, and the
engines keep their weights in host memory while released (--enable-weights-cpu-backup), G x E:
G (W + O) + G E, which must be within 90% of the node's memory.
"""

from __future__ import annotations

from moe_rl.config import Recipe

GIB = 1024**3
USABLE = 0.9
"Share of GPU or host memory a plan may fill (moe_rl.plan's)."
PUSH_BUCKET_BYTES = 512 << 20
"The colocated push's bucket (TensorWeightSync's bucket_bytes)."
ROLLOUT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def engine_weight_bytes(r: Recipe, total_params: int) -> int:
    """E: one GPU's share of an engine's weights."""
    return int(ROLLOUT_BYTES[r.rollout_dtype] * total_params / r.rollout.sglang.tp)


def colocated_detail(r: Recipe, mem: dict, total_params: int, gpu_bytes: float) -> dict:
    """E, P, the KV cache P - E and B of the module docstring, per GPU."""
    m = r.model
    pool = int(r.rollout.sglang.mem_fraction * gpu_bytes)
    engine = engine_weight_bytes(r, total_params)
    largest = m.vocab_size * m.hidden_size * mem["dtype_bytes"]  # the embedding, gathered whole
    return {
        "engine_weights": engine,
        "engine_pool": pool,
        "kv_cache": pool - engine,
        "push_buffers": PUSH_BUCKET_BYTES + largest,
    }


def colocated_phases(r: Recipe, mem: dict, total_params: int, gpu_bytes: float) -> dict | None:
    """Per-GPU bytes of every phase and transition (module docstring), or None when the engines do
    not share the trainer's GPUs."""
    if not r.rollout.colocated:
        return None
    t, d = mem["terms"], colocated_detail(r, mem, total_params, gpu_bytes)
    state = t["weights"] + t["gradients"] + t["optimizer"]
    offload = r.rollout.sglang.offload_trainer
    kept, kept_push = (0, 0) if offload else (state, t["gradients"] + t["optimizer"])
    rollout = d["engine_pool"] + kept
    push = t["weights"] + d["engine_weights"] + d["push_buffers"] + kept_push
    return {
        "launch": rollout,
        "rollout": rollout,
        "rollout>train": max(rollout, state),
        "train": int(mem["total"]),
        "train>push": max(state, t["weights"] + d["engine_weights"] + kept_push),
        "push": push,
        "push>train": max(push, state),
    }


def host_per_node(r: Recipe, mem: dict, total_params: int, world: int, gpus_per_node: int) -> dict | None:
    """Host bytes of one node (module docstring), or None when nothing waits there."""
    if not r.rollout.colocated:
        return None
    t, ranks = mem["terms"], min(world, gpus_per_node)
    per_rank = t["weights"] + t["optimizer"] if r.rollout.sglang.offload_trainer else 0
    backup = ranks * engine_weight_bytes(r, total_params)
    return {
        "ranks": ranks,
        "trainer_per_rank": per_rank,
        "engine_backup": backup,
        "total": ranks * per_rank + backup,
    }


def colocated_refusal(r: Recipe, pl: dict, gpu_mem_gib: float, host_mem_gib: float) -> str | None:
    """Why a colocated layout does not fit (the phase, or the KV cache, or the node's host memory)
    and the setting that makes it fit; None when it fits. The trainer's own sum is moe_rl.plan's."""
    cfg, phases, d, host = r.rollout.sglang, pl["colocated"], pl["colocated_detail"], pl["host"]
    budget, gpu = pl["budget_bytes"], gpu_mem_gib * GIB
    over = {k: v for k, v in phases.items() if k != "train" and v > budget}
    if over:
        phase = max(("rollout", "push"), key=phases.get)
        head = (
            f"colocated with SGLang, the {phase} phase needs {phases[phase] / GIB:.1f} GiB per GPU, more than "
            f"{USABLE:.0%} of {gpu_mem_gib:g} GiB"
        )
        if phase == "rollout":
            room = (budget - (phases["rollout"] - d["engine_pool"])) / gpu
            tips = [f"lower rollout.sglang.mem_fraction to {room:.2f} or less"] if room > 0.05 else []
            if not cfg.offload_trainer:
                tips.append(
                    "set rollout.sglang.offload_trainer=true (the trainer's state waits in host memory)"
                )
            return (
                head + ": " + "; or ".join(tips or ["give the engines their own GPUs (rollout.sglang.gpus)"])
            )
        tips = [] if cfg.offload_trainer else ["set rollout.sglang.offload_trainer=true"]
        tips += ["raise rollout.sglang.tp (shards the engine's weights)", "or raise parallel.expert_parallel"]
        return head + " (trainer weights + the engine's copy + the push's buffers): " + "; ".join(tips)
    if d["kv_cache"] <= 0:
        need = (d["engine_weights"] + GIB) / gpu
        return (
            f"colocated with SGLang, rollout.sglang.mem_fraction={cfg.mem_fraction:g} x {gpu_mem_gib:g} GiB "
            f"holds no KV cache beside the engine's weights ({d['engine_weights'] / GIB:.1f} GiB per GPU at "
            f"tp {cfg.tp}): raise rollout.sglang.mem_fraction to {need:.2f} or more, or rollout.sglang.tp"
        )
    host_budget = USABLE * host_mem_gib * GIB
    if host is not None and host["total"] > host_budget:
        return (
            f"host memory per node: {host['ranks']} trainer ranks x {host['trainer_per_rank'] / GIB:.1f} GiB "
            f"offloaded + {host['engine_backup'] / GIB:.1f} GiB of the engines' weights = "
            f"{host['total'] / GIB:.0f} GiB, more than {USABLE:.0%} of {host_mem_gib:g} GiB (--host-mem-gib): "
            "raise parallel.data_parallel or parallel.expert_parallel (shards the optimizer state over more "
            "ranks), or set rollout.sglang.offload_trainer=false where the GPUs hold the trainer's state"
        )
    return None


def format_colocated(pl: dict) -> list[str]:
    """The plan's colocated lines (``moe-rl plan``)."""
    co, d, host = pl["colocated"], pl["colocated_detail"], pl["host"]
    lines = [
        f"colocated   SGLang on these GPUs, per GPU in each phase (engine weights {d['engine_weights'] / GIB:.1f} "
        f"GiB, KV cache {d['kv_cache'] / GIB:.1f} GiB of the {d['engine_pool'] / GIB:.1f} GiB pool, push "
        f"buffers {d['push_buffers'] / GIB:.1f} GiB; each within {pl['budget_bytes'] / GIB:.1f} GiB)"
    ]
    lines += [f"            {k:<14} {v / GIB:>8.1f} GiB" for k, v in co.items()]
    if host is not None:
        lines.append(
            f"host/node   {host['ranks']} ranks x {host['trainer_per_rank'] / GIB:.1f} GiB pinned (weights + "
            f"optimizer) + {host['engine_backup'] / GIB:.1f} GiB engines' weight backup = "
            f"{host['total'] / GIB:.1f} GiB of {pl['host_mem_gib']:g} GiB"
        )
    return lines
