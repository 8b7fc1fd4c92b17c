"""Embedded engine in process vs through the SGLang-protocol server, 1 vs 2 engines behind the real
sglang-router, and weight-push times per engine.

Tiny policy (hidden 128, 4 layers, 8 experts top-2, vocab 104). The server is started
by the same launcher code that starts ``sglang.launch_server`` (module
``moe_rl.serve.embedded``) and driven by the SGLang client; generation asks for
log-probs and routed experts. Then weights of a same-shaped policy in this process are
pushed by the distributed path (gloo broadcast) and the disk path (safetensors).

Router section: two ``moe-rl serve`` engines (one thread each); rollouts of ``--batch`` rows
(``--batch / 4`` prompts x 4 samples, one request per sample, no routes so every request goes
through sglang-router) with 1 engine and with 2 engines behind the router; then distributed
(one gloo group, rank offsets 1, 2) and disk pushes to 1 and to 2 engines. Besides wall time it
records the engines' CPU seconds (psutil), since other work on a shared machine distorts wall time.

    python -m benchmarks.serve_throughput [--batch 64] [--new-tokens 128] [--threads 1] [--sections single,router]

Writes benchmarks/results/serve_throughput-<machine>-tiny-<commit>.json (+ .png with the router
section), with a top-level "headline" object.

Pushes section (``--sections pushes``): the tiny and small policies (benchmarks/throughput.py's
MODELS), each served by one ``moe-rl serve``; 3 pushes by each path (distributed: gloo broadcast;
tensor: the colocated path's buckets with the ``bytes`` serializer, as on a CPU; disk: safetensors),
the median wall time and the trainer process's peak resident memory above its level before the
push (psutil, sampled every millisecond). ``--before FILE`` puts another commit's pushes JSON (the
same command run there with ``--out``) beside this one, with the ratios in the headline:

    python -m benchmarks.serve_throughput --sections pushes [--before OLD.json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import yaml

from benchmarks.common import TINY_MODEL, result_path
from moe_rl.files import read_json
from moe_rl.lab.results import write_json

TINY = {**TINY_MODEL, "max_seq_len": 256}  # the tiny CPU policy, room for 128 new tokens


def _generate_served(client, prompts, new_tokens) -> dict:
    sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    client.generate(prompts[:2], {**sp, "max_new_tokens": 2}, return_logprob=True, return_routed_experts=True)
    t0 = time.perf_counter()
    outs = client.generate(prompts, sp, return_logprob=True, return_routed_experts=True)
    wall = time.perf_counter() - t0
    toks = sum(len(o.output_ids) for o in outs)
    return {"wall_s": wall, "generated_tokens": toks, "tokens_per_s": toks / wall}


def _launch_engines(tmp: Path, n: int, threads: int) -> list:
    from moe_rl.rollout.sglang_launcher import SGLangLauncher, SGLangServerConfig

    launchers = []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    for i in range(n):
        cfg = SGLangServerConfig(model_path=str(tmp / "tiny.yaml"), module="moe_rl.serve.embedded")
        launchers.append(SGLangLauncher(cfg, log_path=tmp / f"engine{i}.log", startup_timeout_s=300, env=env))
        launchers[-1].start()
    return launchers


def _cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _rollout(router, engines, pids, prompts, new_tokens) -> dict:
    from moe_rl.rollout.sglang_engine import SGLangEngine
    from moe_rl.rollout.types import SamplingParams

    engine = SGLangEngine(router, engines=engines)
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts[:2], 2, SamplingParams(temperature=1.0, max_new_tokens=2))
    cpu0, t0 = _cpu_s(pids), time.perf_counter()
    ro = engine.generate(prompts, 4, sp)
    wall, cpu = time.perf_counter() - t0, _cpu_s(pids) - cpu0
    toks = ro.num_response_tokens
    return {"wall_s": wall, "engine_cpu_s": cpu, "generated_tokens": toks, "tokens_per_s": toks / wall,
            "tokens_per_engine_cpu_s": toks / max(cpu, 1e-9), "requests": ro.extras["requests"]}  # fmt: skip


def bench_router(a, tmp: Path, policy) -> dict:
    """1 vs 2 engines behind sglang-router; pushes to 1 and 2 engines."""
    from moe_rl.megatron.hf import PolicyHFSource
    from moe_rl.rollout.sglang_client import SGLangClient
    from moe_rl.rollout.sglang_router import ROUTER_VERSION, SGLangRouterLauncher
    from moe_rl.rollout.weight_sync import DiskWeightSync, DistributedWeightSync

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 104, (max(1, a.batch // 4), 16), generator=g).tolist()
    launchers = _launch_engines(tmp, 2, a.threads)
    out: dict = {"sglang_router": ROUTER_VERSION, "rows": 4 * len(prompts), "rollout": {}, "push": {}}
    try:
        clients = [SGLangClient(x.url, timeout_s=600) for x in launchers]
        pids = [x.pid for x in launchers]
        for k in (1, 2):
            router = SGLangRouterLauncher([c.base_url for c in clients[:k]], log_path=tmp / f"router{k}.log")
            try:
                out["rollout"][f"{k}_engines"] = _rollout(
                    router.start(), clients[:k], pids[:k], prompts, a.new_tokens
                )
            finally:
                router.stop()
        src = PolicyHFSource(policy)
        for k in (1, 2):
            for name, sync in (
                ("distributed", DistributedWeightSync(clients[:k])),
                ("disk", DiskWeightSync(clients[:k], tmp / f"w{k}")),
            ):
                reports = [sync.push(src, f"{name}-{k}-{i}") for i in range(3)]
                sync.close()
                out["push"][f"{name}_{k}_engines"] = {
                    "seconds": [r.seconds for r in reports], "paused_s": [r.paused_s for r in reports],
                    "bytes": reports[-1].bytes,
                }  # fmt: skip
        out["versions_after"] = [c.get_weight_version() for c in clients]
    finally:
        for x in launchers:
            x.stop()
    return out


def _headline(res: dict) -> dict:
    r = res.get("router")
    if not r:
        return {}
    one, two = r["rollout"]["1_engines"], r["rollout"]["2_engines"]
    med = {k: sorted(v["seconds"])[1] for k, v in r["push"].items()}
    return {
        "rollout_tokens_per_s_1_engine": one["tokens_per_s"],
        "rollout_tokens_per_s_2_engines": two["tokens_per_s"],
        "speedup_2_vs_1_engines_wall": two["tokens_per_s"] / one["tokens_per_s"],
        "tokens_per_engine_cpu_s_1_engine": one["tokens_per_engine_cpu_s"],
        "tokens_per_engine_cpu_s_2_engines": two["tokens_per_engine_cpu_s"],
        "push_s_distributed_1_engine": med["distributed_1_engines"],
        "push_s_distributed_2_engines": med["distributed_2_engines"],
        "push_s_per_engine_distributed_2_engines": med["distributed_2_engines"] / 2,
        "push_s_disk_1_engine": med["disk_1_engines"],
        "push_s_disk_2_engines": med["disk_2_engines"],
        "push_bytes": r["push"]["distributed_1_engines"]["bytes"],
    }


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = res["router"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ks = ["1_engines", "2_engines"]
    ax1.bar(["1 engine", "2 engines"], [r["rollout"][k]["tokens_per_s"] for k in ks], color=["C0", "C1"])
    ax1.set_ylabel("rollout tokens/s (wall) through sglang-router")
    ax1.set_title(f"{r['rows']} rows x {res['new_tokens']} tokens, tiny MoE, CPU")
    for i, name in enumerate(("distributed", "disk")):
        vals = [sorted(r["push"][f"{name}_{k}"]["seconds"])[1] for k in ks]
        ax2.bar([i - 0.2, i + 0.2], vals, width=0.4, color=["C0", "C1"])
    ax2.set_xticks([0, 1], ["distributed (gloo)", "disk (safetensors)"])
    ax2.set_ylabel("weight push, s (median of 3; blue 1 engine, orange 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sections", default="single,router", help="comma list of: single, router, pushes")
    ap.add_argument("--before", default=None, help="pushes: another commit's result JSON to compare with")
    ap.add_argument("--out", default=None, help="where to write the JSON (default: results/)")
    a = ap.parse_args(argv)
    sections = set(a.sections.split(","))
    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy

    tmp = Path(tempfile.mkdtemp())
    (tmp / "tiny.yaml").write_text(yaml.safe_dump({"model": TINY}))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 104, (a.batch, 16), generator=g).tolist()
    res = {"model": TINY, "batch": a.batch, "new_tokens": a.new_tokens, "threads": a.threads}

    info = init_parallel(ParallelConfig(), seed=1)
    if sections == {"pushes"}:
        return bench_pushes(a, tmp, info)
    policy = build_policy(ModelConfig(**TINY), ParallelConfig(), info)
    if "router" in sections:
        res["router"] = bench_router(a, tmp, policy)
    if "single" in sections:
        res.update(_bench_single(a, tmp, policy, prompts))
    res = {"headline": _headline(res), **res}
    path = result_path("serve_throughput", "tiny", a.out)
    write_json(path, res)
    if "router" in res:
        _plot(res, path.with_suffix(".png"))
    print(json.dumps(res, indent=1))
    return res


def _bench_single(a, tmp: Path, policy, prompts) -> dict:
    """In process vs one served engine; distributed and disk pushes to it."""
    from moe_rl.megatron.hf import PolicyHFSource
    from moe_rl.rollout.embedded import EmbeddedEngine
    from moe_rl.rollout.sglang_launcher import SGLangLauncher, SGLangServerConfig
    from moe_rl.rollout.types import SamplingParams
    from moe_rl.rollout.weight_sync import DiskWeightSync, DistributedWeightSync

    res: dict = {}
    eng = EmbeddedEngine(policy, pad_id=0)  # no eos: every row generates new_tokens, as served
    sp = SamplingParams(temperature=0.0, max_new_tokens=a.new_tokens, return_routes=True)
    eng.generate(prompts[:2], 1, SamplingParams(temperature=0.0, max_new_tokens=2))
    t0 = time.perf_counter()
    rollouts = eng.generate(prompts, 1, sp)
    wall = time.perf_counter() - t0
    res["in_process"] = {
        "wall_s": wall,
        "generated_tokens": rollouts.num_response_tokens,
        "tokens_per_s": rollouts.num_response_tokens / wall,
    }

    launcher = SGLangLauncher(
        SGLangServerConfig(
            model_path=str(tmp / "tiny.yaml"),
            enable_return_routed_experts=True,
            module="moe_rl.serve.embedded",
        ),
        log_path=tmp / "server.log",
        startup_timeout_s=300,
        env={**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONWARNINGS": "ignore"},
    )
    client = launcher.start()
    try:
        res["served"] = _generate_served(client, prompts, a.new_tokens)
        src = PolicyHFSource(policy)
        pushes = {}
        for name, sync in (
            ("distributed", DistributedWeightSync(client)),
            ("disk", DiskWeightSync(client, tmp / "w")),
        ):
            reports = [sync.push(src, f"{name}-{i}") for i in range(3)]
            pushes[name] = {"seconds": [rep.seconds for rep in reports], "bytes": reports[-1].bytes}
            if hasattr(sync, "close"):
                sync.close()
        res["push"] = pushes
        res["served_version_after"] = client.get_weight_version()
    finally:
        launcher.stop()
    res["served_over_in_process"] = res["served"]["tokens_per_s"] / res["in_process"]["tokens_per_s"]
    return res


class _PeakRSS:
    """This process's peak resident memory above its level at entry (psutil, every millisecond)."""

    def __enter__(self):
        import threading

        import psutil

        self._proc, self._stop = psutil.Process(), threading.Event()
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def extra_bytes(self) -> int:
        return self.peak - self.base


def bench_pushes(a, tmp: Path, info) -> dict:
    """Push time and peak trainer memory per push, tiny and small policies, every CPU path."""
    from benchmarks.throughput import MODELS
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.hf import PolicyHFSource
    from moe_rl.megatron.policy import build_policy
    from moe_rl.rollout.sglang_launcher import SGLangLauncher, SGLangServerConfig
    from moe_rl.rollout.weight_sync import DiskWeightSync, DistributedWeightSync, TensorWeightSync

    res: dict = {"pushes": {}}
    for model, shape in MODELS.items():
        cfg = {**TINY, **shape}
        (tmp / f"{model}.yaml").write_text(yaml.safe_dump({"model": cfg}))
        policy = build_policy(ModelConfig(**cfg), ParallelConfig(), info)
        launcher = SGLangLauncher(
            SGLangServerConfig(model_path=str(tmp / f"{model}.yaml"), module="moe_rl.serve.embedded"),
            log_path=tmp / f"server-{model}.log",
            startup_timeout_s=300,
            env={**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONWARNINGS": "ignore"},
        )
        client = launcher.start()
        out = res["pushes"][model] = {"params": sum(p.numel() for p in policy.model.parameters())}
        try:
            for name, sync in (
                ("distributed", DistributedWeightSync(client)),
                ("tensor", TensorWeightSync(client, serializer="bytes")),
                ("disk", DiskWeightSync(client, tmp / f"w-{model}")),
            ):
                seconds, extra, nbytes = [], [], 0
                for i in range(3):
                    with _PeakRSS() as rss:
                        rep = sync.push(PolicyHFSource(policy), f"{name}-{i}")
                    seconds.append(rep.seconds)
                    extra.append(rss.extra_bytes)
                    nbytes = rep.bytes
                out[name] = {"seconds": seconds, "peak_extra_rss_bytes": extra, "bytes": nbytes}
                if hasattr(sync, "close"):
                    sync.close()
        finally:
            launcher.stop()
    res["headline"] = _push_headline(res, read_json(a.before) if a.before else None)
    if a.before:
        res["before"] = read_json(a.before)
    path = result_path("serve_throughput", "pushes", a.out)
    write_json(path, res)  # atomic itself
    _plot_pushes(res, path.with_suffix(".png"))
    print(json.dumps(res["headline"], indent=1))
    return res


def _plot_pushes(res: dict, path: Path) -> None:
    """Median push seconds and peak extra memory per model and path, this commit beside ``before``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = res["headline"]
    keys = [f"{m}_{p}" for m in res["pushes"] for p in ("distributed", "tensor", "disk")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (unit, label) in zip(axes, (("s", "push, s (median of 3)"), ("peak_mib", "peak extra RSS, MiB"))):
        x = range(len(keys))
        if f"{keys[0]}_{unit}_before" in h:
            ax.bar(
                [i - 0.2 for i in x], [h[f"{k}_{unit}_before"] for k in keys], 0.4, label="before", color="C7"
            )
        ax.bar([i + 0.2 for i in x], [h[f"{k}_{unit}"] for k in keys], 0.4, label="this commit", color="C0")
        ax.set_xticks(list(x), [k.replace("_", "\n") for k in keys], fontsize=8)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("weight pushes to one moe-rl serve engine (CPU): tiny 1.8M and small 20M parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _push_headline(res: dict, before: dict | None) -> dict:
    """Median push seconds and median peak extra RSS (MiB) per model and path (and, with ``before``,
    before / after ratios)."""
    head: dict = {}
    for model, paths in res["pushes"].items():
        for name, r in paths.items():
            if not isinstance(r, dict):
                continue
            key = f"{model}_{name}"
            head[f"{key}_s"] = sorted(r["seconds"])[1]
            head[f"{key}_peak_mib"] = sorted(r["peak_extra_rss_bytes"])[1] / 2**20
            old = (before or {}).get("pushes", {}).get(model, {}).get(name)
            if old:
                head[f"{key}_s_before"] = sorted(old["seconds"])[1]
                head[f"{key}_peak_mib_before"] = sorted(old["peak_extra_rss_bytes"])[1] / 2**20
    return head


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
