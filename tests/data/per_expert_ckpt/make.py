"""Writes the checkpoint in this folder: the tiny policy in the per-expert layout (one parameter per
expert and projection, megatron-core's ``SequentialMLP``) that moe-rl wrote up to commit 34ee443.
It was run once, at 34ee443 (``PYTHONPATH=. python tests/data/per_expert_ckpt/make.py``), and its
output committed: the code that wrote that layout is gone, and the test
(``tests/unit/test_checkpoint_old_layout.py``) holds the stacked layout to it.

Written: ``ckpt/`` (a checkpoint root: model + Adam state after 2 steps, plain fp32 optimizer),
``hf/`` (the same weights exported as HF safetensors) and ``expected.pt``: the fixed tokens, their log-probs after the 2 steps, every expert weight by HF name,
and the log-probs after a 3rd step taken from the checkpoint (same batch rule), all at 34ee443.
"""

import shutil
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
HERE = Path(__file__).parent
MODEL = dict(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    moe_ffn_hidden_size=32,
    num_experts=4,
    moe_router_topk=2,
    max_seq_len=64,
)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (4, 17), generator=g)


def train_step(policy, opt, step: int):
    loss = -policy.logprobs(batch(step)).logp_BT.mean()
    loss.backward()
    opt.step()


def main():
    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.megatron.checkpoint import save_checkpoint
    from moe_rl.megatron.hf import PolicyHFSource, export_hf
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy

    info = init_parallel(ParallelConfig(), seed=1)
    policy = build_policy(ModelConfig(**MODEL), ParallelConfig(), info)
    opt = Optimizer(policy.model, OptimConfig(lr=1e-2, weight_decay=0.1), info)
    for step in range(2):
        train_step(policy, opt, step)
    shutil.rmtree(HERE / "ckpt", ignore_errors=True)
    save_checkpoint(HERE / "ckpt", 2, policy.model, opt, label="rl-step-000002", owner="per-expert")
    tokens = batch(99)
    with torch.no_grad():
        logp = policy.logprobs(tokens).logp_BT
    experts = {n: t for n, t in PolicyHFSource(policy).hf_tensors() if ".mlp.experts." in n}
    shutil.rmtree(HERE / "hf", ignore_errors=True)
    export_hf(policy, HERE / "hf")
    train_step(policy, opt, 2)
    with torch.no_grad():
        logp_after = policy.logprobs(tokens).logp_BT
    torch.save(
        {"tokens": tokens, "logp": logp, "experts": experts, "logp_after_step": logp_after},
        HERE / "expected.pt",
    )


if __name__ == "__main__":
    main()
