"""Run one megatron-core operation with one CPU shim left out (argv: shim, operation)."""

import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    skip, op = sys.argv[1], sys.argv[2]
    import torch

    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron import shims

    if skip != "none":
        del shims.SHIMS[skip]
    from moe_rl.megatron.checkpoint import save_checkpoint
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy

    par = ParallelConfig(expert_parallel=2, data_parallel=2) if op == "ep2" else ParallelConfig()
    info = init_parallel(par, seed=0)
    cfg = ModelConfig(
        vocab_size=32,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=2,
        num_query_groups=1,
        head_dim=16,
        moe_ffn_hidden_size=32,
        num_experts=4,
        recompute=op == "recompute",
    )
    policy = build_policy(cfg, par, info)
    tok = torch.randint(0, 32, (2, 9))
    if op == "stock_forward":  # megatron-core's own local modules (DotProductAttention, SequentialMLP)
        from moe_rl.megatron.model import build_gpt

        policy.model = build_gpt(cfg, par, stock_local=True)
    out = policy.logprobs(tok)
    if op == "recompute":
        out.logp_BT.sum().backward()
    if op == "checkpoint":
        save_checkpoint(tempfile.mkdtemp(), 0, policy.model)
    if op == "optimizer":  # megatron-core's distributed optimizer: step, save, resume
        from moe_rl.config import OptimConfig
        from moe_rl.megatron.checkpoint import load_checkpoint
        from moe_rl.megatron.optim import Optimizer

        opt = Optimizer(policy.model, OptimConfig(distributed=True), info)
        out.logp_BT.sum().backward()
        assert opt.step()["skipped"] == 0
        path = save_checkpoint(tempfile.mkdtemp(), 1, policy.model, opt)
        load_checkpoint(path, policy.model, Optimizer(policy.model, OptimConfig(distributed=True), info))
    if info.rank == 0:
        print("OK")


if __name__ == "__main__":
    main()
