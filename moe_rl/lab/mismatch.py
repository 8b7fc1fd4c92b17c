"""One batch from the embedded engine at a precision against the trainer's fp32 recompute: the
train-inference mismatch and the rollout-vs-trainer routing disagreement, measured through the
trainer's own pi_old pass (``studies/mismatch/`` sweeps it over precisions and lengths on CPU;
``tools/gpu_check.py`` runs it with CUDA kernels).

Shapes: ``B`` rollouts, ``T`` tokens, ``S = T - 1`` positions, ``L`` MoE layers, ``K`` experts per token.
"""

from __future__ import annotations

import time

import torch

from moe_rl.losses.corrections import mismatch_metrics
from moe_rl.rollout.embedded import EmbeddedEngine
from moe_rl.rollout.types import SamplingParams
from moe_rl.routing.flip import flip_metrics

R3_PAPER = {"router_disagreement": 0.10, "token_any_flip": 0.94, "model": "Qwen3-30B-A3B, 48 layers"}
"The R3 paper's SGLang-vs-Megatron figures (docs/algorithms.md#paper-figures)."


def measure(run, dtype: str, router: str, length: int, prompts: int, group: int) -> dict:
    """One cell: a batch from the engine in (dtype, router) against the trainer's fp32 recompute."""
    from moe_rl.trainer.rl import encode_prompts, engine_routes, old_policy_pass, route_flips

    engine = EmbeddedEngine(run.policy, pad_id=run.tok.pad_id, dtype=dtype, router_dtype=router)
    batch = run.task.sample(0, prompts, run.recipe.task.seed)
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=length, ignore_eos=True, seed=1234, return_routes=True
    )
    c0, w0 = time.process_time(), time.perf_counter()
    rollouts = engine.generate(encode_prompts(run, batch), group, sampling)
    cpu_s, wall_s = time.process_time() - c0, time.perf_counter() - w0
    if hasattr(rollouts, "to"):  # the engine's batch is on the host; the trainer's policy may be on CUDA
        rollouts = rollouts.to(run.info.device)
    mask_BT = rollouts.response_mask_BT
    s = rollouts.tokens_BT.shape[1] - 1
    positions_S = torch.arange(s, device=rollouts.tokens_BT.device)
    valid_BS = (positions_S[None, :] < (rollouts.total_lens_B[:, None] - 1)).float()
    old_logp_BT, natural_BSLK, _ = old_policy_pass(run, rollouts.tokens_BT, None, valid_BS.sum(1).long())
    tokens = float(mask_BT.sum())
    out = {
        k: float(v)
        for k, v in mismatch_metrics(old_logp_BT, rollouts.logprobs_BT, mask_BT, num_tokens=tokens).items()
    }
    flips = flip_metrics(route_flips(engine_routes(run, rollouts), natural_BSLK, valid_BS), "flip")
    out.update(flips)
    out.update(
        generated_tokens=tokens,
        gen_cpu_s=cpu_s,
        gen_wall_s=wall_s,
        tokens_per_cpu_s=tokens / cpu_s,
        tokens_per_wall_s=tokens / wall_s,
    )
    return out
