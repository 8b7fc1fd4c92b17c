"""``moe-rl plan RECIPE``: parallel layout, parameter counts and per-GPU memory, without GPUs.

Every number comes from the recipe alone (no model is built). Symbols: V vocab, h hidden,
L layers, q query heads, g key/value groups, d head_dim, E experts, K top-k, f expert
intermediate width; TP / EP / DP the recipe's layout (expert tensor parallelism is 1, as in
moe_rl.megatron.parallel).

Parameters (exact for the megatron-core policy moe_rl.megatron.model.build_gpt builds)
    embedding   V h                      output layer V h (0 when tie_embeddings)
    attention   L (q + 2g) d h + L q d h (fused QKV and output projection, no biases)
    router      L E h
    experts     L E 3 f h                (SwiGLU: fc1 is h -> 2f, fc2 is f -> h)
    norms       L (2h + 2d) + h          (input, pre-MLP, q/k norms; final norm)
    active per token: the same with K experts in place of E (the router still scores all E).

Per-GPU memory (bytes) of the P parameters this GPU holds (P_e of them experts), b = bytes of
model.dtype, s = 8 (+ 4 in bf16) optimizer bytes per parameter (Adam m and v in fp32, plus the fp32
main copy of bf16 weights)
    weights     P b
    gradients   P 4                      (megatron-core DDP's grad buffer, fp32 with
                                          optim.grad_reduce_in_fp32, else P b; never sharded)
    optimizer   (P - P_e) s / D + P_e s / D_e
                                         with megatron-core's distributed optimizer
                                         (optim.distributed; auto = on where DP > 1) D = DP and
                                         D_e = expert-DP (experts' state is sharded over the ranks
                                         holding the same experts); without it D = D_e = 1
    activations max(train, old-logprob forward), per token of one forward (N tokens):
        layer    a = b (6h + 2(q + g) d + K (2h + 3f)) / TP + 4E   (norm in/out, QKV, attention
                 out, projection, residual; K routed copies of the expert input, fc1, SwiGLU and
                 fc2 outputs; fp32 router scores); sequence parallelism divides by TP
        logits   c = V/TP (b + 12)       (logits in b, fp32 scaled logits, probabilities, gradient)
        train    N (L a + 3hb/TP + c)    without recompute;
                 N (L hb/TP + a + 3hb/TP + c) with model.recompute (layer inputs + one layer)
        pi_old   N' (a + c)              no-grad forward over the whole local rollout batch
        N  = sequences per update on one rank x max_seq_len (the largest of the SFT share
             sft_batch_size / DP and the RL share prompts x G / (minibatches x DP))
        N' = prompts x G / DP x max_seq_len (RL only)
        (plan(micro_batch=n) / --micro-batch n: n x max_seq_len for both, as a micro-batching trainer)
    A layout fits when the sum is at most 90% of the GPU's memory (the rest is the CUDA
    context, NCCL buffers and allocator fragmentation). KV cache is SGLang's business on its own GPUs.

Colocated SGLang engines (rollout.sglang.colocate) share the trainer's GPUs: every phase and
transition of a step must fit, the KV cache must have room beside the engine's weights, and the
node's host memory must hold what waits there (moe_rl.plan_colocated).

Per step: routing-replay bytes = rollout tokens x L x K x itemsize
(moe_rl.routing.codec.route_bytes_per_token); weight sync = bf16 full model (2 bytes x total).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

from moe_rl.argparsing import ArgParser, int_at_least, number_in, one_line_errors
from moe_rl.config import ConfigError, ParallelConfig, Recipe, load_recipe
from moe_rl.plan_colocated import (
    colocated_detail,
    colocated_phases,
    colocated_refusal,
    format_colocated,
    host_per_node,
)

GIB = 1024**3
USABLE = 0.9
"Share of GPU memory a plan may fill."


class PlanError(ConfigError):
    """The layout cannot fit; the message names the largest term and what to change."""


def param_counts(m, *, tp: int = 1, ep: int = 1) -> dict[str, int]:
    """Parameters by component for the whole model (tp = ep = 1) or one GPU's shard."""
    h, d = m.hidden_size, m.head_dim
    emb = m.vocab_size * h // tp
    out = 0 if m.tie_embeddings else emb
    attn = (
        m.num_layers
        * ((m.num_attention_heads + 2 * m.num_query_groups) * d * h + m.num_attention_heads * d * h)
        // tp
    )
    router = m.num_layers * m.num_experts * h
    experts = m.num_layers * (m.num_experts // ep) * 3 * m.moe_ffn_hidden_size * h
    norms = m.num_layers * (2 * h + (2 * d if m.qk_norm else 0)) + h
    c = {
        "embedding": emb,
        "output": out,
        "attention": attn,
        "router": router,
        "experts": experts,
        "norms": norms,
    }
    c["total"] = sum(c.values())
    return c


def active_params(m) -> int:
    """Parameters one token passes through: K of the E experts per layer."""
    c = param_counts(m)
    return (
        c["total"]
        - c["experts"]
        + m.num_layers * m.moe_router_topk * 3 * m.moe_ffn_hidden_size * m.hidden_size
    )


def layout(p: ParallelConfig) -> dict[str, int]:
    """The process layout; expert-DP = TP x DP / EP (megatron-core with expert-TP 1)."""
    return {
        "world": p.world_size,
        "tp": p.tensor_parallel,
        "pp": p.pipeline_parallel,
        "dp": p.data_parallel,
        "ep": p.expert_parallel,
        "expert_tp": 1,
        "expert_dp": p.tensor_parallel * p.data_parallel // p.expert_parallel,
    }


def distributed_optimizer(r: Recipe, p: ParallelConfig) -> bool:
    """``optim.distributed`` resolved as moe_rl.megatron.optim does: auto is on where DP > 1."""
    return r.optim.distributed is True or (r.optim.distributed == "auto" and p.data_parallel > 1)


def _tokens_per_forward(r: Recipe, dp: int, micro_batch: int | None) -> tuple[int, int, int]:
    """(sequences per training forward, tokens per training forward, tokens of the pi_old forward)."""
    t, s = r.train, r.model.max_seq_len
    if micro_batch is not None:
        return micro_batch, micro_batch * s, (micro_batch * s if "rl" in t.stages else 0)
    seqs = 0
    if "sft" in t.stages:
        seqs = max(seqs, math.ceil(t.sft_batch_size / dp))
    rollout_seqs = math.ceil(t.prompts_per_step * t.group_size / dp) if "rl" in t.stages else 0
    if rollout_seqs:
        seqs = max(seqs, math.ceil(rollout_seqs / t.minibatches))
    return seqs, seqs * s, rollout_seqs * s


def memory(r: Recipe, p: ParallelConfig, micro_batch: int | None = None) -> dict:
    """Per-GPU bytes of each term (module docstring) for recipe ``r`` under layout ``p``."""
    m, tp = r.model, p.tensor_parallel
    b = 2 if m.dtype == "bfloat16" else 4
    shard = param_counts(m, tp=tp, ep=p.expert_parallel)
    n = shard["total"]
    h, d, q, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    k, f, e = m.moe_router_topk, m.moe_ffn_hidden_size, m.num_experts
    layer = b * (6 * h + 2 * (q + g) * d + k * (2 * h + 3 * f)) / tp + 4 * e
    logits = m.vocab_size / tp * (b + 12)
    edge = 3 * h * b / tp
    kept = m.num_layers * h * b / tp + layer if m.recompute else m.num_layers * layer
    seqs, n_train, n_old = _tokens_per_forward(r, p.data_parallel, micro_batch)
    train = n_train * (kept + edge + logits)
    old = n_old * (layer + logits)
    state = 8 + (4 if b == 2 else 0)
    sharded = distributed_optimizer(r, p)
    dp, edp = (p.data_parallel, layout(p)["expert_dp"]) if sharded else (1, 1)
    terms = {
        "weights": n * b,
        "gradients": n * (4 if r.optim.grad_reduce_in_fp32 else b),
        "optimizer": (n - shard["experts"]) * state / dp + shard["experts"] * state / edp,
        "activations": max(train, old),
    }
    return {
        "terms": {kk: int(v) for kk, v in terms.items()},
        "total": int(sum(terms.values())),
        "params_per_gpu": shard,
        "dtype_bytes": b,
        "optimizer_sharding": {"distributed": sharded, "dense_over": dp, "experts_over": edp},
        "sequences_per_forward": seqs,
        "tokens_per_forward": n_train,
        "old_logprob_tokens": n_old,
        "activation_bytes_per_token": {
            "layer": int(layer),
            "logits": int(logits),
            "train": int(kept + edge + logits),
        },
        "activation_peak": "train" if train >= old else "old_logprob",
    }


def _suggest(r: Recipe, p: ParallelConfig, mem: dict, budget: float, micro_batch: int | None) -> str:
    """What to change, naming the largest term and a concrete layout that would fit."""
    terms, shard = mem["terms"], mem["params_per_gpu"]
    big = max(terms, key=terms.get)
    if big == "activations":
        if mem["activation_peak"] == "old_logprob":
            where = (
                f"the no-grad pi_old forward over {mem['old_logprob_tokens']:,} tokens (this rank's rollouts)"
            )
            tips = [
                "lower train.prompts_per_step x train.group_size per data-parallel rank (or raise "
                "parallel.data_parallel)"
            ]
        else:
            where = f"the training forward over {mem['tokens_per_forward']:,} tokens"
            tips = [] if r.model.recompute else ["set model.recompute=true"]
            tips += ["raise train.minibatches or parallel.data_parallel (fewer sequences per forward)"]
        tips += ["lower model.max_seq_len", "raise parallel.tensor_parallel (shards the logits)"]
        return f"activations ({terms[big] / GIB:.1f} GiB, {where}) are the largest term: " + "; or ".join(
            tips
        )
    expert_share = shard["experts"] / shard["total"]
    msg = (
        f"{big} ({terms[big] / GIB:.1f} GiB for {shard['total'] / 1e9:.2f}B parameters on this GPU, "
        f"{100 * expert_share:.0f}% of them experts) is the largest term"
    )
    e = r.model.num_experts
    for ep in (x for x in range(p.expert_parallel + 1, e + 1) if e % x == 0):
        tp = p.tensor_parallel
        dp = max(p.data_parallel, math.ceil(ep / tp))
        while (tp * dp) % ep:
            dp += 1
        cand = dataclasses.replace(p, expert_parallel=ep, data_parallel=dp)
        t = memory(r, cand, micro_batch)["total"]
        if t <= budget:
            return (
                f"{msg}: raise parallel.expert_parallel to {ep} (needs tensor_parallel x "
                f"data_parallel divisible by {ep}: {tp * dp} GPUs at tensor_parallel={tp}; "
                f"estimated {t / GIB:.1f} GiB per GPU), or raise parallel.tensor_parallel"
            )
    return f"{msg}: raise parallel.expert_parallel and parallel.tensor_parallel (no EP alone fits)"


def plan(
    recipe: Recipe,
    *,
    num_gpus: int | None = None,
    gpu_mem_gib: float = 80,
    micro_batch: int | None = None,
    allow_unfit: bool = False,
    host_mem_gib: float = 2048,
    gpus_per_node: int = 8,
) -> dict:
    """Layout, parameter counts and per-GPU memory of ``recipe`` (on ``num_gpus`` GPUs if given).

    ``num_gpus`` re-derives data_parallel = num_gpus / (tensor x pipeline parallel).
    ``micro_batch``: sequences per forward on one rank, for both the training and the pi_old
    forward (None: the recipe's train.micro_batch_size, or the whole local share when that is 0).
    Raises PlanError when
    the estimate exceeds 90% of ``gpu_mem_gib``, unless ``allow_unfit``. Colocated engines: every
    phase per GPU, and per node of ``gpus_per_node`` GPUs 90% of ``host_mem_gib`` of host memory
    (:mod:`moe_rl.plan_colocated`).
    """
    p = recipe.parallel
    if num_gpus is not None and num_gpus != p.world_size:
        mp = p.tensor_parallel * p.pipeline_parallel
        if num_gpus % mp:
            raise ConfigError(
                f"num_gpus={num_gpus} is not a multiple of tensor_parallel x pipeline_parallel = {mp}"
            )
        p = dataclasses.replace(p, data_parallel=num_gpus // mp)
    m = recipe.model
    if micro_batch is None and recipe.train.micro_batch_size:
        micro_batch = recipe.train.micro_batch_size
    total = param_counts(m)
    mem = memory(recipe, p, micro_batch)
    budget = USABLE * gpu_mem_gib * GIB
    phases = colocated_phases(recipe, mem, total["total"], gpu_mem_gib * GIB)
    rollout_tokens = recipe.train.prompts_per_step * recipe.train.group_size * m.max_seq_len
    from moe_rl.routing.codec import route_bytes_per_token

    out = {
        "layout": layout(p),
        "params": {**total, "active": active_params(m)},
        "memory": mem,
        "gpu_mem_gib": gpu_mem_gib,
        "budget_bytes": int(budget),
        "host_mem_gib": host_mem_gib,
        "routing_replay_bytes_per_step": rollout_tokens
        * route_bytes_per_token(m.num_layers, m.moe_router_topk, m.num_experts),
        "routing_replay_on": recipe.algo.routing.replays_in_training,
        "weight_sync_bytes_per_update": 2 * total["total"],
        "weight_sync_on": recipe.rollout.engine != "embedded",
        "colocated": phases,
        "colocated_detail": phases and colocated_detail(recipe, mem, total["total"], gpu_mem_gib * GIB),
        "host": host_per_node(recipe, mem, total["total"], p.world_size, gpus_per_node),
    }
    if mem["total"] > budget:
        out["refusal"] = (
            f"layout TP={p.tensor_parallel} EP={p.expert_parallel} DP={p.data_parallel} needs "
            f"{mem['total'] / GIB:.1f} GiB per GPU, more than {USABLE:.0%} of {gpu_mem_gib:g} GiB: "
            + _suggest(recipe, p, mem, budget, micro_batch)
        )
    else:
        out["refusal"] = phases and colocated_refusal(recipe, out, gpu_mem_gib, host_mem_gib)
    out["fits"] = fits = not out["refusal"]
    if not fits and not allow_unfit:
        raise PlanError(out["refusal"])
    return out


def _n(x: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return str(int(x))


def format_plan(pl: dict) -> str:
    """The plan as the text ``moe-rl plan`` prints."""
    lo, pa, me = pl["layout"], pl["params"], pl["memory"]
    sh, t = me["params_per_gpu"], me["terms"]
    a = me["activation_bytes_per_token"]
    lines = [
        f"layout      world {lo['world']} = TP {lo['tp']} x PP {lo['pp']} x DP {lo['dp']};"
        f"  EP {lo['ep']}, expert-TP 1, expert-DP {lo['expert_dp']} (= TP x DP / EP)",
        "parameters  component        model        per GPU",
    ]
    for k in ("embedding", "output", "attention", "router", "experts", "norms", "total"):
        lines.append(f"            {k:<12} {pa[k]:>13,} {sh[k]:>14,}")
    lines.append(
        f"            active/token {pa['active']:>13,}   ({_n(pa['total'])} total, {_n(pa['active'])} active)"
    )
    o = me["optimizer_sharding"]
    lines.append(
        f"memory/GPU  ({'bf16' if me['dtype_bytes'] == 2 else 'fp32'} params, grad buffer, Adam"
        f"{' + fp32 main' if me['dtype_bytes'] == 2 else ''}; "
        + (
            f"distributed optimizer: state over DP {o['dense_over']}, experts' over expert-DP "
            f"{o['experts_over']})"
            if o["distributed"]
            else "optimizer state not sharded)"
        )
    )
    for k in ("weights", "gradients", "optimizer", "activations"):
        lines.append(f"            {k:<12} {t[k] / GIB:>9.2f} GiB")
    lines.append(
        f"            {'total':<12} {me['total'] / GIB:>9.2f} GiB of {pl['budget_bytes'] / GIB:.1f} "
        f"usable ({USABLE:.0%} of {pl['gpu_mem_gib']:g} GiB): {'fits' if pl['fits'] else 'DOES NOT FIT'}"
    )
    lines.append(
        f"activations {me['sequences_per_forward']} sequences x max_seq_len = "
        f"{me['tokens_per_forward']:,} tokens per training forward; per token: layer "
        f"{a['layer']:,} B, logits {a['logits']:,} B, whole forward {a['train']:,} B; "
        f"pi_old forward {me['old_logprob_tokens']:,} tokens; peak: {me['activation_peak']}"
    )
    lines.append(
        f"per step    routing replay {pl['routing_replay_bytes_per_step'] / 2**20:,.1f} MiB of routes"
        f"{'' if pl['routing_replay_on'] else ' (replay off)'}; weight sync "
        f"{pl['weight_sync_bytes_per_update'] / GIB:.2f} GiB bf16 per update"
        f"{'' if pl['weight_sync_on'] else ' (embedded engine: none)'}"
    )
    if pl.get("colocated"):
        lines += format_colocated(pl)
    else:
        lines.append("            KV cache: SGLang's business (--mem-fraction-static on its own GPUs)")
    if pl["refusal"]:
        lines.append(f"refused     {pl['refusal']}")
    return "\n".join(lines)


def arg_parser():
    """``moe-rl plan``'s command line (every flag's value range-checked by its type)."""
    ap = ArgParser(prog="moe-rl plan", description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    ap.add_argument(
        "--num-gpus",
        type=int_at_least(1),
        default=None,
        help="GPUs of the job (default: the recipe's world)",
    )
    ap.add_argument("--gpu-mem-gib", type=number_in(0.0), default=80.0, help="memory of one GPU, GiB")
    ap.add_argument(
        "--micro-batch",
        type=int_at_least(1),
        default=None,
        help="sequences per forward on one rank (default: train.micro_batch_size, else the whole share)",
    )
    ap.add_argument(
        "--host-mem-gib",
        type=number_in(0.0),
        default=2048.0,
        help="host memory of one node, GiB (colocated engines)",
    )
    ap.add_argument(
        "--gpus-per-node", type=int_at_least(1), default=8, help="GPUs (trainer ranks) of one node"
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def command(argv: list[str] | None = None) -> int:
    """``moe-rl plan RECIPE [overrides] [--num-gpus N] [--gpu-mem-gib G] [--json]``; 1 if it cannot
    fit. A user error raises (``moe-rl``'s main turns it into one line)."""
    args = arg_parser().parse_args(argv)

    pl = plan(
        load_recipe(args.recipe, args.overrides),
        num_gpus=args.num_gpus,
        gpu_mem_gib=args.gpu_mem_gib,
        micro_batch=args.micro_batch,
        allow_unfit=True,
        host_mem_gib=args.host_mem_gib,
        gpus_per_node=args.gpus_per_node,
    )
    print(json.dumps(pl, indent=1) if args.json else format_plan(pl))
    if not pl["fits"]:
        print(f"moe-rl plan: {pl['refusal']}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """:func:`command`, with a user error as one ``moe-rl: <kind>: <message>`` line (exit code 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return one_line_errors(lambda: command(argv), verbose=False)


if __name__ == "__main__":
    sys.exit(main())
