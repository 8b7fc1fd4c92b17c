"""The arms of the GRPO / Routing Replay / GSPO comparison: one definition, as recipe overrides.

An arm is a base recipe plus ``section.field=value`` overrides, exactly what ``moe-rl train``
takes, so the same arm runs in process, under torchrun or through Slurm with the recipe file
unchanged. The demo (:mod:`moe_rl.trainer.demo`), ``benchmarks/collapse.py``,
``benchmarks/volatility.py`` and ``benchmarks/throughput.py`` all read :data:`ARMS`.
"""

from __future__ import annotations

import json

_GRPO = {"name": "grpo", "eps_low": 0.2, "eps_high": 0.27}
_GSPO = {"name": "gspo", "eps_low": 3e-4, "eps_high": 4e-4}
ARMS: dict[str, dict] = {
    "GRPO": {"algo": {**_GRPO, "routing": "none"}},
    "GRPO+R2": {"algo": {**_GRPO, "routing": "r2"}},
    "GRPO+R3": {"algo": {**_GRPO, "routing": "r3"}},
    "GRPO+TIS": {"algo": {**_GRPO, "routing": "none", "rollout_correction": "tis"}},
    "GSPO": {"algo": {**_GSPO, "routing": "none"}},
    "GSPO+R2": {"algo": {**_GSPO, "routing": "r2"}},
}
"""The arms of the comparison, as recipe sections: the GSPO paper's (with its clip bands) and
GRPO with truncated importance sampling against the train-inference mismatch (C = 2)."""

DEMO_ARMS = ("GRPO", "GRPO+R3", "GSPO")
"The arms ``moe-rl demo`` runs: the replay arm is the repro's (benchmarks/phase.py, REPLAY_RULE)."


def arm_dir(name: str) -> str:
    """A directory name for an arm: ``GRPO+R2`` -> ``grpo_r2``."""
    return name.lower().replace("+", "_")


def arm_overrides(name: str) -> list[str]:
    """The overrides of arm ``name`` (``algo.name=grpo``, ...); an unknown name lists the arms."""
    if name not in ARMS:
        raise KeyError(f"unknown arm {name!r}: use one of {', '.join(ARMS)}")
    return flatten(ARMS[name])


def yaml_value(v: object) -> str:
    """A value as a YAML scalar or flow sequence for an override: plain when YAML reads it back
    unchanged (``grpo``), else JSON (``"+-"``, ``[sft, rl]`` as ``["sft", "rl"]``), which YAML reads."""
    import yaml

    if isinstance(v, str) and v and v.strip() == v and yaml.safe_load(v) == v and "," not in v:
        return v
    return json.dumps(list(v) if isinstance(v, tuple) else v)


def flatten(tree: dict, prefix: str = "") -> list[str]:
    """``{"model": {"num_layers": 8}}`` -> ``["model.num_layers=8"]`` (nested sections recurse)."""
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        out += flatten(v, key + ".") if isinstance(v, dict) else [f"{key}={yaml_value(v)}"]
    return out
