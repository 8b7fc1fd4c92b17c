"""The training pass in the regime users train: tokens/s per GPU, MFU and the GPU's busy share.

A Qwen3-MoE-shaped policy (Qwen3-30B-A3B's layer: hidden 2048, 32 query / 4 key-value heads of
128, 64 experts top-8 of width 768; its vocabulary, 151,936) with as many layers as fit one GPU
with its optimizer (bf16 weights, fp32 gradients, main weights and Adam moments: 18 bytes a
parameter), trained on packed ragged batches of at least 16k positions (and half that, to show the
pass's time growing with its positions rather than flat). Measured per configuration:

- the training pass (forward + backward of the packed log-probs into DDP's buffers) and the
  optimizer step, each timed over several repetitions after two warm-ups;
- ``tokens_per_s``: positions trained per second of pass + step, on one GPU;
- ``mfu``: 6 x active parameters x positions / pass + step time / the measured dense matmul rate
  (active: expert weights x top-k / experts, everything else once, the input embedding not at all);
- one profiled pass: kernel launches and the share of the wall time the GPU was busy.

Both layer specs where they can run: the local spec always; the transformer-engine spec when its
package imports (it is not on the lent GPUs' image; docs/gpu_check.md). ``make gpu-check`` (tools/gpu_check.py) runs it
as its ``moe_target`` section (its JSON and picture carry the figures); ``python -m
benchmarks.moe_target [--dry-run]`` on its own writes ``benchmarks/results/moe_target-<machine>-<commit>.json``. Weights are drawn on the GPU
(their values do not change the cost; the CPU initialiser would take minutes at this size).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

TARGET = dict(
    vocab_size=151936,
    hidden_size=2048,
    num_attention_heads=32,
    num_query_groups=4,
    head_dim=128,
    moe_ffn_hidden_size=768,
    num_experts=64,
    moe_router_topk=8,
    max_seq_len=4096,
    dtype="bfloat16",
)
"Qwen3-30B-A3B's layer with 64 experts (of its 128) and its vocabulary."
DRY = dict(
    vocab_size=104,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    moe_ffn_hidden_size=32,
    num_experts=8,
    moe_router_topk=2,
    max_seq_len=128,
    dtype="float32",
)
POSITIONS = (8192, 16384)
DRY_POSITIONS = (96, 192)
MAX_LAYERS = 48
STATE_BYTES = 18
"Bytes a parameter holds with its optimizer: bf16 weight 2, fp32 gradient 4, main weight 4, Adam 8."
MEMORY_SHARE = 0.85
"The share of the free device memory the estimate may fill (the allocator's fragmentation, workspaces)."


def layer_params(m: dict) -> int:
    """Parameters of one transformer layer of model section ``m``."""
    h, d = m["hidden_size"], m["head_dim"]
    q, g = m["num_attention_heads"] * d, m["num_query_groups"] * d
    attention = h * (q + 2 * g) + q * h + 2 * d + 2 * h  # qkv, proj, q/k norms, two norms
    return attention + m["num_experts"] * (h + 3 * h * m["moe_ffn_hidden_size"])  # router + experts


def activation_bytes(m: dict, positions: int) -> int:
    """What one layer keeps for its backward at ``positions`` packed positions, bf16 (an estimate:
    norms, q/k/v, attention out, projections; per routed copy the permuted input, fc1 out, the GLU,
    fc2 out)."""
    h, d, k, f = m["hidden_size"], m["head_dim"], m["moe_router_topk"], m["moe_ffn_hidden_size"]
    q, g = m["num_attention_heads"] * d, m["num_query_groups"] * d
    per_position = 4 * h + (q + 2 * g) + q + k * (2 * h + 3 * f) + h + 4 * m["num_experts"]
    return 2 * per_position * positions


def layers_to_fit(free_bytes: int, m: dict, positions: int) -> int:
    """As many layers as fit ``free_bytes`` with their optimizer and one pass's activations, besides
    the embedding and output layer (and their optimizer state)."""
    fixed = 2 * m["vocab_size"] * m["hidden_size"] * STATE_BYTES
    per_layer = layer_params(m) * STATE_BYTES + activation_bytes(m, positions)
    return max(1, min(MAX_LAYERS, int((MEMORY_SHARE * free_bytes - fixed) // per_layer)))


def active_params(policy) -> int:
    """Parameters a token's forward multiplies by: expert weights x top-k / experts, every other
    weight once, the input embedding not at all (a lookup)."""
    cfg, active = policy.cfg, 0.0
    for name, p in policy.model.named_parameters():
        if ".experts." in name:
            active += p.numel() * cfg.moe_router_topk / cfg.num_experts
        elif "word_embeddings" not in name or cfg.tie_embeddings:
            active += p.numel()
    return int(active)


def batch(positions: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged RL-like batch: rows of 1/16 .. 1/4 of ``positions`` input positions until they add
    up to ``positions`` (the last one cut to fit), padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    lens, left = [], positions
    while left > 0:
        n = int(torch.randint(positions // 16, positions // 4 + 1, (1,), generator=g))
        lens.append(min(n, left))
        left -= lens[-1]
    lens_B = torch.tensor(lens)
    return torch.randint(0, vocab, (len(lens), max(lens) + 1), generator=g), lens_B


@contextlib.contextmanager
def drawn_on_device():
    """Build policies uninitialised on the device (no CPU initialiser), then draw their weights there."""
    from moe_rl.megatron import model as model_mod

    real = model_mod.transformer_config

    def on_device(cfg, par):
        c = real(cfg, par)
        if torch.cuda.is_available():
            c = dataclasses.replace(c, use_cpu_initialization=False, perform_initialization=False)
        return c

    model_mod.transformer_config = on_device
    try:
        yield
    finally:
        model_mod.transformer_config = real


@torch.no_grad()
def draw(policy, std: float = 0.02) -> None:
    for p in policy.model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std)


def build(m: dict, layers: int, impl: str):
    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy

    info = init_parallel(ParallelConfig(), seed=1)
    cfg = ModelConfig(**{**m, "num_layers": layers, "transformer_impl": impl})
    with drawn_on_device():
        policy = build_policy(cfg, ParallelConfig(), info)
    if torch.cuda.is_available():
        draw(policy)
    return policy, Optimizer(policy.model, OptimConfig(lr=1e-6, grad_clip=1.0), info)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _pass(policy, tokens, lens) -> None:
    pack = policy.pack(tokens, lens)
    mask = (torch.arange(tokens.shape[1]) < lens[:, None] + 1).float().to(policy.info.device)
    mask[:, 0] = 0
    logp = policy.logprobs(tokens, pack=pack).logp_BT
    (-(logp * mask).sum() / mask.sum()).backward()


def timed(policy, opt, tokens, lens, reps: int) -> dict:
    """Two warm-ups, then ``reps`` timed passes and optimizer steps (seconds each, means)."""
    for _ in range(2):
        _pass(policy, tokens, lens)
        opt.step()
    passes, steps = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        _pass(policy, tokens, lens)
        sync()
        t1 = time.perf_counter()
        opt.step()
        sync()
        passes.append(t1 - t0)
        steps.append(time.perf_counter() - t1)
    return {"pass_s": sum(passes) / reps, "step_s": sum(steps) / reps, "reps": reps}


def profiled(policy, opt, tokens, lens) -> dict:
    """One training pass under ``torch.profiler``: wall, the GPU's busy share (its kernels' own time),
    kernel launches; aten ops on CPU (where no device activity is recorded)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        _pass(policy, tokens, lens)
        sync()
    wall = time.perf_counter() - t0
    opt.zero_grad()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy = sum(float(getattr(e, "self_device_time_total", 0.0)) for e in kernels) / 1e6
    return {
        "wall_s": wall,
        "kernel_launches": sum(e.count for e in kernels) if cuda else None,
        "device_busy_fraction": busy / wall if cuda else None,
        "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
    }


def measure(impl: str, *, dry: bool, peak_flops: float | None, deadline: float) -> dict:
    """One layer spec's figures (module docstring); configurations beyond ``deadline`` are skipped."""
    m, sizes = (DRY, DRY_POSITIONS) if dry else (TARGET, POSITIONS)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        layers = 2 if dry else layers_to_fit(free, m, max(sizes))
    else:
        free, layers = None, 2
    out: dict = {"impl": impl, "model": {**m, "num_layers": layers}, "free_bytes": free, "by_positions": {}}
    policy, opt = build(m, layers, impl)
    try:
        params = sum(p.numel() for p in policy.model.parameters())
        out.update(params=params, active_params=active_params(policy))
        for positions in sorted(sizes, reverse=True):
            if time.perf_counter() > deadline:
                out["by_positions"][positions] = {"skipped": "budget"}
                continue
            tokens, lens = batch(positions, m["vocab_size"])
            t = timed(policy, opt, tokens, lens, reps=2 if dry else 3)
            seconds = t["pass_s"] + t["step_s"]
            flops = 6 * out["active_params"] * positions
            row = {**t, "rows": len(lens), "tokens_per_s": positions / seconds}
            row["mfu"] = flops / seconds / peak_flops if peak_flops else None
            row["pass_mfu"] = flops / t["pass_s"] / peak_flops if peak_flops else None
            out["by_positions"][positions] = row
        if time.perf_counter() < deadline:
            out["profile"] = profiled(policy, opt, *batch(max(sizes), m["vocab_size"]))
        if torch.cuda.is_available():
            out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    finally:
        del policy, opt
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    big, small = (out["by_positions"].get(p, {}) for p in sorted(sizes, reverse=True))
    if "pass_s" in big and "pass_s" in small:
        out["pass_time_growth"] = big["pass_s"] / small["pass_s"]  # 2.0: time grows with positions
    return out


def impls() -> dict[str, str | None]:
    """The layer specs to measure: ``{impl: None}`` when it runs here, else why it does not."""
    try:
        import transformer_engine  # noqa: F401

        te = None if torch.cuda.is_available() else "transformer-engine needs CUDA"
    except Exception as e:  # absent, or built for another torch
        te = f"transformer-engine does not import here ({type(e).__name__}: {str(e)[:120]})"
    return {"local": None, "transformer_engine": te}


def run(*, dry: bool, peak_flops: float | None, cap_s: float) -> dict:
    """Every runnable layer spec within ``cap_s`` seconds; the headline figures of the local spec."""
    deadline = time.perf_counter() + cap_s
    res: dict = {"specs": {}, "not_measured": {}}
    for impl, why in impls().items():
        if why is not None:
            res["not_measured"][impl] = why
            continue
        if time.perf_counter() > deadline:
            res["not_measured"][impl] = "budget"
            continue
        res["specs"][impl] = measure(impl, dry=dry, peak_flops=peak_flops, deadline=deadline)
    local = res["specs"].get("local", {})
    big = local.get("by_positions", {}).get(max(DRY_POSITIONS if dry else POSITIONS), {})
    res["headline"] = {
        "layers": local.get("model", {}).get("num_layers"),
        "positions": max(DRY_POSITIONS if dry else POSITIONS),
        "tokens_per_s_per_gpu": big.get("tokens_per_s"),
        "mfu": big.get("mfu"),
        "pass_time_growth_8k_to_16k": local.get("pass_time_growth"),
        "kernel_launches_per_pass": (local.get("profile") or {}).get("kernel_launches"),
        "device_busy_fraction": (local.get("profile") or {}).get("device_busy_fraction"),
    }
    return res


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import RESULTS, commit, machine, matmul_rate
    from moe_rl.lab.results import write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--cap-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, dtype = (8192, torch.bfloat16) if dev.type == "cuda" else (1024, torch.float32)
    res = {"machine": machine(), "commit": commit(), "peak_flops": matmul_rate(dev, n, dtype)}
    res.update(run(dry=args.dry_run, peak_flops=res["peak_flops"], cap_s=args.cap_s))
    out = RESULTS / f"moe_target-{res['machine']}{'-dry' if args.dry_run else ''}-{res['commit']}.json"
    write_json(out, res)
    print(json.dumps(res["headline"], indent=1))
    return 0


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
