"""Collapse sentinel: detectors over per-step metrics, each with an action.

Pure logic on plain floats (no torch, no I/O): the RL loop feeds it each step's metrics and
carries out the action it returns (``stop`` or ``rollback``; ``log`` is reported only).
Its state is a small dict so it survives checkpoints and resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_rl.config import SentinelConfig

ACTION_RANK = {"off": 0, "log": 1, "rollback": 2, "stop": 3}
DEAD_ENTROPY_TOL = 1e-4
"Nats below ln(V) at which the mean entropy means a uniform output (a random init sits ~1e-2 below)."


def reward_drop(
    best: float | None, below: int, reward: float, *, drop_frac: float, min_best: float
) -> tuple[float, int]:
    """One step of the collapse rule, shared by this sentinel and ``moe_rl.lab.collapse``.

    ``best`` is the running best reward (None before the first step) and ``below`` the number of
    consecutive steps under ``drop_frac`` x best, counted once the best exceeds ``min_best``
    (a run that was never good cannot collapse). Returns the updated ``(best, below)``; a run has
    collapsed when ``below`` reaches the window. The sentinel feeds it each step's reward as it
    comes (it must act within the run); the benchmark feeds it a smoothed curve after the run,
    with its own constants, so one lucky batch cannot set the best it judges against.
    """
    if best is None or reward > best:
        best = reward
    below = below + 1 if best > min_best and reward < drop_frac * best else 0
    return best, below


@dataclass
class SentinelVerdict:
    """What the sentinel saw in one step: the detectors that fired and the strongest action."""

    fired: list[str]
    action: str
    reasons: list[str]


def dead_policy(metrics: dict[str, float], vocab_size: int | None) -> str | None:
    """Why one RL step's metrics show a dead policy, or None.

    Dead: non-finite weights (``weights/finite`` is 0), the mean entropy at its maximum ln(V) (within ``DEAD_ENTROPY_TOL``: the output is
    uniform), or a gradient norm of exactly 0 over the whole step although some group had a
    learning signal (``adv/zero_std_frac`` < 1) and nothing was clipped (a clip can zero every
    informative sample's gradient legitimately: GSPO's sequence clip on off-policy rows).
    """
    if metrics.get("weights/finite") == 0.0:
        return "non-finite weights after the step (not synced to the rollout engine)"
    entropy = metrics.get("entropy/mean")
    if vocab_size and entropy is not None and entropy >= math.log(vocab_size) - DEAD_ENTROPY_TOL:
        return f"entropy {entropy:.5f} at its maximum ln({vocab_size}) = {math.log(vocab_size):.5f} (uniform output)"
    clipped = any(
        metrics.get(k, 0.0) > 0
        for k in ("clip/token_frac", "clip/seq_frac", "clip/dual_clip_frac", "correction/masked_frac")
    )
    signal = metrics.get("adv/zero_std_frac", 1.0) < 1.0 and not clipped
    if signal and metrics.get("grad_norm") == 0.0 and not metrics.get("optim/skipped_updates"):
        return "gradient norm exactly 0 over the step despite a learning signal"
    return None


class Sentinel:
    """Reward drop, sequence log-ratio explosion, gradient explosion, entropy collapse, and a dead
    policy (:func:`dead_policy`; always on: rollback, or stop when no rollback is left)."""

    def __init__(self, cfg: SentinelConfig, state: dict | None = None, *, vocab_size: int | None = None):
        self.cfg = cfg
        self.state = dict(state or {"best_reward": None, "below": 0, "rollbacks": 0})
        self.vocab_size = vocab_size
        "The policy's vocabulary (for the dead-policy entropy; None: that check is off)."

    def check(self, metrics: dict[str, float]) -> SentinelVerdict:
        """Run every detector on one RL step's metrics; the strongest action of those that fired."""
        cfg = self.cfg
        verdict = SentinelVerdict(fired=[], action="off", reasons=[])
        actions = []

        def fire(detector: str, action: str, reason: str) -> None:
            verdict.fired.append(detector)
            verdict.reasons.append(reason)
            actions.append(action)

        reward = metrics.get("reward/mean")
        if reward is not None and cfg.reward_action != "off":
            best, below = reward_drop(
                self.state["best_reward"],
                self.state["below"],
                reward,
                drop_frac=cfg.reward_drop_frac,
                min_best=cfg.reward_min_best,
            )
            self.state.update(best_reward=best, below=below)
            if below >= cfg.reward_window:
                reason = (
                    f"reward {reward:.3f} below {cfg.reward_drop_frac} x best {best:.3f} for {below} steps"
                )
                fire("reward", cfg.reward_action, reason)
        seq_log_ratio = max(
            abs(metrics.get("ratio/seq_log_sum_min", 0.0) or 0.0),
            abs(metrics.get("ratio/seq_log_sum_max", 0.0) or 0.0),
        )
        limit = cfg.max_abs_seq_log_ratio
        if cfg.ratio_action != "off" and limit > 0 and seq_log_ratio > limit:
            fire("ratio", cfg.ratio_action, f"|sequence log-ratio| {seq_log_ratio:.1f} > {limit}")
        grad_norm = metrics.get("grad_norm")
        limit = cfg.max_grad_norm
        if cfg.grad_action != "off" and grad_norm is not None and limit > 0 and not grad_norm <= limit:
            fire("grad", cfg.grad_action, f"grad norm {grad_norm:.3g} > {limit}")
        entropy = metrics.get("entropy/mean")
        if cfg.entropy_action != "off" and entropy is not None and entropy < cfg.min_entropy:
            fire("entropy", cfg.entropy_action, f"entropy {entropy:.4f} < {cfg.min_entropy}")
        dead = dead_policy(metrics, self.vocab_size)
        if dead is not None:
            fire("dead", "rollback", f"dead policy: {dead}")
        verdict.action = max(actions, key=ACTION_RANK.__getitem__, default="off")
        if verdict.action == "rollback":
            if self.state["rollbacks"] >= cfg.max_rollbacks:
                verdict.action = "stop"
                verdict.reasons.append(f"already rolled back {self.state['rollbacks']} times")
            else:
                self.state["rollbacks"] += 1
                self.state["below"] = 0
        return verdict
