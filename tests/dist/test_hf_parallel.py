"""A tiny HF Qwen3-MoE checkpoint imported at TP=2, EP=2 and TP=2+EP=2 (dist tier).

The test process saves a random tiny ``Qwen3MoeForCausalLM`` and its transformers logits;
two torchrun processes (this file is also the worker) import it at the given layout, save
their local-vocab logits and export the policy back to HF safetensors. The logits must match
transformers within 1e-4 and the export must equal the original tensors exactly.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
TOL = 1e-4


def tokens():
    return torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.unit.test_hf import tiny_hf

    path = tmp_path_factory.mktemp("hf") / "tiny"
    model = tiny_hf(path)
    with torch.no_grad():
        logits = model(tokens()).logits
    return path, logits


@pytest.mark.parametrize(
    "layout", [("--tp", "2"), ("--ep", "2"), ("--tp", "2", "--ep", "2")], ids=["tp2", "ep2", "tp2ep2"]
)
def test_import_export_at_layout(hf_ckpt, tmp_path, layout):
    from safetensors.torch import load_file

    path, ref = hf_ckpt
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        "--hf",
        str(path),
        "--out",
        str(tmp_path),
        *layout,
    ]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    tp = 2 if "--tp" in layout else 1
    for group in [ranks] if tp == 2 else [[r] for r in ranks]:  # TP ranks hold vocab shards
        shards = sorted(group, key=lambda r: r["vocab_start"])
        logits = torch.cat([r["logits"] for r in shards], dim=-1)
        g = (logits - ref).abs().max().item()
        print(f"{'/'.join(layout)}: max |megatron - transformers| logit gap {g:.2e}")
        assert g < TOL
    original = load_file(path / "model.safetensors")
    exported = {}
    for f in sorted((tmp_path / "export").glob("*.safetensors")):
        exported.update(load_file(f))
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(exported[name], t), name


def worker() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    args = ap.parse_args()

    from moe_rl.config import ParallelConfig
    from moe_rl.megatron.hf import export_hf, import_hf, model_config_from_path
    from moe_rl.megatron.parallel import destroy_parallel, init_parallel
    from moe_rl.megatron.policy import build_policy

    par = ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep, data_parallel=2 // args.tp)
    info = init_parallel(par, seed=3)
    policy = build_policy(model_config_from_path(args.hf, max_seq_len=64), par, info).eval()
    import_hf(policy, args.hf)
    with torch.no_grad():
        logits = policy.logits(tokens())
    torch.save({"logits": logits, "vocab_start": policy.vocab_start}, Path(args.out) / f"rank{info.rank}.pt")
    export_hf(policy, Path(args.out) / "export", max_shard_bytes=40_000)
    destroy_parallel()


if __name__ == "__main__":
    worker()
