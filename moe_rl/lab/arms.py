"""The arms of the GRPO / Routing Replay / GSPO comparison: one definition, as recipe overrides.

An arm is a base recipe plus ``section.field=value`` overrides, exactly what ``moe-rl train``
takes, so the same arm runs in process, under torchrun or through Slurm with the recipe file
unchanged. The demo (:mod:`moe_rl.lab.demo`), ``studies/collapse/collapse.py``, ``studies/collapse/phase.py``,
``studies/collapse/volatility.py`` and ``benchmarks/throughput.py`` all read :data:`ARMS`; the clip
bands are the loss registry's (:data:`moe_rl.losses.LOSSES`).
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_rl.losses import LOSSES

ROOT = Path(__file__).resolve().parents[2]
"The checkout (recipes and runs are found from here, whatever the working directory)."
DEMO = ROOT / "recipes" / "demo" / "base.yaml"
"The tiny policy and arithmetic task every CPU preset and the demo's SFT stage start from."


def _band(name: str) -> dict:
    """``algo`` fields of loss ``name`` at its paper's clip band (:data:`moe_rl.losses.LOSSES`)."""
    return {"name": name, "eps_low": LOSSES[name].eps_low, "eps_high": LOSSES[name].eps_high}


_GRPO = _band("grpo")
_GSPO = _band("gspo")
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

VARIANTS: dict[str, dict] = {
    "CHAOS": {"of": "GRPO", "overrides": {"train": {"start_jitter": 1.0e-7}}},
    "GRPO+frozen": {"of": "GRPO", "overrides": {"train": {"freeze_router": True}}},
    "GRPO+R3+gates": {"of": "GRPO+R3", "overrides": {"algo": {"replay_gate_weights": True}}},
}
"""Issue 31's arms, each an arm of :data:`ARMS` plus overrides (the noise design's ``extra_arms``,
studies/noise/noise.plan.yaml, pre-registered with these values; a test holds them equal): the
chaos null (GRPO from a start jittered by 1e-7, a no-op whose spread is the yardstick for every
arm difference), GRPO with the routers frozen in RL, and R3 with the engine's gate weights
replayed too. ``moe-rl compare`` takes them by name; the benchmarks that default to every arm
(studies/collapse/collapse.py) keep :data:`ARMS`."""


def _merged(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


COMPARE_ARMS: dict[str, dict] = {
    **ARMS,
    **{name: _merged(ARMS[v["of"]], v["overrides"]) for name, v in VARIANTS.items()},
}
"Every arm by name, as recipe sections: :data:`ARMS` and :data:`VARIANTS`."

DEMO_ARMS = ("GRPO", "GRPO+R2", "CHAOS")
"""The arms ``make demo`` runs (recipes/demo/dial_demo.yaml): GRPO, GRPO + R2 and the chaos null,
design (b)'s deciding contrast (studies/noise/README.md), the strongest one measured: R2 removes the steps
with out-of-range token ratios that routing causes there, and held-out accuracy does not move."""
DEMO_SEEDS = 3
"Seeds per arm of ``make demo``: each seed one paired comparison, the median and spread drawn."
FIRST_SEED = 1234
"``train.seed`` of replicate 0 (replicate ``s`` samples with ``FIRST_SEED + s``, prompts in order ``s``)."


def arm_dir(name: str) -> str:
    """A directory name for an arm: ``GRPO+R2`` -> ``grpo_r2``."""
    return name.lower().replace("+", "_")


def arm_overrides(name: str, seed: int | None = None, steps: int | None = None) -> list[str]:
    """The overrides of arm ``name`` (``algo.name=grpo``, ...); an unknown name lists the arms.
    With ``seed``: replicate ``seed`` (the same ``train.seed`` and ``task.seed`` in every arm, so
    arms differ only in ``algo``); with ``steps``: that many RL steps."""
    if name not in COMPARE_ARMS:
        raise KeyError(f"unknown arm {name!r}: use one of {', '.join(COMPARE_ARMS)}")
    ov = flatten(COMPARE_ARMS[name])
    if seed is not None:
        ov += [f"train.seed={FIRST_SEED + seed}", f"task.seed={seed}"]
    return ov + ([f"train.rl_steps={steps}"] if steps else [])


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


def is_hf_start(start: Path) -> bool:
    """Whether an SFT start is an HF safetensors folder (loaded by ``model.hf_path``) rather than a
    checkpoint directory (loaded by ``checkpoint.load``)."""
    return (Path(start) / "config.json").is_file()


def start_overrides(start: Path) -> list[str]:
    """The overrides that begin a run from SFT start ``start`` (weights only, either kind)."""
    return [f"model.hf_path={start}" if is_hf_start(start) else f"checkpoint.load={start}"]
