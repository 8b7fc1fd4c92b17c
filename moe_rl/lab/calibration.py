"""Calibrate routing noise (``train.route_noise`` / ``rollout.route_noise``) against the papers'
figures, at identical weights.

For each sigma, two forwards of the same rollout tokens, each with fresh selection noise
(:mod:`moe_rl.routing.noise`), are compared as a trainer compares two passes (or an engine and a
trainer: one pass of each) at the same weights:

- ``router``: per-router disagreement, the share of (token, layer) decisions whose expert set
  differs (the R3 paper's unit: about 10% of routers between SGLang and Megatron);
- ``slot``: per-slot disagreement, the share of the K activated experts that differ (``flip/rate``;
  at most ``router`` and at least ``router / K``);
- ``token_any``: tokens whose expert set differs in at least one layer;
- ``k3``: mean k3 between the two passes' log-probs of the sampled response tokens (the R3 paper
  reports KL ~ 8e-4 between two identical Megatron passes and larger between engine and trainer);
- ``abs_log_ratio``: mean |log p_a - log p_b| on those tokens.

The start's mean entropy per response token is printed beside them: routing moves log-probs less
the more peaked the policy (docs/algorithms.md#routing-noise).

Shared by two studies (what they share lives in ``moe_rl.lab``): ``python -m studies.noise.calibrate``
and ``python -m studies.one_update --calibrate`` write the result files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_rl.losses.kl import k3
from moe_rl.megatron.routing import RoutingSession
from moe_rl.routing import RouterAction
from moe_rl.routing.flip import flip_counts
from moe_rl.routing.noise import RouteNoise

R3_PER_ROUTER = 0.10
"The R3 paper's per-router disagreement between SGLang and Megatron (about 10%)."
MEGATRON_TWO_PASS_KL = 8e-4
"The R3 paper's KL between two identical Megatron passes (about 8e-4)."
DEFAULT_SIGMAS = (0.0, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2)


def two_pass(run, tokens_BT, mask_BT, lens_B, sigma: float, seed: int) -> dict[str, float]:
    """The two-pass disagreement of the trainer's forwards of ``tokens_BT`` at route noise ``sigma``."""
    from moe_rl.trainer.rl import packed

    b, s = tokens_BT.shape[0], tokens_BT.shape[1] - 1
    passes = []
    for i in range(2):
        noise = RouteNoise(sigma, seed=seed * 2 + i)
        pack = packed(run, tokens_BT, lens_B)
        with torch.no_grad(), RoutingSession(run.policy, RouterAction.NATURAL, pack=pack, noise=noise) as rs:
            out = run.policy.logprobs(
                tokens_BT, temperature=run.recipe.train.temperature, with_entropy=True, pack=pack
            )
        passes.append((out, rs.natural_BSLK(b, s)))
    (a, ra), (c, rc) = passes
    valid_N = (torch.arange(s)[None] < lens_B[:, None]).reshape(-1)
    n = b * s
    counts = flip_counts(ra.reshape(n, *ra.shape[2:]), rc.reshape(n, *rc.shape[2:]), valid_N)
    tokens, layers = float(counts["tokens"]), ra.shape[2]
    mask = mask_BT.bool()
    diff = (a.logp_BT - c.logp_BT).double()[mask]
    return {
        "sigma": sigma,
        "router": float(counts["router_sum"]) / (tokens * layers),
        "slot": float(counts["flip_sum_L"].sum()) / (tokens * layers),
        "token_any": float(counts["any_sum"]) / tokens,
        "k3": float(k3(a.logp_BT, c.logp_BT)[mask].double().mean()),
        "abs_log_ratio": float(diff.abs().mean()),
        "entropy": float(a.entropy_BT[mask].double().mean()),
    }


def calibrate(recipe, sigmas, prompts: int) -> dict:
    """The calibration table of ``recipe``'s start (see the module doc)."""
    from moe_rl.trainer.rl import encode_prompts, sampling_for
    from moe_rl.trainer.run import Run

    run = Run(recipe, write_recipe=False)
    try:
        if recipe.checkpoint.load:
            run.checkpointer.load_weights(recipe.checkpoint.load)
        run.ensure_engine()
        batch = run.task.sample(0, prompts, recipe.task.seed)
        rollouts = run.generate(encode_prompts(run, batch), recipe.train.group_size, sampling_for(run, 0))
        tokens_BT, mask_BT = rollouts.tokens_BT, rollouts.response_mask_BT
        lens_B = (rollouts.total_lens_B - 1).to(torch.int64)
        rows = [two_pass(run, tokens_BT, mask_BT, lens_B, float(sg), seed=i) for i, sg in enumerate(sigmas)]
    finally:
        run.close()
    return {
        "rows": rows,
        "sequences": int(tokens_BT.shape[0]),
        "response_tokens": int(mask_BT.sum()),
        "reaches_r3": next((r["sigma"] for r in rows if r["router"] >= R3_PER_ROUTER), None),
        "reaches_megatron_kl": next((r["sigma"] for r in rows if r["k3"] >= MEGATRON_TWO_PASS_KL), None),
    }


def format_rows(rows: list[dict]) -> str:
    head = f"{'sigma':>7} {'router':>8} {'slot':>8} {'token_any':>9} {'k3':>10} {'|dlogp|':>9} {'entropy':>8}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['sigma']:>7.3f} {r['router']:>8.4f} {r['slot']:>8.4f} {r['token_any']:>9.4f} "
            f"{r['k3']:>10.2e} {r['abs_log_ratio']:>9.2e} {r['entropy']:>8.4f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["sigma"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key in ("router", "slot", "token_any"):
        a.plot(xs, [r[key] for r in rows], marker="o", label=key)
    a.axhline(R3_PER_ROUTER, color="grey", ls="--", label="R3 paper: 10% per router")
    a.set_xlabel("route noise sigma (logits)")
    a.set_ylabel("two-pass disagreement")
    a.legend()
    b.plot(xs, [max(r["k3"], 1e-12) for r in rows], marker="o", label="k3 (two passes)")
    b.axhline(MEGATRON_TWO_PASS_KL, color="grey", ls="--", label="R3 paper: Megatron two-pass KL")
    b.set_yscale("log")
    b.set_xlabel("route noise sigma (logits)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
