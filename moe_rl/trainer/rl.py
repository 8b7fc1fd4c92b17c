"""The RL step (docs/design.md, "One RL step"): generate, score, pi_old, M minibatch updates, sync.

Shape legend: B = sequences of this data-parallel rank, T = padded tokens, S = T - 1 model
input positions, L = MoE layers, K = top-k. Rows of one prompt's group are adjacent.

Packing (``train.packing``, on by default): every forward here (pi_old, training, flip probes)
runs on its micro-batch's rows packed into one sequence (:mod:`moe_rl.megatron.packing`), so no
padding position is computed; log-probs, entropy and routes come back in the ``[B, T]`` /
``[B, S, L, K]`` layout, and the losses, flip metrics and replay see no difference.

The three algorithms differ only in ``algo.name`` and ``algo.routing``; everything else,
including prompt order and sampling seeds, is shared, so A/B runs change one field.

Devices: engines return their batch on the host; ``Run.generate`` moves it to the policy's
device once, where the step takes it from the engine, and everything after it (rewards,
advantages, masks, routes, engine log-probs, the counts the data-parallel collectives reduce)
lives there. No other function here moves a tensor between devices.

Phases, as :func:`rl_step` times them (``time/<phase>`` in the metrics; they add up to
``time/step``): rollout (sample prompts, ``engine.generate``), old_logprob (rewards,
advantages, the pi_old forward), train (the M updates), probe (the run's hooks inside train,
the flip probe among them, excluded from it: :mod:`moe_rl.trainer.hooks`), sync
(``engine.update_weights``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe_rl import dist
from moe_rl.losses import combine_metrics, get_loss, group_advantages, loss_batch
from moe_rl.losses.corrections import (
    CORRECTION_METRIC_REDUCTIONS,
    correction_metrics,
    correction_weights_for,
    mismatch_metrics,
)
from moe_rl.megatron.checkpoint import weights_finite
from moe_rl.megatron.routing import RoutingSession
from moe_rl.rollout.types import Rollouts, SamplingParams
from moe_rl.routing import RouterAction
from moe_rl.routing.codec import decode_routes
from moe_rl.routing.load import expert_load_counts, expert_load_metrics
from moe_rl.routing.noise import RouteNoise
from moe_rl.routing.validate import validate_routes
from moe_rl.tasks.base import Prompt, batch_rewards, make_rng
from moe_rl.trainer.batch import RLBatch as RLBatch  # re-exported, as the forwards: where callers found them
from moe_rl.trainer.forwards import chunks as chunks
from moe_rl.trainer.forwards import flip_rates, micro_batches, packed, probe_rows, route_flips
from moe_rl.trainer.forwards import natural_routes as natural_routes
from moe_rl.trainer.hooks import OptimizerStep, StepHook
from moe_rl.trainer.probe import FlipProbe, RoutingShareProbe
from moe_rl.trainer.samples import samples_due, write_samples
from moe_rl.trainer.sft import encode_pair
from moe_rl.trainer.timer import StepTimer

if TYPE_CHECKING:
    from moe_rl.trainer.context import Run

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"A loss of ``moe_rl.losses.LOSSES``: ``(LossBatch, AlgoConfig) -> (loss, metrics)``."
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


@dataclass
class StepResult:
    """What one RL step produced."""

    batch: RLBatch
    "The rollout batch it trained on (this rank's rows)."
    metrics: dict[str, float]
    "Every metric of the step, reduced over data-parallel ranks, ``time/*`` included."
    skipped_updates: int
    "Optimizer steps skipped for non-finite loss or gradients (0 in a healthy step)."


def rl_step(run: Run, step: int, timer: StepTimer) -> StepResult:
    """RL step ``step``: generate, score, pi_old, M minibatch updates, weight sync."""
    batch, metrics = collect(run, step, timer)
    with timer.record("train"):
        train_metrics = train_on(run, batch, timer, step=step)  # hooks are recorded as "probe"
    finite = weights_finite(run.policy.model)  # non-finite weights never reach the engine
    with timer.record("sync"):
        if finite:
            run.push_weights()
    metrics.update(train_metrics)
    metrics["weights/finite"] = float(finite)
    metrics.update({f"time/{phase}": s for phase, s in timer.seconds.items()})
    metrics["time/step"] = timer.total()
    metrics["tokens_per_s"] = float(batch.mask_BT.sum()) * run.info.dp_size / metrics["time/step"]
    return StepResult(batch, metrics, int(train_metrics["optim/skipped_updates"]))


# -- generate and score ----------------------------------------------------------------------------
def collect(run: Run, step: int, timer: StepTimer | None = None) -> tuple[RLBatch, dict[str, float]]:
    """Rollouts, rewards, advantages and pi_old log-probs (+ routes) of RL step ``step``."""
    timer = timer or StepTimer()
    cfg = run.recipe.train  # the trainer's route noise, drawn per step (a resumed run draws the same)
    seed = make_rng("route_noise", cfg.seed, step).randrange(2**63)
    run.route_noise = RouteNoise(cfg.route_noise, seed=seed)
    with timer.record("rollout"):
        prompts, rollouts = generate(run, step)
    with timer.record("old_logprob"):  # scoring is cheap: it is timed with the pi_old forward
        rewards_B, adv_B, metrics = score(run, prompts, rollouts)
        batch, pi_old_metrics = old_policy(run, rollouts, adv_B)
        if run.reference is not None:  # a KL term: the reference's forward (and a reward penalty)
            with timer.record("reference"):
                metrics.update(run.reference.use(run, batch, rewards_B))
        if samples_due(run, step):
            write_samples(run, step, "rollout", prompts, rollouts, rewards_B, batch.adv_B, cfg.group_size)
    if cfg.shuffle_minibatches:
        order = torch.randperm(batch.tokens_BT.shape[0], generator=torch.Generator().manual_seed(seed))
        batch = shuffled(batch, order.to(batch.tokens_BT.device))
    return batch, {**metrics, **pi_old_metrics}


def shuffled(batch: RLBatch, order_B: torch.Tensor) -> RLBatch:
    """The batch's rows in ``order_B`` (``train.shuffle_minibatches``): every per-row tensor moves
    together (the probe rows are then the first rows of the new order; their "before" routes are
    recomputed by the probe)."""
    fields = {"probe_before_BSLK": None}  # of the old first rows
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if f.name not in fields:
            fields[f.name] = v.index_select(0, order_B) if isinstance(v, torch.Tensor) else v
    return RLBatch(**fields)


def generate(run: Run, step: int) -> tuple[list[Prompt], Rollouts]:
    """This rank's prompts of step ``step`` and ``train.group_size`` rollouts of each (on the
    policy's device)."""
    cfg = run.recipe.train
    prompts = local_prompts(run, run.task.sample(step, cfg.prompts_per_step, run.recipe.task.seed))
    want_routes = run.recipe.algo.routing.wants_engine_routes or run.engine_gives_routes
    sampling = sampling_for(run, step, routes=want_routes, gates=run.recipe.algo.replay_gate_weights)
    return prompts, run.generate(encode_prompts(run, prompts), cfg.group_size, sampling)


def score(
    run: Run, prompts: list[Prompt], rollouts: Rollouts
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Every row's reward ``rewards_B``, the group-normalised advantages ``adv_B`` and the reward
    and response metrics."""
    cfg = run.recipe.train
    rewards_B = rewards_of(run, prompts, rollouts, cfg.group_size)
    adv_B, stats = advantages_of(run, rewards_B)
    metrics = {k: float(v) for k, v in stats.items()}
    metrics["reward/accuracy"] = float((rewards_B >= 1.0).float().mean())
    metrics["response/len_mean"] = float(rollouts.response_mask_BT.sum(1).mean())
    metrics["response/truncated"] = sum(f == "length" for f in rollouts.finish_reasons) / rollouts.batch_size
    return rewards_B, adv_B, metrics


def advantages_of(run: Run, rewards_B: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group advantages ``adv_B`` of ``rewards_B`` (groups of ``train.group_size`` adjacent rows) and
    their statistics, by ``algo.adv_*``."""
    a, g = run.recipe.algo, run.recipe.train.group_size
    return group_advantages(
        rewards_B, g, eps=a.adv_eps, std_normalize=a.adv_std_normalize, unbiased=a.adv_std_unbiased
    )


def sampling_for(
    run: Run, step: int, *, greedy: bool = False, routes: bool = False, gates: bool = False
) -> SamplingParams:
    """Sampling of step ``step``: its seed is a function of ``train.seed`` and the step only.
    ``routes`` asks the engine for its routes, ``gates`` for their gate weights too."""
    cfg = run.recipe.train
    seed = make_rng("rollout", cfg.seed, step).randrange(2**31)
    return SamplingParams(
        temperature=0.0 if greedy else cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=(run.tok.eos_id,),
        seed=seed,
        return_routes=routes or gates,
        return_gates=gates,
    )


def local_prompts(run: Run, prompts: list[Prompt]) -> list[Prompt]:
    """This data-parallel rank's share of the step's prompts (all ranks draw the same list)."""
    per_rank = len(prompts) // run.info.dp_size
    return prompts[run.info.dp_rank * per_rank : (run.info.dp_rank + 1) * per_rank]


def encode_prompts(run: Run, prompts: list[Prompt]) -> list[list[int]]:
    return [encode_pair(run.tok, p.text, None, run.recipe.model.max_seq_len)[0] for p in prompts]


def rewards_of(run: Run, prompts: list[Prompt], rollouts: Rollouts, group: int) -> torch.Tensor:
    """The task's reward of every rollout row, ``[B]`` float32 on the policy's device (row i answers
    prompt i // group), in one :func:`batch_rewards` call. The token ids come to the host once, for
    the decoder."""
    tokens = rollouts.tokens_BT.tolist()
    starts, ends = rollouts.prompt_lens_B.tolist(), rollouts.total_lens_B.tolist()
    rows = range(rollouts.batch_size)
    out = batch_rewards(
        run.task,
        [prompts[i // group] for i in rows],
        [run.tok.decode(tokens[i][starts[i] : ends[i]]) for i in rows],
    )
    return torch.tensor(out, dtype=torch.float32, device=run.info.device)


# -- pi_old -----------------------------------------------------------------------------------------
def old_policy(run: Run, rollouts: Rollouts, adv_B: torch.Tensor) -> tuple[RLBatch, dict[str, float]]:
    """pi_old log-probs and routes (recomputed, or the engine's), the train-inference mismatch and,
    in decoupled mode, the correction weights (docs/algorithms.md#train-inference-mismatch)."""
    algo = run.recipe.algo
    tokens_BT, mask_BT = rollouts.tokens_BT, rollouts.response_mask_BT
    s = tokens_BT.shape[1] - 1
    positions_S = torch.arange(s, device=tokens_BT.device)
    valid_BS = (positions_S[None, :] < (rollouts.total_lens_B[:, None] - 1)).float()
    rollout_routes_BSLK = engine_routes(run, rollouts)
    gates_BSLK = engine_gates(run, rollouts) if algo.replay_gate_weights else None  # R3 only (config)
    rollout_logp_BT = rollouts.logprobs_BT
    old_logp_BT, is_weights, metrics = rollout_logp_BT, None, {}
    lens_B = valid_BS.sum(1).to(torch.int64)
    probe_before_BSLK = recorded_BSLK = None
    if algo.old_logprobs == "recompute" or algo.routing.needs_pi_old_pass:
        recomputed_BT, old_routes_BSLK, recorded_BSLK = old_policy_pass(
            run, tokens_BT, rollout_routes_BSLK, lens_B, gates_BSLK
        )
        probe_before_BSLK = reused_probe_before(run, old_routes_BSLK, rollout_routes_BSLK, valid_BS)
        if algo.old_logprobs == "recompute":
            old_logp_BT = recomputed_BT
            is_weights = correction_weights_for(algo, recomputed_BT, rollout_logp_BT, mask_BT)
        metrics.update(_mismatch(run, recomputed_BT, rollout_logp_BT, mask_BT, is_weights))
        if rollout_routes_BSLK is not None:  # the engine's choice against the trainer's own
            flips = [route_flips(rollout_routes_BSLK, old_routes_BSLK, valid_BS)]
            metrics.update(flip_rates(run, {"flip/rollout_vs_trainer": flips}))
    else:  # bypass mode: pi_old is the rollout policy, its routes are the engine's
        old_routes_BSLK = rollout_routes_BSLK
    replay_BSLK = algo.routing.replayed(recorded_BSLK, rollout_routes_BSLK)
    batch = RLBatch(
        tokens_BT, mask_BT, valid_BS, adv_B, old_logp_BT, replay_BSLK, old_routes_BSLK, is_weights
    )
    batch.probe_before_BSLK = probe_before_BSLK
    batch.replay_gates_BSLK = gates_BSLK
    return batch, metrics


def engine_routes(run: Run, rollouts: Rollouts) -> torch.Tensor | None:
    """The engine's routes of the input positions ``[B, S, L, K]`` (int64), checked against the
    model (:func:`moe_rl.routing.validate.validate_routes`), or None when it returned none."""
    if rollouts.routes_BTLK is None:
        return None
    s = rollouts.tokens_BT.shape[1] - 1
    m = run.recipe.model
    routes_BSLK = decode_routes(rollouts.routes_BTLK[:, :s])
    engine = getattr(run.engine, "name", type(run.engine).__name__)
    return validate_routes(
        routes_BSLK,
        rollouts.total_lens_B,
        num_layers=run.policy.num_moe_layers,
        topk=m.moe_router_topk,
        num_experts=m.num_experts,
        engine=engine,
    )


def engine_gates(run: Run, rollouts: Rollouts) -> torch.Tensor:
    """The engine's gate weights of its routes' experts ``[B, S, L, K]`` (float32), for
    ``algo.replay_gate_weights``: slot for slot those of :func:`engine_routes`."""
    engine = getattr(run.engine, "name", type(run.engine).__name__)
    gates, routes = rollouts.gates_BTLK, rollouts.routes_BTLK
    if gates is None:
        raise ValueError(
            f"algo.replay_gate_weights=true but engine {engine} returned no gate weights "
            "(Rollouts.gates_BTLK): use the embedded engine (rollout.engine=embedded) or set "
            "algo.replay_gate_weights=false"
        )
    if routes is None or gates.shape != routes.shape:
        raise ValueError(
            f"engine {engine}: gates_BTLK {tuple(gates.shape)} must match routes_BTLK "
            f"{None if routes is None else tuple(routes.shape)} slot for slot"
        )
    if not bool(torch.isfinite(gates).all()):
        raise ValueError(f"engine {engine}: gates_BTLK holds non-finite gate weights")
    return gates[:, : rollouts.tokens_BT.shape[1] - 1].float()


def _mismatch(
    run: Run,
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    is_weights: torch.Tensor | None,
) -> dict[str, float]:
    """``mismatch/*`` of pi_old against pi_roll and ``correction/*`` of the weights, over all ranks."""
    num_sequences, num_tokens = _global_counts(run, [mask_BT])[0]
    local = mismatch_metrics(old_logp_BT, rollout_logp_BT, mask_BT, num_tokens=max(num_tokens, 1.0))
    local.update(
        correction_metrics(
            is_weights, mask_BT, num_sequences=max(num_sequences, 1.0), num_tokens=max(num_tokens, 1.0)
        )
    )

    def all_reduce(t: torch.Tensor, op: str) -> None:
        dist.all_reduce(t, run.info.dp_group, REDUCE_OPS[op])

    reduced = combine_metrics([local], all_reduce=all_reduce, reductions=CORRECTION_METRIC_REDUCTIONS)
    return {k: float(v) for k, v in reduced.items()}


def old_policy_pass(
    run: Run,
    tokens_BT: torch.Tensor,
    rollout_routes_BSLK: torch.Tensor | None,
    lens_B: torch.Tensor,
    rollout_gates_BSLK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """pi_old's ``logp_BT``, its natural ``routes_BSLK`` and (R2) the recorded routes, micro-batch
    by micro-batch (R3 replays the rollout's routes, and with ``rollout_gates_BSLK`` their gate
    weights, as the training forwards do). ``lens_B``: the rows' input lengths.

    The flip-probe rows (the first ``train.flip_probe_sequences``) form micro-batches of their
    own, split as :func:`natural_routes` splits them: under natural routing (none, R2), and under
    R3 when the replayed routes were the natural ones (:func:`reused_probe_before`), their
    natural routes here are the probe's "before" routes, computed by the same operations."""
    algo, (b, s) = run.recipe.algo, (tokens_BT.shape[0], tokens_BT.shape[1] - 1)
    action = algo.routing.pi_old_action
    n_probe = probe_rows(run, b)
    logps, naturals, recorded = [], [], []
    for rows in micro_batches(run, lens_B, 0, n_probe) + micro_batches(run, lens_B, n_probe, b):
        routes = rollout_routes_BSLK[rows] if action is RouterAction.REPLAY else None
        gates = rollout_gates_BSLK[rows] if routes is not None and rollout_gates_BSLK is not None else None
        pack = packed(run, tokens_BT[rows], lens_B[rows])
        session = RoutingSession(
            run.policy, action, routes_BSLK=routes, gates_BSLK=gates, pack=pack, noise=run.route_noise
        )
        with torch.no_grad(), session:
            out = run.policy.logprobs(tokens_BT[rows], temperature=run.recipe.train.temperature, pack=pack)
        logps.append(out.logp_BT)
        naturals.append(session.natural_BSLK(rows.stop - rows.start, s))
        if action is RouterAction.RECORD:
            recorded.append(session.recorded_BSLK(rows.stop - rows.start, s))
    return torch.cat(logps), torch.cat(naturals), torch.cat(recorded) if recorded else None


def reused_probe_before(
    run: Run,
    natural_BSLK: torch.Tensor,
    replayed_BSLK: torch.Tensor | None,
    valid_BS: torch.Tensor,
) -> torch.Tensor | None:
    """The flip probe's "before" routes taken from the pi_old pass (its probe rows' natural
    captures ``natural_BSLK``) when that pass was the probe's own natural forward, else None (the
    probe then runs that forward itself).

    Natural routing (none; R2 records the natural choice): always. R3 replayed ``replayed_BSLK``
    (the rollout's routes): reused when, on packed rows (no position outside ``valid_BS`` computed)
    at TP = 1, the router's own top-k equals the replayed experts, in the same order, at every valid
    position of every layer. Then each layer gathered the same scores its natural top-k returns,
    so it dispatched the same tokens with the same gates, and by induction over layers every router
    saw the hidden states of the natural forward: the captures are that forward's routes, bit for
    bit. One differing slot (e.g. a rollout in another precision) and the probe runs its forward.
    With the engine's gate weights replayed (``algo.replay_gate_weights``) the gates are not the
    natural forward's: never reused.
    """
    n = probe_rows(run, natural_BSLK.shape[0])
    natural_BSLK = natural_BSLK[:n]
    algo = run.recipe.algo
    if algo.routing.pi_old_action is not RouterAction.REPLAY:
        return natural_BSLK
    if (
        replayed_BSLK is None
        or algo.replay_gate_weights
        or not run.recipe.train.packing
        or run.info.tp_size > 1
    ):
        return None
    same_BS = (natural_BSLK == replayed_BSLK[:n].to(natural_BSLK)).all(-1).all(-1)
    return natural_BSLK if bool(same_BS[valid_BS[:n].bool()].all()) else None


# -- the M minibatch updates -------------------------------------------------------------------------
def train_on(run: Run, batch: RLBatch, timer: StepTimer | None = None, *, step: int = 0) -> dict[str, float]:
    """M minibatch updates of RL step ``step``, the run's hooks around them (timed as "probe":
    the flip probe, :mod:`moe_rl.trainer.hooks`); their metrics, reduced over DP.

    ``optim/skipped_updates`` counts the updates the optimizer skipped (non-finite).
    """
    cfg = run.recipe.train
    timer = timer or StepTimer()
    loss_fn = get_loss(run.recipe.algo.name)
    b = batch.tokens_BT.shape[0]
    per_minibatch = b // cfg.minibatches
    minibatches = [slice(i * per_minibatch, (i + 1) * per_minibatch) for i in range(cfg.minibatches)]
    counts = _global_counts(run, [batch.mask_BT[mb] for mb in minibatches])
    hooks = step_hooks(run)
    with timer.record("probe"):
        for hook in hooks:
            hook.begin(run, step, batch)
    loss_metrics, grad_norms, entropy, flips, skipped = [], [], [], {}, 0
    for mb, (num_sequences, num_tokens) in zip(minibatches, counts):
        micro = micro_batches(run, batch.lens_B, mb.start, mb.stop)
        per_micro = [
            _micro_step(run, batch, rows, loss_fn, (num_sequences, num_tokens), entropy, flips)
            for rows in run.optimizer.micro_batches(micro)  # DDP reduces after the last backward
        ]
        loss_metrics.append(combine_metrics(per_micro))
        stats = run.optimizer.step()
        skipped += int(stats["skipped"])
        grad_norms.append(stats["grad_norm"])  # already global: the optimizer reduces the gradients
        j = len(grad_norms) - 1  # this update's index in the step
        event = OptimizerStep(run, "rl", step, j, cfg.minibatches, stats, batch)
        with timer.record("probe"):
            for hook in hooks:
                hook(event)
    metrics = _reduce_over_dp(run, loss_metrics, entropy, flips)
    for hook in hooks:
        metrics.update(hook.metrics(run))
    metrics["grad_norm"] = max(grad_norms)
    metrics["lr"] = stats["lr"]
    metrics["optim/skipped_updates"] = float(skipped)
    return metrics


def step_hooks(run: Run) -> list[StepHook]:
    """The hooks around an RL step's updates: the trainer's own probes (``ratio/routing_share``,
    whose forward serves the flip probe, then ``flip/step``), made at the run's first RL step and
    shared with the runs derived from it (:attr:`Run.probes`), then the run's own hooks."""
    if not run.probes:
        run.probes.extend([RoutingShareProbe(), FlipProbe()])
    return [*run.probes, *run.hooks]


def training_replay(
    run: Run, batch: RLBatch, rows: slice
) -> tuple[RouterAction, torch.Tensor | None, torch.Tensor | None]:
    """How a training-side forward (an update's, the reference's) of ``batch``'s ``rows`` routes:
    ``(action, routes_BSLK, gates_BSLK)``, replaying the batch's routes (with the engine's gate
    weights where the batch holds them) when the run's routing mode replays in training, else
    naturally. Decided by the run that trains, not the one that collected: a study's arms train
    on one batch."""
    if not run.recipe.algo.routing.replays_in_training:
        return RouterAction.NATURAL, None, None
    if batch.replay_BSLK is None:
        raise ValueError(
            f"algo.routing={run.recipe.algo.routing} replays routes in training, but the batch holds none "
            "(collected without replay): collect it under the routing mode that trains on it"
        )
    gates = batch.replay_gates_BSLK
    return RouterAction.REPLAY, batch.replay_BSLK[rows], None if gates is None else gates[rows]


def _micro_step(
    run: Run,
    batch: RLBatch,
    rows: slice,
    loss_fn: LossFn,
    global_counts: tuple[float, float],
    entropy: list[torch.Tensor],
    flips: dict[str, list[dict]],
) -> dict[str, torch.Tensor]:
    """Forward and backward of one micro-batch (``rows``); gradients accumulate.

    ``global_counts`` is the minibatch's (sequences, tokens) over all ranks; the entropy sums, the
    drift flip counts and the expert load counts (the routers' own choice and their softmax
    entropy in this forward, docs/algorithms.md#expert-load) of these rows are appended to
    ``entropy`` and ``flips`` (``flips["experts"]``).
    """
    cfg, algo = run.recipe.train, run.recipe.algo
    action, replay_BSLK, gates_BSLK = training_replay(run, batch, rows)
    mask_BT = batch.mask_BT[rows]
    pack = packed(run, batch.tokens_BT[rows], batch.lens_B[rows])
    session = RoutingSession(
        run.policy,
        action,
        routes_BSLK=replay_BSLK,
        gates_BSLK=gates_BSLK,
        pack=pack,
        entropy=True,
        noise=run.route_noise,
    )
    with session:
        out = run.policy.logprobs(
            batch.tokens_BT[rows], temperature=cfg.temperature, with_entropy=True, pack=pack
        )
        inputs = loss_batch(
            out.logp_BT,
            batch.old_logp_BT[rows],
            batch.adv_B[rows],
            mask_BT,
            num_sequences=global_counts[0],
            num_tokens=global_counts[1],
            is_weights=None if batch.is_weights is None else batch.is_weights[rows],
            ref_logp_BT=None if batch.ref_logp_BT is None else batch.ref_logp_BT[rows],
        )
        loss, metrics = loss_fn(inputs, algo)
        session.backward(loss)
    entropy.append(torch.stack([(out.entropy_BT.detach() * mask_BT).sum(), mask_BT.sum()]))
    b, s = rows.stop - rows.start, batch.tokens_BT.shape[1] - 1
    natural_BSLK = session.natural_BSLK(b, s)
    flips.setdefault("experts", []).append(
        expert_load_counts(
            natural_BSLK.reshape(b * s, *natural_BSLK.shape[2:]),
            run.recipe.model.num_experts,
            batch.valid_BS[rows].reshape(b * s),
            _flat(session.router_entropy_BSL(b, s)),
        )
    )
    if batch.old_routes_BSLK is not None:
        drift = route_flips(natural_BSLK, batch.old_routes_BSLK[rows], batch.valid_BS[rows])
        flips.setdefault("flip/drift", []).append(drift)
    return metrics


def _flat(x_BSL: torch.Tensor | None) -> torch.Tensor | None:
    return None if x_BSL is None else x_BSL.reshape(-1, x_BSL.shape[-1])


def _global_counts(run: Run, minibatch_masks: list[torch.Tensor]) -> list[tuple[float, float]]:
    """(sequences, tokens) of every minibatch summed over data-parallel ranks: one all-reduce, on the
    policy's device (NCCL reduces CUDA tensors only)."""
    counts = [[mk.shape[0], float(mk.sum())] for mk in minibatch_masks]
    t = torch.tensor(counts, dtype=torch.float64, device=run.info.device)
    dist.all_reduce(t, run.info.dp_group)
    return [tuple(x) for x in t.tolist()]


def _reduce_over_dp(run: Run, loss_metrics: list[dict], entropy: list, flips: dict) -> dict[str, float]:
    """Loss metrics averaged over the minibatches (``combine_metrics``), entropy and flip rates,
    each reduced over data-parallel ranks."""

    def all_reduce(t: torch.Tensor, op: str) -> None:
        dist.all_reduce(t, run.info.dp_group, REDUCE_OPS[op])

    combined = combine_metrics(loss_metrics, mean=True, all_reduce=all_reduce)
    metrics = {k: float(v) for k, v in combined.items()}
    entropy_sum, tokens = dist.all_reduce(torch.stack(entropy).sum(0), run.info.dp_group).tolist()
    metrics["entropy/mean"] = entropy_sum / max(tokens, 1.0)
    load = flips.pop("experts", None)
    if load:
        metrics.update(expert_load(run, load))
    if flips:
        metrics.update(flip_rates(run, flips))
    return metrics


def expert_load(run: Run, pieces: list[dict]) -> dict[str, float]:
    """``experts/*`` of expert load counts (:func:`expert_load_counts`), summed over the pieces
    and then over data-parallel ranks before any ratio is taken."""
    total = {k: sum(c[k] for c in pieces).clone() for k in pieces[0]}
    for v in total.values():
        dist.all_reduce(v, run.info.dp_group)
    return expert_load_metrics(total)
