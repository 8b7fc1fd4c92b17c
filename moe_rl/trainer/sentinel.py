"""Collapse sentinel: detectors over per-step metrics, each with an action.

Pure logic on plain floats (no torch, no I/O): the RL loop feeds it each step's metrics and
carries out the action it returns (``stop`` or ``rollback``; ``log`` is reported only).
Its state is a small dict so it survives checkpoints and resume.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config import SentinelConfig

ACTION_RANK = {"off": 0, "log": 1, "rollback": 2, "stop": 3}


def reward_drop(
    best: float | None, below: int, reward: float, *, drop_frac: float, min_best: float
) -> tuple[float, int]:
    """One step of the collapse rule, shared by this sentinel and ``benchmarks/collapse.py``.

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
class Verdict:
    """What the sentinel saw in one step: the detectors that fired and the strongest action."""

    fired: list[str]
    action: str
    reasons: list[str]


class Sentinel:
    """Reward drop, sequence log-ratio explosion, gradient explosion, entropy collapse."""

    def __init__(self, cfg: SentinelConfig, state: dict | None = None):
        self.cfg = cfg
        self.state = dict(state or {"best_reward": None, "below": 0, "rollbacks": 0})

    def check(self, m: dict[str, float]) -> Verdict:
        c = self.cfg
        fired, reasons, actions = [], [], []
        r = m.get("reward/mean")
        if r is not None and c.reward_action != "off":
            best, below = reward_drop(
                self.state["best_reward"],
                self.state["below"],
                r,
                drop_frac=c.reward_drop_frac,
                min_best=c.reward_min_best,
            )
            self.state.update(best_reward=best, below=below)
            if self.state["below"] >= c.reward_window:
                fired.append("reward")
                actions.append(c.reward_action)
                reasons.append(
                    f"reward {r:.3f} below {c.reward_drop_frac} x best {best:.3f} for "
                    f"{self.state['below']} steps"
                )
        lr = max(
            abs(m.get("ratio/seq_log_sum_min", 0.0) or 0.0), abs(m.get("ratio/seq_log_sum_max", 0.0) or 0.0)
        )
        if c.ratio_action != "off" and c.max_abs_seq_log_ratio > 0 and lr > c.max_abs_seq_log_ratio:
            fired.append("ratio")
            actions.append(c.ratio_action)
            reasons.append(f"|sequence log-ratio| {lr:.1f} > {c.max_abs_seq_log_ratio}")
        g = m.get("grad_norm")
        if c.grad_action != "off" and g is not None and c.max_grad_norm > 0 and not g <= c.max_grad_norm:
            fired.append("grad")
            actions.append(c.grad_action)
            reasons.append(f"grad norm {g:.3g} > {c.max_grad_norm}")
        e = m.get("entropy/mean")
        if c.entropy_action != "off" and e is not None and e < c.min_entropy:
            fired.append("entropy")
            actions.append(c.entropy_action)
            reasons.append(f"entropy {e:.4f} < {c.min_entropy}")
        action = max(actions, key=ACTION_RANK.__getitem__, default="off")
        if action == "rollback":
            if self.state["rollbacks"] >= c.max_rollbacks:
                action = "stop"
                reasons.append(f"already rolled back {self.state['rollbacks']} times")
            else:
                self.state["rollbacks"] += 1
                self.state["below"] = 0
        return Verdict(fired=fired, action=action, reasons=reasons)
