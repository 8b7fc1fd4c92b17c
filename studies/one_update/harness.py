"""Design (e)'s harness: from one saved state s and one rollout batch, each arm's M minibatch updates,
every arm from the same copy of s, scored by the true change in expected reward.

Everything goes through the trainer's own seams, nothing copies its loop: the rollout batch is
:func:`moe_rl.trainer.rl.collect`'s, the M updates are :func:`moe_rl.trainer.rl.train_on` under a
:meth:`Run.derive`-d run (the arm's ``algo``, ``train.minibatches`` = M), the weights are copied by
the policy's ``state_dict`` and Adam by :meth:`Optimizer.snapshot` / :meth:`Optimizer.restore`.

Scoring (:func:`score`): V is drawn from pi_s before any arm trains. For each updated policy
theta', per sequence y of V, ``w = pi_theta'(y) / pi_s(y)`` (both under the policy's natural routes,
the trainer's forward) and

    dJ = mean over V of (w - 1) (R - b)        b: the mean reward of the prompt's other samples in V

an unbiased estimate of J(theta') - J(s) (E_s[w - 1] = 0 and the leave-one-out b is independent of
y's own w), with w clipped at ``w_clip`` beside it; ``kl`` = mean of (w - 1) - log w, the k3
estimate of KL(pi_s || pi_theta'), unbiased and >= 0 (``kl_k1`` = mean of -log w beside it).

Shape legend: B = rows, T = tokens, S = T - 1 input positions, L = MoE layers, K = top-k; N = rows of
a scoring set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass, replace

import torch

from moe_rl.lab.arms import COMPARE_ARMS
from moe_rl.rollout.types import Rollouts
from moe_rl.routing.flip import flip_metrics
from moe_rl.tasks.base import make_rng
from moe_rl.trainer.context import Run
from moe_rl.trainer.rl import (
    RLBatch,
    collect,
    encode_prompts,
    old_policy_pass,
    rewards_of,
    route_flips,
    sampling_for,
    shuffled,
    train_on,
)
from moe_rl.trainer.run import jitter_weights

JITTER = 1.0e-7
"The jittered null's weight noise (design (a)'s chaos null, ``train.start_jitter``)."
TRAIN_METRICS = (
    "ratio/token_frac_outside_0.5_2",
    "clip/token_frac",
    "flip/drift/rate",
    "flip/drift/router_rate",
    "grad_norm",
    "entropy/mean",
    "optim/skipped_updates",
)
"What each arm keeps of :func:`train_on`'s metrics (means over its M updates; grad_norm the largest)."


@dataclass(frozen=True)
class Arm:
    """One arm of the one-step comparison."""

    name: str
    "Its name in the results."
    of: str
    "The arm of :data:`moe_rl.lab.arms.COMPARE_ARMS` whose ``algo`` section it trains with."
    batch: str = "B"
    "The batch it trains on: ``B`` (the run's own) or ``B'`` (sampled with the engine's routing noise)."
    null: str | None = None
    "``order`` (its minibatches in another order), ``jitter`` (from a jittered copy of s), or None."


ARMS = {
    a.name: a
    for a in (
        Arm("GRPO", "GRPO"),
        Arm("GRPO+R2", "GRPO+R2"),
        Arm("GSPO", "GSPO"),
        Arm("NULL-order", "GRPO", null="order"),
        Arm("NULL-jitter", "GRPO", null="jitter"),
        Arm("GRPO'", "GRPO", batch="B'"),
        Arm("GRPO+R3", "GRPO+R3", batch="B'"),
    )
}
"Every arm by name: on B, GRPO, GRPO + R2, GSPO and the two nulls; on B', GRPO and GRPO + R3."


# -- one state, copied ---------------------------------------------------------------------------
@dataclass
class Snapshot:
    """State s in memory: the policy's weights (its ``state_dict``) and the optimizer's state."""

    weights: dict
    optimizer: dict


def snapshot(run: Run) -> Snapshot:
    """A copy of ``run``'s weights and optimizer state that later updates leave as it is."""
    weights = {
        k: v.detach().clone() if torch.is_tensor(v) else v for k, v in run.policy.model.state_dict().items()
    }
    return Snapshot(weights, run.optimizer.snapshot())


def restore(run: Run, snap: Snapshot) -> None:
    """``run``'s policy and optimizer back to ``snap`` (the engine served the same weights again)."""
    run.policy.model.load_state_dict(snap.weights, strict=True)
    run.optimizer.restore(snap.optimizer)
    run.push_weights()


# -- the batches ---------------------------------------------------------------------------------
class KeptRollouts:
    """An engine that keeps the first rollouts ``inner`` makes and serves them again to every later
    call with the same prompts: two pi_old passes (GRPO's natural one, R3's replayed one) of one
    sample."""

    def __init__(self, inner):
        self.inner, self.kept, self.name = inner, None, getattr(inner, "name", "kept")
        self.weight_version = getattr(inner, "weight_version", "0")

    def generate(self, prompts: list[list[int]], n: int, sampling) -> Rollouts:
        if self.kept is None:
            self.kept = (self.inner.generate(prompts, n, sampling), [list(p) for p in prompts], n)
        rollouts, ids, kept_n = self.kept
        if [list(p) for p in prompts] != ids or n != kept_n:
            raise RuntimeError("KeptRollouts serves one call's rollouts: these prompts are not theirs")
        return rollouts

    def update_weights(self, source, version: str) -> str:
        self.weight_version = self.inner.update_weights(source, version)
        return self.weight_version

    def close(self) -> None:
        self.inner.close()


@dataclass
class Batches:
    """What the arms train on, collected at s."""

    B: RLBatch
    "The run's own rollout batch of the step, pi_s's routes recorded (R2 replays them; GRPO ignores them)."
    B_r3: RLBatch | None
    "B': sampled with the engine's routing noise; pi_old and the updates replay the engine's routes."
    B_grpo: RLBatch | None
    "The same B' rows with GRPO's natural pi_old pass."
    metrics: dict
    "collect's metrics of B (``B/*``) and of B' under R3 (``B'/*``)."


def arm_run(run: Run, arm: Arm, minibatches: int) -> Run:
    """``run`` derived for ``arm`` at ``minibatches`` updates (the optimizer shared; no probe hooks'
    rows: the harness measures what it reports itself)."""
    algo = replace(run.recipe.algo, **COMPARE_ARMS[arm.of]["algo"])
    train = replace(run.recipe.train, minibatches=minibatches, flip_probe_sequences=0)
    return run.derive(algo=algo, train=train)


def collect_batches(run: Run, step: int, sigma: float | None) -> Batches:
    """B (R2's collect: its pi_old pass records the natural routes) and, with ``sigma``, B' from an
    engine with routing noise ``sigma``, collected under R3 and again under GRPO from the same rollouts."""
    batch, m = collect(arm_run(run, ARMS["GRPO+R2"], run.recipe.train.minibatches), step)
    metrics = {f"B/{k}": v for k, v in m.items()}
    if sigma is None:
        return Batches(batch, None, None, metrics)
    kept = KeptRollouts(run.embedded_engine(route_noise=sigma))
    try:
        r3 = arm_run(run, ARMS["GRPO+R3"], run.recipe.train.minibatches).derive(
            engine=kept, engine_gives_routes=True
        )
        b_r3, m3 = collect(r3, step)
        grpo = arm_run(run, ARMS["GRPO'"], run.recipe.train.minibatches).derive(
            engine=kept, engine_gives_routes=True
        )
        b_grpo, _ = collect(grpo, step)
    finally:
        kept.close()
    metrics.update({f"B'/{k}": v for k, v in m3.items()})
    return Batches(batch, b_r3, b_grpo, metrics)


def block_order(rows: int, minibatches: int, seed: int) -> torch.Tensor:
    """The row order that puts ``rows``' ``minibatches`` contiguous blocks in another order: a
    permutation of the blocks other than the identity, drawn from ``seed``."""
    if minibatches < 2:
        raise ValueError("the order null needs at least 2 minibatches to reorder")
    g = torch.Generator().manual_seed(seed)
    perm = torch.arange(minibatches)
    while bool((perm == torch.arange(minibatches)).all()):
        perm = torch.randperm(minibatches, generator=g)
    per = rows // minibatches
    return (perm[:, None] * per + torch.arange(per)[None, :]).reshape(-1)


def reordered(batch: RLBatch, minibatches: int, seed: int) -> RLBatch:
    """``batch`` with its minibatches in another order (:func:`block_order`): the same M updates'
    rows, another path."""
    order = block_order(batch.tokens_BT.shape[0], minibatches, seed)
    return shuffled(batch, order.to(batch.tokens_BT.device))


# -- scoring sets --------------------------------------------------------------------------------
@dataclass
class ScoringSet:
    """Sequences drawn from pi_s, each with its reward, leave-one-out baseline and log pi_s."""

    tokens_BT: torch.Tensor
    mask_BT: torch.Tensor
    lens_B: torch.Tensor
    reward_B: torch.Tensor
    baseline_B: torch.Tensor
    logp_s_B: torch.Tensor  # float64 sums over the response tokens, the trainer's natural forward
    engine_logp_B: torch.Tensor  # the same sums from the engine that sampled them
    group: int

    @property
    def sha(self) -> str:
        """A fingerprint of the sequences (which V an arm was scored on)."""
        return hashlib.sha256(self.tokens_BT.cpu().numpy().tobytes()).hexdigest()[:16]


def loo_baseline(reward_B: torch.Tensor, group: int) -> torch.Tensor:
    """Per row, the mean reward of the other ``group - 1`` rows of its prompt (rows of a prompt adjacent)."""
    r = reward_B.double().view(-1, group)
    return ((r.sum(1, keepdim=True) - r) / (group - 1)).reshape(-1)


def seq_logp(run: Run, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, lens_B: torch.Tensor):
    """``(logp_B, logp_BT, routes_BSLK)``: every row's response log-prob (float64 sum), per token, and
    its natural routes, under the policy's current weights (the trainer's pi_old forward, natural)."""
    natural = run.derive(algo=replace(run.recipe.algo, routing="none", old_logprobs="recompute"))
    logp_BT, routes_BSLK, _ = old_policy_pass(natural, tokens_BT, None, lens_B)
    return (logp_BT.double() * mask_BT).sum(1), logp_BT, routes_BSLK


def draw_scoring_set(run: Run, prompts: list, n: int, seed: int) -> ScoringSet:
    """``n`` samples of each prompt from the policy as it is now (pi_s), seeded by ``seed``."""
    if n < 2:
        raise ValueError(f"a scoring set needs >= 2 samples per prompt for its baseline, got {n}")
    sampling = dataclasses.replace(sampling_for(run, 0), seed=seed)
    ro = run.generate(encode_prompts(run, prompts), n, sampling)
    reward_B = rewards_of(run, prompts, ro, n)
    lens_B = (ro.total_lens_B - 1).to(torch.int64)
    mask_BT = ro.response_mask_BT.to(torch.float32)
    logp_B, _, _ = seq_logp(run, ro.tokens_BT, mask_BT, lens_B)
    engine_B = (ro.logprobs_BT.double() * mask_BT).sum(1)
    return ScoringSet(ro.tokens_BT, mask_BT, lens_B, reward_B, loo_baseline(reward_B, n), logp_B, engine_B, n)


def score(run: Run, v: ScoringSet, w_clip: float) -> dict[str, float]:
    """dJ, clipped dJ, KL (k3, k1) and the weights' range of the policy as it is now, on ``v``."""
    logp_B, _, _ = seq_logp(run, v.tokens_BT, v.mask_BT, v.lens_B)
    return score_from(logp_B, v, w_clip)


def score_from(logp_B: torch.Tensor, v: ScoringSet, w_clip: float) -> dict[str, float]:
    """:func:`score`'s figures from theta''s sequence log-probs ``logp_B`` on ``v``."""
    log_w = logp_B - v.logp_s_B
    w = log_w.exp()
    adv = v.reward_B.double() - v.baseline_B
    return {
        "dJ": float(((w - 1) * adv).mean()),
        "dJ_clip": float(((w.clamp(max=w_clip) - 1) * adv).mean()),
        "kl": float(((w - 1) - log_w).mean()),
        "kl_k1": float((-log_w).mean()),
        "w_mean": float(w.mean()),
        "w_max": float(w.max()),
        "w_min": float(w.min()),
    }


# -- one arm -------------------------------------------------------------------------------------
def train_arm(run: Run, snap: Snapshot, arm: Arm, minibatches: int, batches: Batches, seed: int) -> dict:
    """From s, ``arm``'s ``minibatches`` updates on its batch; its train metrics. The policy is
    theta' afterwards."""
    restore(run, snap)
    batch = batches.B if arm.batch == "B" else (batches.B_r3 if arm.of == "GRPO+R3" else batches.B_grpo)
    if batch is None:
        raise ValueError(f"arm {arm.name} trains on B', which was not collected (no engine noise given)")
    if arm.null == "order":
        batch = reordered(batch, minibatches, seed)
    if arm.null == "jitter":
        jitter_weights(run.policy, JITTER, seed)
        run.optimizer.reload_model_params()  # bf16: the fp32 main weights are the jittered ones
    metrics = train_on(arm_run(run, arm, minibatches), batch)
    return {k: metrics[k] for k in TRAIN_METRICS if k in metrics}


def measure_arm(run: Run, batch: RLBatch, sets: dict[str, ScoringSet], w_clip: float) -> dict:
    """theta' (the policy as it is now) scored on every set of ``sets``, and on ``batch`` (the rows it
    trained on): its routes' drift from pi_s's (per slot, the GSPO paper's unit; per router) and the
    share of response tokens whose ratio to pi_s left [0.5, 2]."""
    out = {name: score(run, v, w_clip) for name, v in sets.items()}
    _, logp_BT, routes_BSLK = seq_logp(run, batch.tokens_BT, batch.mask_BT, batch.lens_B)
    mask = batch.mask_BT.bool()
    ratio = (logp_BT.double() - batch.old_logp_BT.double())[mask].exp()
    out["token_out_final"] = float(((ratio < 0.5) | (ratio > 2.0)).double().mean())
    if batch.old_routes_BSLK is not None:
        counts = route_flips(routes_BSLK, batch.old_routes_BSLK, batch.valid_BS)
        drift = flip_metrics({k: v.float() for k, v in counts.items()}, "drift")
        out["drift_slot"], out["drift_router"] = drift["drift/rate"], drift.get("drift/router_rate", 0.0)
    return out


# -- one state -----------------------------------------------------------------------------------
def fresh_seed(what: str, seed: int, step: int) -> int:
    """A seed of this study's own (``what``: V1, V2, order, jitter), never one a run draws."""
    return make_rng(f"one_update/{what}", seed, step).randrange(2**31)


def score_state(run: Run, step: int, cfg: dict, *, seed: int) -> dict:
    """Every arm of ``cfg`` from the state ``run`` holds now, on the batches of RL step ``step``.

    ``cfg``: ``arms`` (names of :data:`ARMS`), ``minibatches`` (the Ms), ``v_per_prompt`` (V1: that
    many samples of each of B's prompts), ``heldout`` ([prompts, samples]: V2), ``w_clip``,
    ``engine_sigma`` (B''s routing noise; None: no B'). ``seed`` names the run (fresh seeds)."""
    t0, snap = time.perf_counter(), snapshot(run)
    prompts = run.task.sample(step, run.recipe.train.prompts_per_step, run.recipe.task.seed)
    sets = {"V1": draw_scoring_set(run, prompts, cfg["v_per_prompt"], fresh_seed("V1", seed, step))}
    if cfg.get("heldout"):
        n_prompts, n = cfg["heldout"]
        sets["V2"] = draw_scoring_set(run, run.task.heldout(n_prompts), n, fresh_seed("V2", seed, step))
    needs_b_prime = any(ARMS[a].batch == "B'" for a in cfg["arms"])
    batches = collect_batches(run, step, cfg.get("engine_sigma") if needs_b_prime else None)
    record = {"V": {k: _set_info(v) for k, v in sets.items()}, "batch": batches.metrics, "arms": {}}
    for m in cfg["minibatches"]:
        for name in cfg["arms"]:
            arm, t = ARMS[name], time.perf_counter()
            train = train_arm(run, snap, arm, m, batches, fresh_seed(arm.null or "arm", seed, step))
            trained_on = batches.B if arm.batch == "B" else batches.B_grpo
            rec = measure_arm(run, trained_on, sets, cfg["w_clip"])
            record["arms"][f"{name}@M{m}"] = {**rec, "train": train, "seconds": time.perf_counter() - t}
    restore(run, snap)  # s again, scored as an arm is: w = 1 exactly, so dJ = KL = 0 exactly
    record["s"] = score(run, sets["V1"], cfg["w_clip"])
    record["seconds"] = time.perf_counter() - t0
    return record


def _set_info(v: ScoringSet) -> dict:
    mask = v.mask_BT.bool()
    gap = (v.logp_s_B - v.engine_logp_B).abs()
    return {
        "n": int(v.tokens_BT.shape[0]),
        "group": v.group,
        "sha": v.sha,
        "reward_mean": float(v.reward_B.double().mean()),
        "response_tokens": int(mask.sum()),
        "engine_vs_trainer_max_abs_logp": float(gap.max()) if gap.numel() else math.nan,
    }
