"""The reference policy of the KL term (``algo.kl_coef``, ``algo.kl_reward_coef``): the RL stage's
starting weights, frozen (docs/algorithms.md#kl-to-a-reference).

Held as a copy of the policy's parameters (``named_parameters``, each local tensor whole), swapped
into the policy for the reference's forward (each parameter's storage exchanged, nothing copied)
and back. A second policy of the same layout (:meth:`moe_rl.megatron.policy.Policy.replica`) would
hold the same weights plus a second model's buffers and, in megatron-core, a second set of router
replay instances in its global list; measured by ``python -m benchmarks.reference_memory``, the
copy costs the weights alone and the second policy more (docs/algorithms.md#kl-to-a-reference).

One forward per rollout batch: the reference's log-probs depend on the tokens only, so they are
computed once, after pi_old's, micro-batch by micro-batch, routed as the training forwards are
(``algo.routing`` r2: pi_old's recorded routes; r3: the engine's, as pi_old's forward replays them,
with their gate weights under ``algo.replay_gate_weights``; none: the router's own choice).

Checkpointed once: at the RL stage's first step the weights are saved as a model-only checkpoint in
``<checkpoint root>/reference`` (:data:`REFERENCE_DIR`; retention never prunes it), and a run that
resumes inside the RL stage loads them back from there.

Shape legend: B = sequences of this rank, T = padded tokens.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from moe_rl import dist
from moe_rl.losses import sequence_kl
from moe_rl.megatron.routing import RoutingSession

if TYPE_CHECKING:
    from moe_rl.config import Recipe
    from moe_rl.megatron.policy import Policy
    from moe_rl.trainer.batch import RLBatch
    from moe_rl.trainer.context import Run

log = logging.getLogger(__name__)

REFERENCE_DIR = "reference"
"The reference's checkpoint root under the run's checkpoint root (no checkpoint name: never listed or pruned)."


def needs_reference(recipe: Recipe) -> bool:
    """Whether the RL stage computes log-probs under a reference (a KL term in the loss or the reward)."""
    return recipe.algo.kl_coef > 0 or recipe.algo.kl_reward_coef > 0


class Reference:
    """Frozen weights, by parameter name, that :meth:`swapped_into` a policy of the same layout."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights
        "Parameter name -> this rank's tensor (same shape, dtype and device as the policy's)."

    @classmethod
    @torch.no_grad()
    def snapshot(cls, policy: Policy) -> Reference:
        """The policy's current weights, copied."""
        return cls({name: p.detach().clone() for name, p in policy.model.named_parameters()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    @contextlib.contextmanager
    def swapped_into(self, policy: Policy) -> Iterator[None]:
        """Inside, every parameter of ``policy`` holds the reference's weights (its storage is
        exchanged, not copied); the policy's own are back when the block ends, however it ends."""
        params = dict(policy.model.named_parameters())
        if params.keys() != self.weights.keys():
            raise ValueError(
                "the reference's parameters are not the policy's: "
                f"{sorted(params.keys() ^ self.weights.keys())[:3]} differ"
            )
        live: dict[str, torch.Tensor] = {}
        try:
            for name, p in params.items():
                live[name], p.data = p.data, self.weights[name]
            yield
        finally:
            for name, data in live.items():
                params[name].data = data

    @torch.no_grad()
    def logprobs(self, run: Run, batch: RLBatch) -> torch.Tensor:
        """log pi_ref of ``batch``'s tokens ``[B, T]`` (0 at position 0, as every log-prob pass),
        micro-batch by micro-batch, routed as the training forwards are (module docstring)."""
        from moe_rl.trainer.rl import micro_batches, packed, training_replay

        out = []
        with self.swapped_into(run.policy):
            for rows in micro_batches(run, batch.lens_B, 0, batch.tokens_BT.shape[0]):
                pack = packed(run, batch.tokens_BT[rows], batch.lens_B[rows])
                action, routes_BSLK, gates_BSLK = training_replay(run, batch, rows)
                session = RoutingSession(
                    run.policy,
                    action,
                    routes_BSLK=routes_BSLK,
                    gates_BSLK=gates_BSLK,
                    pack=pack,
                    noise=run.route_noise,
                )
                with session:
                    tokens_BT, t = batch.tokens_BT[rows], run.recipe.train.temperature
                    out.append(run.policy.logprobs(tokens_BT, temperature=t, pack=pack).logp_BT)
        return torch.cat(out)

    def use(self, run: Run, batch: RLBatch, rewards_B: torch.Tensor) -> dict[str, float]:
        """Set ``batch.ref_logp_BT`` (the loss's KL term reads it) and, with ``algo.kl_reward_coef``,
        ``batch.adv_B`` to the advantages of the rewards less the KL penalty (verl's in-reward KL:
        kl_reward_coef times the sum over the response of ``algo.kl_estimator`` of pi_old against
        pi_ref); return the penalty's metrics, means over the batch's sequences."""
        from moe_rl.trainer.rl import advantages_of

        batch.ref_logp_BT = self.logprobs(run, batch)
        algo = run.recipe.algo
        if algo.kl_reward_coef == 0:
            return {}
        kl_B = sequence_kl(batch.old_logp_BT, batch.ref_logp_BT, batch.mask_BT, algo.kl_estimator)
        shaped_B = rewards_B - algo.kl_reward_coef * kl_B
        batch.adv_B, _ = advantages_of(run, shaped_B)
        sums = torch.stack([kl_B.sum(), shaped_B.sum(), kl_B.new_tensor(float(len(kl_B)))]).double()
        kl, shaped, n = dist.all_reduce(sums, run.info.dp_group).tolist()
        return {"kl/ref_reward_seq": kl / n, "reward/shaped_mean": shaped / n}


def start_reference(run: Run) -> Reference | None:
    """The RL stage's reference, as the stage begins (None without a KL term): at RL step 0 the
    policy's weights now, saved to ``<checkpoint root>/reference``; later (a resumed run) those saved."""
    if not needs_reference(run.recipe):
        return None
    from moe_rl.megatron.checkpoint import (
        NoCheckpoint,
        checkpoint_dirs,
        load_checkpoint,
        save_checkpoint,
        step_number,
    )
    from moe_rl.trainer.context import checkpoint_root

    root = checkpoint_root(run.recipe) / REFERENCE_DIR
    if run.state.step == 0:
        ref = Reference.snapshot(run.policy)
        number = max((step_number(p) for p in checkpoint_dirs(root)), default=0) + 1
        save_checkpoint(
            root, number, run.policy.model, None, keep=1, owner=run.state.run_id, label="rl-start"
        )
        log.info("KL reference: the RL stage's starting weights (%.1f MB on this rank)", ref.nbytes / 1e6)
        return ref
    ref = Reference({n: torch.empty_like(p) for n, p in run.policy.model.named_parameters()})
    try:
        with ref.swapped_into(run.policy):  # the load writes into the reference's tensors
            load_checkpoint(root, run.policy.model, load_rng=False)
    except NoCheckpoint:
        from moe_rl.configlib import ConfigError

        raise ConfigError(
            f"algo.kl_coef / algo.kl_reward_coef: this run's RL stage started without a KL reference ({root} "
            "holds none), so its starting weights are gone: resume with both at 0, or start the RL stage "
            "again in a new train.out_dir"
        ) from None
    log.info("KL reference: the RL stage's starting weights, from %s", root)
    return ref
