"""Fused log-prob kernel vs the naive PyTorch path and torch.compile of it: time, peak memory, floor.

For each (N tokens, H hidden) at vocabulary V: forward (no grad, the old-log-prob pass) and
forward+backward (grads of hidden and weight) of
- naive:   logits = h @ W^T; log_softmax(logits.float() / T).gather(target)
- compile: torch.compile of the same function
- fused:   moe_rl.kernels.fused_logprob.fused_logprobs (never materialises [N, V] logits)
First it measures the device's bf16 GEMM rate (8192^3 torch.mm); the matmul-bound floor is
2*N*H*V flops for the forward and 6*N*H*V for forward+backward at that rate. Peak memory is
torch.cuda.max_memory_allocated above what was allocated before the call (grads included).
Targets (issue): fused >= 2x faster than naive, peak memory >= 4x lower, >= 60% of the floor.
It also times the GSPO loss (forward+backward) at the same token counts, the measurement
behind not fusing it (``gspo`` in the JSON).

Writes ``benchmarks/results/kernels-<machine>-<preset>-<commit>.json`` and ``.png`` (rewritten
after every configuration, so a run cut short keeps what it measured).

    .venv/bin/python benchmarks/kernels.py --preset smoke     # CPU: interpreter, tiny sizes
    .venv/bin/python benchmarks/kernels.py --preset gpu       # CUDA: N 8k-32k, H 2048/4096, V 151,936
    .venv/bin/python benchmarks/kernels.py --preset gpu --only 8192x4096 --tiles   # one config + tile sweep
    .venv/bin/python benchmarks/kernels.py --codegen          # no GPU needed: compile for sm_90/sm_80
    .venv/bin/python benchmarks/kernels.py --gspo             # GSPO loss vs log-prob pass (any device)
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import commit, gemm_rate, machine  # noqa: E402
from moe_rl.files import read_json
from moe_rl.lab.results import write_json

ROOT = Path(__file__).resolve().parent
PRESETS = {
    "smoke": dict(ns=[64, 160], hs=[48], v=512, dtype="bfloat16", warmup=1, iters=2, gspo_t=64),
    "gpu": dict(
        ns=[8192, 16384, 32768], hs=[2048, 4096], v=151_936, dtype="bfloat16", warmup=2, iters=5, gspo_t=1024
    ),
}
TARGETS = {"speedup_vs_naive": 2.0, "memory_ratio_vs_naive": 4.0, "floor_fraction": 0.6}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int, iters: int) -> float:
    """Median wall time of fn() in ms (CUDA synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_bytes(fn, device) -> int | None:
    """Peak CUDA memory of one fn() call above what was allocated before it (None on CPU)."""
    if device.type != "cuda":
        fn()
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bf16_rate(device) -> float:
    """Measured dense bf16 GEMM rate in flop/s (8192^3 on CUDA, 1024^3 on CPU)."""
    n = 8192 if device.type == "cuda" else 1024
    return gemm_rate(device, torch.bfloat16, ((n, n, n),), reps=10 if device.type == "cuda" else 3)[
        "flops_per_s"
    ]


def naive_logprobs(h, w, tgt, temperature: float = 1.0):
    logits = h @ w.T
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tgt[:, None]).squeeze(-1)


def make_impls(use_compile: bool) -> dict:
    from moe_rl.kernels.fused_logprob import fused_logprobs

    impls = {"naive": naive_logprobs}
    if use_compile:
        impls["compile"] = torch.compile(naive_logprobs)
    impls["fused"] = lambda h, w, tgt, temperature=1.0, tile=None: fused_logprobs(
        h, w, tgt, temperature=temperature, tile=tile
    )[0]
    return impls


def measure(fn, h, w, tgt, device, warmup, iters) -> dict:
    """Forward (no grad) and forward+backward time and peak memory of one implementation."""
    g = torch.randn(h.shape[0], device=device)
    hg, wg = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def fwd():
        with torch.no_grad():
            return fn(h, w, tgt)

    def fwd_bwd():
        hg.grad = wg.grad = None
        (fn(hg, wg, tgt) * g).sum().backward()

    out = {}
    for name, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        try:
            out[f"{name}_ms"] = timed(f, device, warmup, iters)
            out[f"{name}_peak_bytes"] = peak_bytes(f, device)
        except torch.OutOfMemoryError:
            out[f"{name}_ms"] = out[f"{name}_peak_bytes"] = "oom"
        hg.grad = wg.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        out["logp_sample"] = fwd()[:4096].float().cpu()
    except torch.OutOfMemoryError:
        out["logp_sample"] = None
    return out


def gspo_ms(n: int, t: int, device, warmup, iters) -> float:
    """Forward+backward of the GSPO loss on [n / t, t] tokens."""
    from moe_rl.config import AlgoConfig
    from moe_rl.losses import gspo_loss, loss_batch

    b = max(1, n // t)
    logp = (torch.randn(b, t, device=device) - 2).requires_grad_()
    old = logp.detach() + 1e-3 * torch.randn(b, t, device=device)
    adv = torch.randn(b, device=device)
    mask = (torch.rand(b, t, device=device) < 0.9).float()
    cfg = AlgoConfig(name="gspo")

    def step():
        logp.grad = None
        batch = loss_batch(logp, old, adv, mask, num_sequences=float(b), num_tokens=float(mask.sum()))
        loss, _ = gspo_loss(batch, cfg)
        loss.backward()

    return timed(step, device, warmup, iters)


def derive(res: dict, n: int, h: int, v: int, rate: float) -> dict:
    """Speedups, memory ratios and floor fractions of the fused kernel; target verdicts."""
    out = {"floor_fwd_ms": 2 * n * h * v / rate * 1e3, "floor_fwd_bwd_ms": 6 * n * h * v / rate * 1e3}
    fused, naive = res.get("fused", {}), res.get("naive", {})
    for p in ("fwd", "fwd_bwd"):
        t, m = fused.get(f"{p}_ms"), fused.get(f"{p}_peak_bytes")
        if isinstance(t, float):
            out[f"{p}_floor_fraction"] = out[f"floor_{p}_ms"] / t
            for other in ("naive", "compile"):
                ot, om = res.get(other, {}).get(f"{p}_ms"), res.get(other, {}).get(f"{p}_peak_bytes")
                out[f"{p}_speedup_vs_{other}"] = ot / t if isinstance(ot, float) else ot
                if isinstance(m, int) and m > 0:
                    out[f"{p}_memory_ratio_vs_{other}"] = om / m if isinstance(om, int) else om
    a, b = fused.get("logp_sample"), naive.get("logp_sample")
    if a is not None and b is not None:
        out["max_abs_logp_diff_vs_naive"] = (a - b).abs().max().item()
    verdict = {}
    for p in ("fwd", "fwd_bwd"):
        for key, target in TARGETS.items():
            val = out.get(f"{p}_{key}")
            verdict[f"{p}_{key}>={target}"] = (val >= target) if isinstance(val, float) else val
    out["targets"] = verdict
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(result["runs"], key=lambda r: (r["h"], r["n"]))
    if not runs:
        return
    labels = [r["config"] for r in runs]
    impls = ["naive", "compile", "fused"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for col, p in enumerate(("fwd", "fwd_bwd")):
        for row, (key, unit, scale) in enumerate(((f"{p}_ms", "ms", 1), (f"{p}_peak_bytes", "GiB", 2**30))):
            ax = axes[row][col]
            width = 0.8 / len(impls)
            for i, impl in enumerate(impls):
                vals = [r["impls"].get(impl, {}).get(key) for r in runs]
                ys = [v / scale if isinstance(v, (int, float)) and v is not None else 0 for v in vals]
                xs = [j + i * width for j in range(len(runs))]
                ax.bar(xs, ys, width, label=impl)
                for x, v in zip(xs, vals):
                    if v == "oom":
                        ax.text(x, 0, "OOM", rotation=90, ha="center", va="bottom", fontsize=7)
            if row == 0:
                floor = [r["derived"][f"floor_{p}_ms"] for r in runs]
                ax.scatter(
                    [j + width for j in range(len(runs))],
                    floor,
                    marker="_",
                    s=400,
                    c="k",
                    label="matmul floor",
                    zorder=3,
                )
            ax.set_xticks([j + width for j in range(len(runs))], labels, rotation=20, fontsize=8)
            ax.set_ylabel(unit)
            ax.set_title(f"{p.replace('_', '+')} {'time' if row == 0 else 'peak memory'}")
            ax.legend(fontsize=8)
    cpu = " (CPU: interpreted kernel, no memory stats)" if result["device"] == "cpu" else ""
    fig.suptitle(
        f"log-prob pass, V={result['v']}, {result['dtype']}, {result['machine']} "
        f"({result['bf16_tflops']:.3g} bf16 TFLOP/s measured), commit {result['commit']}{cpu}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_config(n: int, hdim: int, cfg: dict, impls: dict, device, rate: float, tiles: bool):
    """(run, gspo, tile sweep or None) of one N x H configuration."""
    name = f"{n}x{hdim}"
    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hdim, device=device, generator=gen).to(dtype)
    w = (torch.randn(cfg["v"], hdim, device=device, generator=gen) * hdim**-0.5).to(dtype)
    tgt = torch.randint(0, cfg["v"], (n,), device=device, generator=gen)
    res = {}
    for impl, fn in impls.items():
        t0 = time.perf_counter()
        try:
            res[impl] = measure(fn, h, w, tgt, device, cfg["warmup"], cfg["iters"])
        except Exception as e:  # record and go on: one failing path must not lose the others
            res[impl] = {"error": f"{type(e).__name__}: {e}"[:500]}
        shown = {k: v for k, v in res[impl].items() if k != "logp_sample"}
        print(f"{name} {impl}: {shown} ({time.perf_counter() - t0:.0f}s)", flush=True)
    derived = derive(res, n, hdim, cfg["v"], rate)
    for r in res.values():
        r.pop("logp_sample", None)
    print(f"{name} derived: {derived}", flush=True)
    run = {"config": name, "n": n, "h": hdim, "bf16_tflops": rate / 1e12, "impls": res, "derived": derived}
    sweep = sweep_tiles(name, h, w, tgt, device, cfg) if tiles and device.type == "cuda" else None
    g_ms = gspo_ms(n, cfg["gspo_t"], device, cfg["warmup"], cfg["iters"])
    gspo = {
        "config": name,
        "gspo_fwd_bwd_ms": g_ms,
        "fused_logprob_fwd_bwd_ms": res.get("fused", {}).get("fwd_bwd_ms"),
        "floor_logprob_fwd_bwd_ms": derived["floor_fwd_bwd_ms"],
        "gspo_over_floor": g_ms / derived["floor_fwd_bwd_ms"],
    }
    return run, gspo, sweep


def run_preset(args) -> Path:
    cfg = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.preset == "gpu" and device.type != "cuda":
        sys.exit("the gpu preset needs CUDA; use --preset smoke on CPU")
    import triton  # after TRITON_INTERPRET is settled (main)

    rate = bf16_rate(device)
    stem = f"kernels-{machine()}-{args.preset}-{commit()}"
    out_json, out_png = args.out / f"{stem}.json", args.out / f"{stem}.png"
    result = {
        "preset": args.preset,
        "machine": machine(),
        "commit": commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(device),
        "dtype": cfg["dtype"],
        "v": cfg["v"],
        "bf16_tflops": rate / 1e12,
        "targets": TARGETS,
        "runs": [],
        "gspo": [],
        "tiles": [],
    }
    only = set(args.only or [])
    todo = [(n, hd) for hd in cfg["hs"] for n in cfg["ns"] if not only or f"{n}x{hd}" in only]
    keep_previous(result, out_json, {f"{n}x{hd}" for n, hd in todo})
    impls = make_impls(not args.no_compile)
    for n, hdim in todo:
        run, gspo, tiles = bench_config(n, hdim, cfg, impls, device, rate, args.tiles)
        result["runs"].append(run)
        result["gspo"].append(gspo)
        if tiles:
            result["tiles"].append(tiles)
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(out_json, result)
        plot(result, out_png)
    print(f"wrote {out_json} and {out_png}")
    return out_json


def keep_previous(result: dict, path: Path, configs: set) -> None:
    """Carry over the runs of an earlier invocation (same machine, preset, commit) not re-run now,
    so that a GPU session can split the preset over several commands."""
    if not path.exists():
        return
    prev = read_json(path)
    for key in ("runs", "gspo", "tiles"):
        result[key] = [r for r in prev.get(key, []) if r["config"] not in configs]


def sweep_tiles(name, h, w, tgt, device, cfg) -> dict:
    """Fused forward and forward+backward time for every tile in GPU_TILES."""
    from moe_rl.kernels.fused_logprob import GPU_TILES, fused_logprobs

    out = {"config": name}
    for tname, tile in GPU_TILES.items():
        fn = lambda a, b, t, tile=tile: fused_logprobs(a, b, t, tile=tile)[0]  # noqa: E731
        try:
            r = measure(fn, h, w, tgt, device, 1, cfg["iters"])
            out[tname] = {k: v for k, v in r.items() if k.endswith("_ms")}
        except Exception as e:
            out[tname] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"tile {tname}: {out[tname]}", flush=True)
    return out


def gspo_study(args) -> Path:
    """GSPO loss forward+backward vs the log-prob pass it follows, at the gpu preset's sizes.

    The log-prob pass is taken at its matmul floor (8*N*H*V flops: forward, recomputing
    backward, two backward GEMMs) at the device's best measured dense rate, so the ratio is
    an upper bound on what fusing the loss could save relative to it.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rate = bf16_rate(device)
    if device.type == "cpu":  # CPU bf16 GEMMs are slow: use the faster fp32 rate (tighter bound)
        a = torch.randn(1024, 1024)
        rate = max(rate, 2 * 1024**3 / (timed(lambda: a @ a, device, 2, 5) / 1e3))
    gpu = PRESETS["gpu"]
    rows = []
    for n in gpu["ns"]:
        ms = gspo_ms(n, gpu["gspo_t"], device, 3, 10)
        for hdim in gpu["hs"]:
            floor = 8 * n * hdim * gpu["v"] / rate * 1e3
            rows.append(
                {
                    "n": n,
                    "h": hdim,
                    "v": gpu["v"],
                    "gspo_fwd_bwd_ms": ms,
                    "logprob_floor_ms": floor,
                    "gspo_over_logprob": ms / floor,
                }
            )
            print(rows[-1], flush=True)
    res = {
        "machine": machine(),
        "commit": commit(),
        "device": str(device),
        "dense_tflops": rate / 1e12,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernels-{machine()}-gspo-{commit()}.json"
    write_json(path, res)
    print(f"wrote {path}")
    return path


def codegen(args) -> Path:
    """Compile both kernels for sm_90 and sm_80 without a GPU: shared memory, pipelining, registers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_rl.kernels import fused_logprob as F

    sigs = {
        "fwd": (
            "h_ptr w_ptr tgt_ptr part_ptr N V H stride_h stride_w inv_t num_splits",
            "*bf16 *bf16 *i32 *fp32 i32 i32 i32 i32 i32 fp32 i32",
        ),
        "grad": (
            "h_ptr w_ptr tgt_ptr lse_ptr ez_ptr gl_ptr ge_ptr g_ptr N C H col0 stride_h stride_w "
            "stride_g inv_t",
            "*bf16 *bf16 *i32 *fp32 *fp32 *fp32 *fp32 *bf16 i32 i32 i32 i32 i32 i32 i32 fp32",
        ),
    }
    aligned = {"H", "stride_h", "stride_w", "stride_g"}  # what triton's JIT infers at H = 2048 / 4096
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    rows = []
    tiles = {k: v for k, v in F.GPU_TILES.items() if not args.only or k in args.only}
    for arch in args.arch:
        for tname, tile in tiles.items():
            for kname, (names, types) in sigs.items():
                names, types = names.split(), types.split()
                sig = dict(zip(names, types))
                consts = {
                    "BM": tile["BM"],
                    "BV": tile["BV"],
                    "BK": tile["BK"],
                    "ENTROPY": True,
                    "UPCAST": False,
                    "PRECISION": "tf32",
                    "GROUP_M": F.GROUP_M,
                }
                sig.update({k: "constexpr" for k in consts})
                attrs = {
                    (i,): [["tt.divisibility", 16]]
                    for i, (a, t) in enumerate(zip(names, types))
                    if t.startswith("*") or a in aligned
                }
                src = ASTSource(fn=F.KERNELS[kname], signature=sig, constexprs=consts, attrs=attrs)
                row = {"arch": arch, "tile": tname, "kernel": kname}
                try:
                    k = triton.compile(
                        src,
                        target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]},
                    )
                    ptx = k.asm["ptx"]
                    row.update(
                        shared_bytes=k.metadata.shared,
                        cp_async=ptx.count("cp.async.cg") > 0,
                        wgmma="wgmma.mma_async" in ptx,
                        mma_sync="mma.sync" in ptx,
                        **ptxas_info(ptx, arch, bindir),
                    )
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                print(row, flush=True)
                rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernels-codegen-{triton.__version__}-{commit()}.json"
    write_json(path, rows)
    print(f"wrote {path}")
    return path


def ptxas_info(ptx: str, arch: int, bindir: Path) -> dict:
    """Registers and spills from the ptxas triton ships (the newest one that reads this PTX)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        for exe in ("ptxas-blackwell", "ptxas"):
            if not (bindir / exe).exists():
                continue
            res = subprocess.run(
                [
                    str(bindir / exe),
                    f"-arch=sm_{arch}{'a' if arch == 90 else ''}",
                    "-v",
                    str(src),
                    "-o",
                    str(Path(d) / "k.cubin"),
                ],
                capture_output=True,
                text=True,
            )
            if res.returncode == 0:
                regs = re.search(r"Used (\d+) registers", res.stderr)
                spill = re.search(r"(\d+) bytes spill stores", res.stderr)
                return {
                    "registers": int(regs.group(1)) if regs else None,
                    "spill_store_bytes": int(spill.group(1)) if spill else None,
                }
    return {"registers": None, "spill_store_bytes": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--only", nargs="*", help="configs NxH to run, e.g. 8192x4096 (--codegen: tile names)")
    ap.add_argument("--arch", nargs="*", type=int, default=[90, 80], help="--codegen: CUDA archs")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--tiles", action="store_true", help="also time every tile in GPU_TILES (CUDA)")
    ap.add_argument("--codegen", action="store_true", help="compile for sm_90/sm_80 only (no GPU needed)")
    ap.add_argument("--gspo", action="store_true", help="only the GSPO-loss vs log-prob-pass study")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    if not args.codegen and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU kernels
    if args.codegen:
        codegen(args)
    elif args.gspo:
        gspo_study(args)
    else:
        run_preset(args)


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
