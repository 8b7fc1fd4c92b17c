"""CPU proxies of the GPU step's host cost: parameters per MoE layer, aten ops per training pass and
per optimizer step, and device-to-host syncs per pass, at 8 and 64 experts.

On a GPU the small-model step is bound by host work, not FLOPs: every parameter costs a gradient
hook, a bucket entry and optimizer-list work, every dispatched op a kernel launch, every host read of
a device value a stall. Counted on the CPU, these hold the GPU's gain without a GPU: an op count
that does not grow with the number of experts is a launch count that does not either.

- ops: aten ops dispatched (``tests.ops.CountOps``, a ``TorchDispatchMode``) by one packed training
  pass (log-probs of a ragged batch, backward into megatron-core DDP's buffers) and by one optimizer
  step (megatron-core's, with the gradient norm and clip);
- syncs: reads of a device tensor on the host during the pass (``.item()``, ``.tolist()``, moves to
  the host, data-dependent shapes), counted with the pretend accelerator of
  ``tests.device_ledger`` (the policy on a device distinct from the host's), by call site.

    python -m benchmarks.step_ops            # benchmarks/results/step_ops-<machine>-tiny-<commit>.{json,png}

Figures are counts, the same on every machine: ``python -m benchmarks.check`` holds them to the
committed result (benchmarks/baselines.yaml: any rise fails).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, machine  # noqa: E402

#: the tiny recipe's policy (recipes/tiny.yaml) at a given number of experts
MODEL = dict(
    vocab_size=104,
    hidden_size=128,
    num_layers=4,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=32,
    moe_ffn_hidden_size=128,
    moe_router_topk=2,
    max_seq_len=256,
)
EXPERTS = (8, 64)


def batch(rows: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A ragged batch: ``rows`` sequences of 24..96 tokens, padded to 96."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(24, 97, (rows,), generator=g)
    return torch.randint(0, MODEL["vocab_size"], (rows, 96), generator=g), lens


def _policy(num_experts: int, layers: int):
    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy

    info = init_parallel(ParallelConfig(), seed=1)
    cfg = ModelConfig(**{**MODEL, "num_layers": layers, "num_experts": num_experts})
    policy = build_policy(cfg, ParallelConfig(), info)
    return policy, Optimizer(policy.model, OptimConfig(lr=1e-4), info), info


def _pass(policy, tokens, lens) -> None:
    """One packed training pass: log-probs of the batch's valid positions, backward."""
    pack = policy.pack(tokens, lens)
    mask = (torch.arange(tokens.shape[1]) < lens[:, None]).float().to(policy.info.device)
    (-(policy.logprobs(tokens, pack=pack).logp_BT * mask).sum()).backward()


def measure(num_experts: int, *, layers: int = MODEL["num_layers"]) -> dict:
    """The counts of one policy with ``num_experts`` experts (module docstring)."""
    from tests.device_ledger import ACCEL, DeviceLedger
    from tests.ops import CountOps

    torch.manual_seed(0)
    policy, opt, info = _policy(num_experts, layers)
    tokens, lens = batch()
    moe = [n for n, _ in policy.model.named_parameters() if ".layers.0.mlp." in n]
    _pass(policy, tokens, lens)  # lazy set-up out of the counts
    opt.step()
    with CountOps() as ops:
        _pass(policy, tokens, lens)
    per_pass = ops.count
    with CountOps() as ops:
        opt.step()
    per_step = ops.count
    policy.info = dataclasses.replace(info, device=ACCEL)
    with (
        mock.patch.object(torch.cuda, "current_device", lambda: ACCEL),
        DeviceLedger(policy.parameters()) as led,
    ):
        _pass(policy, tokens, lens)
    opt.zero_grad()
    sites = collections.Counter(f"{r.func} at {r.where}" for r in led.reads)
    return {
        "experts": num_experts,
        "layers": layers,
        "params": sum(1 for _ in policy.model.parameters()),
        "params_per_moe_layer": len(moe),
        "ops_per_pass": sum(per_pass.values()),
        "ops_per_optimizer_step": sum(per_step.values()),
        "syncs_per_pass": len(led.reads),
        "sync_sites": dict(sites.most_common()),
        "top_ops_per_pass": dict(per_pass.most_common(12)),
        "top_ops_per_optimizer_step": dict(per_step.most_common(8)),
    }


def headline(rows: list[dict]) -> dict:
    keys = ("params_per_moe_layer", "ops_per_pass", "ops_per_optimizer_step", "syncs_per_pass")
    return {f"{k}_{r['experts']}e": r[k] for r in rows for k in keys}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    keys = ("params", "ops_per_pass", "ops_per_optimizer_step", "syncs_per_pass")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, k in zip(axes, keys):
        ax.bar([str(r["experts"]) for r in rows], [r[k] for r in rows], color="tab:blue")
        ax.set_title(k.replace("_", " "))
        ax.set_xlabel("experts")
    fig.suptitle(f"host cost of the tiny policy's step ({res['machine']}, {res['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import commit
    from moe_rl.lab.results import write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="result JSON (default: named by machine and commit)"
    )
    ap.add_argument(
        "--before",
        type=Path,
        default=None,
        help="an earlier step_ops result: its headline (and the ones it kept) go into this one's as before_<commit>",
    )
    args = ap.parse_args(argv)
    rows = [measure(e) for e in EXPERTS]
    res = {"machine": machine(), "commit": commit(), "model": MODEL, "rows": rows, "headline": headline(rows)}
    if args.before:
        earlier = json.loads(args.before.read_text())
        kept = {k: v for k, v in earlier["headline"].items() if k.startswith("before_")}
        now = {k: v for k, v in earlier["headline"].items() if not k.startswith("before_")}
        res["headline"].update({f"before_{earlier['commit']}": now, **kept})
    out = args.out or RESULTS / f"step_ops-{res['machine']}-tiny-{res['commit']}.json"
    write_json(out, res)
    plot(res, out.with_suffix(".png"))
    print(json.dumps(res["headline"], indent=1))
    return 0


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
