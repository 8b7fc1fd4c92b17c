"""Worker for the dist tier's packing test: run under torchrun (or plain python for world 1).

Builds the tiny policy at the given layout (loading a checkpoint saved by the world-1 run),
then on fixed right-padded rows of mixed lengths computes log-probs, entropy, natural and
recorded routes, a loss and its gradients, padded (world 1, the reference) or packed (the pack
padded to a multiple of TP for sequence parallelism), and replays the recorded routes under
another packing (a reordered subset of the rows). Every rank processes every row: no gradient
is reduced over data-parallel ranks (an expert's gradient is summed over its expert-data-parallel
group and divided by the DP size, every DP rank having fed it the same tokens; sequence-parallel
norms' partial gradients are summed over TP).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker import sharded_grads  # noqa: E402

LENS = [32, 7, 19, 1, 25, 32, 12, 30]  # input positions per row: 158 in all (odd: the TP pad)


def batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab, (8, 33), generator=g)
    lens = torch.tensor(LENS)
    tokens[torch.arange(33)[None, :] > lens[:, None]] = 0
    mask = torch.zeros(8, 33)
    mask[:, 1:] = (torch.arange(32)[None, :] < lens[:, None]).float()
    return tokens, lens, mask


def forward(policy, tokens, lens, mask, packed: bool) -> dict:
    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction

    b, s = tokens.shape[0], tokens.shape[1] - 1
    pack = policy.pack(tokens, lens) if packed else None
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD, pack=pack) as rs:
        policy.logprobs(tokens, pack=pack)
    recorded = rs.recorded_BSLK(b, s)
    order = torch.tensor([6, 1, 4, 0])  # another packing of some rows: routes must follow tokens
    sub = policy.pack(tokens[order], lens[order]) if packed else None
    with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=recorded[order], pack=sub):
        replayed = policy.logprobs(tokens[order], pack=sub).logp_BT * mask[order]
    with RoutingSession(policy, RouterAction.NATURAL, pack=pack) as rs:
        out = policy.logprobs(tokens, with_entropy=True, pack=pack)
        loss = -((out.logp_BT + 0.1 * out.entropy_BT) * mask).sum() / mask.sum()
        rs.backward(loss)
    return {
        "logp": out.logp_BT.detach() * mask,
        "entropy": out.entropy_BT.detach() * mask,
        "natural": rs.natural_BSLK(b, s),
        "recorded": recorded,
        "replayed": replayed,
        "loss": loss.detach(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--load", default=None)
    ap.add_argument("--save-init", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from moe_rl import dist
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.megatron.parallel import destroy_parallel, init_parallel
    from moe_rl.megatron.policy import build_policy

    par = ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep, data_parallel=args.dp)
    mcfg = ModelConfig()
    info = init_parallel(par, seed=3)
    policy = build_policy(mcfg, par, info)
    if args.load:
        load_checkpoint(args.load, policy.model, load_rng=False)
    if args.save_init:
        save_checkpoint(args.save_init, 0, policy.model)
    tokens, lens, mask = batch(mcfg.vocab_size)
    res = forward(policy, tokens, lens, mask, args.packed)
    for p in policy.parameters():
        if p.grad is None:
            continue
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, info.tp_group)
        if getattr(p, "moe_expert", False):  # expert-TP 1: TP ranks hold partial sums; every DP
            dist.all_reduce(p.grad, info.expert_dp_group)  # rank's (identical) tokens reached it
            p.grad /= info.dp_size
    res["grads"] = sharded_grads(policy.model, of=lambda p: p.grad)  # no DDP here: plain .grad
    os.makedirs(args.out, exist_ok=True)
    torch.save(res, os.path.join(args.out, f"rank{info.rank}.pt"))
    destroy_parallel()


if __name__ == "__main__":
    main()
