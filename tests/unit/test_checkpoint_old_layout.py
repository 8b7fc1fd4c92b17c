"""Checkpoints and HF exports written in the per-expert layout (one parameter per expert and
projection, up to 34ee443) load into the stacked layout: the same weights, the same log-probs, the
same Adam state (the next step lands where the old code's did) and the same HF file to the bit.

The fixture (``tests/data/per_expert_ckpt``) was written by its ``make.py`` at 34ee443.
"""

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).parents[1] / "data" / "per_expert_ckpt"


@pytest.fixture
def fixture(tmp_path):
    """A copy of the fixture (a load must not depend on writing into the repository) and its record."""
    shutil.copytree(DATA, tmp_path / "data")
    return tmp_path / "data", torch.load(DATA / "expected.pt", weights_only=False)


def _policy_and_optimizer(parallel_info):
    import importlib.util

    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    spec = importlib.util.spec_from_file_location("make_per_expert", DATA / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    policy = build_policy(ModelConfig(**make.MODEL, seed=5), ParallelConfig(), parallel_info)
    return make, policy, Optimizer(policy.model, OptimConfig(lr=1e-2, weight_decay=0.1), parallel_info)


def test_a_per_expert_checkpoint_loads_weights_and_adam_state(parallel_info, fixture):
    from moe_rl.megatron.checkpoint import load_checkpoint
    from moe_rl.megatron.hf import PolicyHFSource

    data, want = fixture
    make, policy, opt = _policy_and_optimizer(parallel_info)
    experts = [n for n, _ in policy.model.named_parameters() if ".mlp.experts." in n]
    assert len(experts) == 2 * make.MODEL["num_layers"]  # stacked: two per MoE layer
    meta = load_checkpoint(data / "ckpt", policy.model, opt)
    assert meta["step"] == 2 and opt.step_count == 2
    got = {n: t for n, t in PolicyHFSource(policy).hf_tensors() if ".mlp.experts." in n}
    assert got.keys() == want["experts"].keys()
    for name, t in want["experts"].items():
        assert torch.equal(got[name], t), name
    with torch.no_grad():
        assert torch.equal(policy.logprobs(want["tokens"]).logp_BT, want["logp"])
    make.train_step(policy, opt, 2)  # Adam's moments and step count came back: the 3rd step matches
    with torch.no_grad():
        assert torch.equal(policy.logprobs(want["tokens"]).logp_BT, want["logp_after_step"])


def test_the_hf_export_is_the_per_expert_layouts_file_to_the_bit(parallel_info, fixture, tmp_path):
    from moe_rl.megatron.hf import export_hf, import_hf

    data, _ = fixture
    _, policy, _ = _policy_and_optimizer(parallel_info)
    import_hf(policy, data / "hf")
    export_hf(policy, tmp_path / "again")
    for f in sorted(p.name for p in (data / "hf").iterdir()):
        digest = [hashlib.sha256((d / f).read_bytes()).hexdigest() for d in (data / "hf", tmp_path / "again")]
        assert digest[0] == digest[1], f
