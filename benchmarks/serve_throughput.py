"""Embedded engine in process vs through the SGLang-protocol server, and weight-push times.

Tiny policy (hidden 128, 4 layers, 8 experts top-2, vocab 104). The server is started
by the same launcher code that starts ``sglang.launch_server`` (module
``moe_rl.serve.embedded``) and driven by the SGLang client; generation asks for
log-probs and routed experts. Then weights of a same-shaped policy in this process are
pushed by the distributed path (gloo broadcast) and the disk path (safetensors).

    python -m benchmarks.serve_throughput [--batch 64] [--new-tokens 128] [--threads 1]

Writes benchmarks/results/serve_throughput-<machine>-tiny-<commit>.json.
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

from benchmarks.common import result_path

TINY = dict(
    vocab_size=104,
    hidden_size=128,
    num_layers=4,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=32,
    moe_ffn_hidden_size=128,
    num_experts=8,
    moe_router_topk=2,
    max_seq_len=256,
)


def _generate_served(client, prompts, new_tokens) -> dict:
    sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    client.generate(prompts[:2], {**sp, "max_new_tokens": 2}, return_logprob=True, return_routed_experts=True)
    t0 = time.perf_counter()
    outs = client.generate(prompts, sp, return_logprob=True, return_routed_experts=True)
    wall = time.perf_counter() - t0
    toks = sum(len(o.output_ids) for o in outs)
    return {"wall_s": wall, "generated_tokens": toks, "tokens_per_s": toks / wall}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.hf import PolicyHFSource
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy
    from moe_rl.rollout.embedded import EmbeddedEngine
    from moe_rl.rollout.sglang_launcher import SGLangLauncher, SGLangServerConfig
    from moe_rl.rollout.types import SamplingParams
    from moe_rl.rollout.weight_sync import DiskWeightSync, DistributedWeightSync

    tmp = Path(tempfile.mkdtemp())
    (tmp / "tiny.yaml").write_text(yaml.safe_dump({"model": TINY}))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 104, (a.batch, 16), generator=g).tolist()
    res = {"model": TINY, "batch": a.batch, "new_tokens": a.new_tokens, "threads": a.threads}

    info = init_parallel(ParallelConfig(), seed=1)
    policy = build_policy(ModelConfig(**TINY), ParallelConfig(), info)
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
    path = result_path("serve_throughput", "tiny")
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
