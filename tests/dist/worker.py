"""Worker for the dist tier: run under torchrun (or plain python for world 1).

It builds the tiny policy at the given layout (optionally loading a checkpoint saved at
another layout), computes per-token log-probs on fixed tokens, a loss on this rank's
data-parallel shard with global denominators, the gradients megatron-core's DDP reduces, one
Adam step and the log-probs after it, and saves everything with the global offset of every
shard so the test can compare layouts element by element. With ``--steps N`` it instead trains
N steps (optionally resuming a checkpoint with its optimizer state) and saves the parameters.
"""

import argparse
import os

import torch


def sharded_grads(model, of=lambda p: p.main_grad) -> dict:
    """key -> (global_offset, local grad) for every parameter, via its ShardedTensor (``of``: what
    to take from the parameter; DDP's reduced gradient by default)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    by_ptr = {p.data_ptr(): p for p in model.parameters()}
    out = {}
    for st in model.sharded_state_dict().values():
        if not isinstance(st, ShardedTensor) or st.data.data_ptr() not in by_ptr:
            continue
        p = by_ptr[st.data.data_ptr()]
        offset = tuple(st.global_offset[st.prepend_axis_num :])
        expert = tuple(st.global_offset[: st.prepend_axis_num])
        out[st.key + str(expert)] = (offset, of(p).detach().clone())
    return out


def train_steps(policy, info, args) -> dict:
    """``args.steps`` Adam steps on fixed batches (this rank's DP share, global denominators),
    resuming ``args.load`` with its optimizer state when given; the parameters by global offset."""
    from moe_rl.config import OptimConfig
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.megatron.optim import Optimizer

    cfg = OptimConfig(lr=1e-4, weight_decay=0.1, grad_clip=0.5, distributed=args.distributed)
    opt = Optimizer(policy.model, cfg, info)
    start = load_checkpoint(args.load, policy.model, opt)["step"] if args.load else 0
    stats = []
    for step in range(start, start + args.steps):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, policy.cfg.vocab_size, (8, 33), generator=g)
        mask = (torch.rand(8, 33, generator=g) < 0.8).float()
        rows = tokens.shape[0] // info.dp_size
        sl = slice(info.dp_rank * rows, (info.dp_rank + 1) * rows)
        loss = -(policy.logprobs(tokens[sl]).logp_BT * mask[sl]).sum() / mask.sum()
        loss.backward()
        stats.append(opt.step())
    if args.save_after:
        save_checkpoint(args.save_after, start + args.steps, policy.model, opt)
    return {
        "params": sharded_grads(policy.model, of=lambda p: p),
        "stats": stats,
        "distributed": opt.distributed,
    }


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
    flips = flip_rate(
        natural.reshape(b * s, *natural.shape[2:]), recorded.reshape(b * s, *recorded.shape[2:])
    )
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
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--distributed", default="off", choices=["auto", "on", "off"])
    args = ap.parse_args()
    args.distributed = {"auto": "auto", "on": True, "off": False}[args.distributed]

    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.parallel import destroy_parallel, init_parallel
    from moe_rl.megatron.policy import build_policy

    par = ParallelConfig(tensor_parallel=args.tp, expert_parallel=args.ep, data_parallel=args.dp)
    mcfg = ModelConfig(
        moe_token_dispatcher=args.dispatcher, recompute=args.recompute, logprob_impl=args.logprob_impl
    )
    info = init_parallel(par, seed=3)
    policy = build_policy(mcfg, par, info)
    out = train_steps(policy, info, args) if args.steps else one_step(policy, info, args)
    os.makedirs(args.out, exist_ok=True)
    torch.save(out, os.path.join(args.out, f"rank{info.rank}.pt"))
    destroy_parallel()


def one_step(policy, info, args) -> dict:
    """Log-probs, routing, rollouts, loss, reduced gradients and one step (module doc)."""
    from moe_rl.config import OptimConfig
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.megatron.optim import Optimizer

    # the distributed optimizer keeps only this rank's shard of the reduced gradient
    opt = Optimizer(policy.model, OptimConfig(lr=1e-4, grad_clip=0.0, distributed=args.distributed), info)
    if args.load:
        load_checkpoint(args.load, policy.model)
    if args.save_init:
        save_checkpoint(args.save_init, 0, policy.model, opt)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, policy.cfg.vocab_size, (8, 33), generator=g)
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
    opt.finish_grad_sync()
    grads = sharded_grads(policy.model)
    norm = torch.tensor(opt.step()["grad_norm"])
    with torch.no_grad():
        after = policy.logprobs(tokens).logp_BT
    if args.save_after:
        save_checkpoint(args.save_after, 1, policy.model, opt)
    return {
        **routing,
        "gen": gen,
        "logp": out.logp_BT,
        "entropy": out.entropy_BT,
        "loss": loss.detach(),
        "grad_norm": norm,
        "grads": grads,
        "after": after,
        "tokens": tokens,
    }


if __name__ == "__main__":
    main()
