"""Worker for the dist tier: run under torchrun (or plain python for world 1).

It builds the tiny policy at the given layout (optionally loading a checkpoint saved at
another layout), computes per-token log-probs on fixed tokens, a loss on this rank's
data-parallel shard with global denominators, synced gradients, one AdamW step and the
log-probs after it, and saves everything with the global offset of every shard so the
test can compare layouts element by element.
"""

import argparse
import os

import torch


def sharded_grads(model) -> dict:
    """key -> (global_offset, local grad) for every parameter, via its ShardedTensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    by_ptr = {p.data_ptr(): p for p in model.parameters()}
    out = {}
    for st in model.sharded_state_dict().values():
        if not isinstance(st, ShardedTensor) or st.data.data_ptr() not in by_ptr:
            continue
        p = by_ptr[st.data.data_ptr()]
        if p.grad is None:
            continue
        offset = tuple(st.global_offset[st.prepend_axis_num:])
        expert = tuple(st.global_offset[: st.prepend_axis_num])
        out[st.key + str(expert)] = (offset, p.grad.detach().clone())
    return out


def routing_checks(policy, tokens) -> dict:
    """Record routes, perturb the routers (identically on every rank), replay, and measure flips.

    Leaves the weights as they were. Every rank returns full [B, S, L, K] routes.
    """
    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction
    from moe_rl.routing.flip import flip_rate

    b, s = tokens.shape[0], tokens.shape[1] - 1
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD) as rs:
        policy.logprobs(tokens)
    recorded = rs.recorded_BSLK(b, s)
    saved = [r.weight.detach().clone() for r in policy.routers]
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for r in policy.routers:  # router weights are replicated on every rank: same noise everywhere
            r.weight.mul_(1 + 0.3 * torch.randn(r.weight.shape, generator=gen))
    with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=recorded) as rs2:
        replayed = policy.logprobs(tokens).logp_BT
    natural = rs2.natural_BSLK(b, s)
    flips = flip_rate(natural.reshape(b * s, *natural.shape[2:]), recorded.reshape(b * s, *recorded.shape[2:]))
    with torch.no_grad():
        for r, w in zip(policy.routers, saved):
            r.weight.copy_(w)
    return {"recorded": recorded, "natural_after_perturb": natural, "replayed_logp": replayed, "flips": flips}


def generations(policy) -> dict:
    """Greedy rollouts (tokens, log-probs, routes) of the embedded engine with each forward
    (under EP the lean decoder gathers the experts; megatron's path runs all-to-alls)."""
    from moe_rl.rollout.embedded import EmbeddedEngine
    from moe_rl.rollout.types import SamplingParams

    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [3, 4]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, return_routes=True)
    out = {}
    for decoder in ("lean", "megatron"):
        ro = EmbeddedEngine(policy, pad_id=0, decoder=decoder).generate(prompts, 2, sp)
        out[decoder] = {"tokens": ro.tokens_BT, "logp": ro.logprobs_BT, "routes": ro.routes_BTLK}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--dispatcher", default="alltoall")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--logprob-impl", default="auto")
    ap.add_argument("--load", default=None)
    ap.add_argument("--save-init", default=None)
    ap.add_argument("--save-after", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.megatron.optim import Optimizer, grad_norm, sync_grads
    from moe_rl.megatron.parallel import destroy_parallel, init_parallel
    from moe_rl.megatron.policy import build_policy

    par = ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep, data_parallel=args.dp)
    mcfg = ModelConfig(moe_token_dispatcher=args.dispatcher, recompute=args.recompute,
                       logprob_impl=args.logprob_impl)
    info = init_parallel(par, seed=3)
    policy = build_policy(mcfg, par, info)
    opt = Optimizer(policy.parameters(), OptimConfig(lr=1e-4, grad_clip=0.0), info)
    if args.load:
        load_checkpoint(args.load, policy.model)
    if args.save_init:
        save_checkpoint(args.save_init, 0, policy.model, opt)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, mcfg.vocab_size, (8, 33), generator=g)
    routing = routing_checks(policy, tokens)
    gen = generations(policy) if args.tp == 1 else {}
    mask = (torch.rand(8, 33, generator=g) < 0.8).float()
    mask[:, 0] = 0
    with torch.no_grad():
        out = policy.logprobs(tokens, with_entropy=True)
    rows = tokens.shape[0] // info.dp_size
    sl = slice(info.dp_rank * rows, (info.dp_rank + 1) * rows)
    lp = policy.logprobs(tokens[sl], with_entropy=True)
    loss = -((lp.logp_BT + 0.1 * lp.entropy_BT) * mask[sl]).sum() / mask.sum()
    loss.backward()
    params = [p for p in policy.parameters()]
    sync_grads(params, info)
    norm = grad_norm(params, info)
    grads = sharded_grads(policy.model)
    opt.opt.step()
    with torch.no_grad():
        after = policy.logprobs(tokens).logp_BT
    if args.save_after:
        opt.step_count = 1
        save_checkpoint(args.save_after, 1, policy.model, opt)
    os.makedirs(args.out, exist_ok=True)
    torch.save({**routing, "gen": gen, "logp": out.logp_BT, "entropy": out.entropy_BT, "loss": loss.detach(),
                "grad_norm": norm, "grads": grads, "after": after, "tokens": tokens},
               os.path.join(args.out, f"rank{info.rank}.pt"))
    destroy_parallel()


if __name__ == "__main__":
    main()
