"""Generated tokens/s of the embedded engine (KV cache), with each of its two forwards (the lean
decoder and megatron-core's static-inference path), vs a naive full-recompute loop.

All sample with the same function and per-row generators; the greedy runs of the engine and
the naive loop must produce the same tokens (checked and recorded). Every measurement records wall seconds and the CPU
seconds of this process: on a machine shared with other jobs the wall time swings by 10x,
while CPU seconds at one torch thread (the default here) stay comparable, so the speedup is
reported on both. Writes ``benchmarks/results/engine_throughput-<machine>-<preset>-<commit>.json``
and a ``.png`` beside it.

    .venv/bin/python -m benchmarks.engine_throughput                 # tiny preset, batch 64 x 128
    .venv/bin/python -m benchmarks.engine_throughput --batch 8 --new-tokens 16 --no-naive
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.common import TINY_MODEL, commit, machine
from moe_rl.lab.results import write_json

PRESETS = {"tiny": TINY_MODEL}  # hidden 128, 4 layers, 8 experts top-2, vocab 104 (the tiny CPU policy)


def timed(fn):
    """(result, wall seconds, CPU seconds of this process)."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def naive_generate(policy, eng, prompts, sampling) -> torch.Tensor:
    """Full recompute of the whole batch every step (equal prompt lengths), no cache."""
    from moe_rl.rollout.embedded import row_generators, sample_tokens

    gens = row_generators(len(prompts), sampling.seed)
    seq = torch.tensor(prompts, dtype=torch.long)
    policy.model.eval()
    with torch.no_grad():
        for _ in range(sampling.max_new_tokens):
            logits = policy.logits(seq)[:, -1]
            u = torch.stack([torch.rand((), generator=g) for g in gens]) if sampling.temperature else None
            tok = sample_tokens(logits, sampling, u)
            eng.token_logprobs(logits, tok, sampling.temperature or 1.0)
            seq = torch.cat([seq, tok[:, None]], dim=1)
    return seq


def summary(runs: list[tuple]) -> dict:
    """Best of the repeats by CPU seconds; tokens/s by wall and by CPU."""
    rollouts, wall, cpu = min(runs, key=lambda r: r[2])
    n = rollouts.extras["generated_tokens"] if hasattr(rollouts, "extras") else rollouts.numel()
    out = {"wall_s": wall, "cpu_s": cpu, "tokens_per_wall_s": n / wall, "tokens_per_cpu_s": n / cpu}
    out["generated_tokens"] = n
    out["wall_s_all_repeats"] = [r[1] for r in runs]
    if hasattr(rollouts, "extras"):
        out.update({k: rollouts.extras[k] for k in ("prefill_s", "decode_s", "forwards", "compactions")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds comparable)")
    ap.add_argument("--repeats", type=int, default=2, help="engine runs; the fewest CPU seconds is kept")
    ap.add_argument("--no-naive", action="store_true", help="skip the (slow) recompute baseline")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy
    from moe_rl.rollout.embedded import EmbeddedEngine
    from moe_rl.rollout.types import SamplingParams

    info = init_parallel(ParallelConfig(), seed=1)
    cfg = ModelConfig(**PRESETS[args.preset])
    policy = build_policy(cfg, ParallelConfig(), info)
    engines = {d: EmbeddedEngine(policy, pad_id=0, decoder=d) for d in ("lean", "megatron")}
    eng = engines["lean"]
    g = torch.Generator().manual_seed(0)
    b, p, m = args.batch, args.prompt_len, args.new_tokens
    prompts = torch.randint(1, cfg.vocab_size, (b, p), generator=g).tolist()
    # mixed prompt lengths p/2 .. 3p/2: rows still inside their prompt are fed one token per step
    lens = torch.randint(max(1, p // 2), p + p // 2 + 1, (b,), generator=g).tolist()
    mixed = [(q * 2)[:n] for q, n in zip(prompts, lens)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=m)
    sampled = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=m, seed=1)
    for e in engines.values():  # warm up
        e.generate(prompts[:2], 1, SamplingParams(temperature=0.0, max_new_tokens=2))

    result = {
        "preset": args.preset,
        "model": PRESETS[args.preset],
        "machine": machine(),
        "commit": commit(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": b,
        "prompt_len": p,
        "mixed_prompt_lens": [min(lens), max(lens)],
        "new_tokens": m,
        "decoders": {d: e.decoder.name for d, e in engines.items()},
        "loadavg_1m_start": os.getloadavg()[0],
    }
    cases = {}
    for d, e in engines.items():
        pre = "engine" if d == "lean" else "megatron_engine"
        cases[f"{pre}_greedy"] = (e, prompts, greedy)
        cases[f"{pre}_sampled"] = (e, prompts, sampled)
        cases[f"{pre}_greedy_mixed_prompt_lens"] = (e, mixed, greedy)
    runs = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so load swings hit every case alike
        for name, (e, ps, sp) in cases.items():
            runs[name].append(timed(lambda e=e, ps=ps, sp=sp: e.generate(ps, 1, sp)))
    for name in cases:
        result[name] = summary(runs[name])
    for kind in ("greedy", "sampled", "greedy_mixed_prompt_lens"):
        lean, meg = result[f"engine_{kind}"], result[f"megatron_engine_{kind}"]
        result[f"speedup_lean_vs_megatron_{kind}_cpu"] = lean["tokens_per_cpu_s"] / meg["tokens_per_cpu_s"]
    result["same_greedy_tokens_lean_vs_megatron"] = bool(
        torch.equal(runs["engine_greedy"][0][0].tokens_BT, runs["megatron_engine_greedy"][0][0].tokens_BT)
    )
    if not args.no_naive:
        seq, wall, cpu = timed(lambda: naive_generate(policy, eng, prompts, greedy))
        naive = summary([(seq[:, p:], wall, cpu)])
        naive["same_tokens_as_engine"] = bool(torch.equal(seq, runs["engine_greedy"][0][0].tokens_BT))
        result["naive_recompute_greedy"] = naive
        eg = result["engine_greedy"]
        result["speedup_engine_vs_naive_cpu"] = eg["tokens_per_cpu_s"] / naive["tokens_per_cpu_s"]
        result["speedup_engine_vs_naive_wall"] = eg["tokens_per_wall_s"] / naive["tokens_per_wall_s"]
    result["loadavg_1m_end"] = os.getloadavg()[0]  # other jobs on the machine skew wall timings
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine_throughput-{result['machine']}-{args.preset}-{result['commit']}.json"
    write_json(path, result, indent=2, newline=True)
    plot(result, path.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "model"}, indent=2))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(result: dict, path: Path) -> None:
    """Generated tokens per CPU second of every case, one bar each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, v in result.items() if isinstance(v, dict) and "tokens_per_cpu_s" in v]
    vals = [result[k]["tokens_per_cpu_s"] for k in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(
        names,
        vals,
        color=["C0" if n.startswith("engine") else "C1" if n.startswith("megatron") else "C7" for n in names],
    )
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlabel("generated tokens per CPU second (1 thread)")
    ax.set_title(
        f"embedded engine, {result['preset']} model, batch {result['batch']} x "
        f"{result['new_tokens']} new tokens ({result['machine']}, {result['commit']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
