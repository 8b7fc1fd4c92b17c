"""recipes/tiny.yaml trains to the same losses on two megatron-core versions (CPU, fp32).

    python -m tests.megatron_losses run OUT.json          # a few SFT steps and RL steps, per step
    python -m tests.megatron_losses compare PY_A PY_B     # run under both interpreters, compare

``compare`` runs ``run`` under each interpreter (e.g. ``.venv`` with megatron-core 0.16.1 and
``.venv312`` with the newest release) and fails when a per-step value differs by more than 1e-6:
the SFT loss and gradient norm of every step, the RL loss terms, reward and gradient norm.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-6
SFT_KEYS = ("loss", "grad_norm")
RL_KEYS = ("loss/pg", "grad_norm", "reward/mean", "entropy/mean", "ratio/token_max", "kl/old_k3")


def train(out: Path) -> dict:
    """Per-step values of the tiny recipe (shortened) trained in this process."""
    import torch

    torch.set_num_threads(1)  # the same reduction order whatever the machine
    from megatron.core import __version__

    from moe_rl.config import load_recipe
    from moe_rl.tasks.arithmetic import ArithmeticTask
    from moe_rl.trainer.metrics import read_metrics
    from moe_rl.trainer.run import run

    # a few SFT steps leave every answer wrong (reward 0, no gradient): a reward that varies with
    # the sampled text gives the RL step advantages and a gradient, the same on either version
    ArithmeticTask.reward = lambda self, prompt, text: float(len(text) % 3) / 2

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(
            ROOT / "recipes" / "tiny.yaml",
            [
                "train.stages=[sft,rl]",
                f"train.out_dir={tmp}/run",
                "train.sft_steps=4",
                "train.sft_batch_size=8",
                "train.log_every=1",
                "train.rl_steps=2",
                "train.prompts_per_step=2",
                "train.group_size=4",
                "train.minibatches=2",
                "train.max_new_tokens=16",
                "train.eval_prompts=4",
                "train.flip_probe_sequences=2",
                "checkpoint.every=0",
            ],
        )
        run(recipe)
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        sft = [{k: r[k] for k in SFT_KEYS if k in r} for r in read_metrics(metrics, "sft")]
        rl = [{k: r[k] for k in RL_KEYS if k in r} for r in read_metrics(metrics, "rl")]
    result = {"megatron_core": str(__version__), "python": sys.version.split()[0], "sft": sft, "rl": rl}
    out.write_text(json.dumps(result, indent=1))
    return result


def differences(a: dict, b: dict) -> list[str]:
    """Where two runs' per-step values differ by more than :data:`TOLERANCE` (or in shape)."""
    bad = []
    for stage in ("sft", "rl"):
        if len(a[stage]) != len(b[stage]) or not a[stage]:
            bad.append(f"{stage}: {len(a[stage])} vs {len(b[stage])} steps")
            continue
        for step, (x, y) in enumerate(zip(a[stage], b[stage])):
            if x.keys() != y.keys():
                bad.append(f"{stage} step {step}: keys {sorted(x)} vs {sorted(y)}")
            for k in x.keys() & y.keys():
                if not math.isclose(x[k], y[k], rel_tol=0, abs_tol=TOLERANCE):
                    bad.append(f"{stage} step {step} {k}: {x[k]!r} vs {y[k]!r}")
    return bad


def compare(pythons: list[str]) -> int:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, py in enumerate(pythons):
            out = Path(tmp) / f"{i}.json"
            env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
            subprocess.run(
                [py, "-m", "tests.megatron_losses", "run", str(out)], cwd=ROOT, env=env, check=True
            )
            runs.append(json.loads(out.read_text()))
    a, b = runs
    print(
        f"megatron-core {a['megatron_core']} (Python {a['python']}) vs {b['megatron_core']} (Python {b['python']})"
    )
    for stage in ("sft", "rl"):
        for step, (x, y) in enumerate(zip(a[stage], b[stage])):
            diff = max((abs(x[k] - y[k]) for k in x.keys() & y.keys()), default=0.0)
            key = "loss" if stage == "sft" else "loss/pg"
            print(f"  {stage} step {step}: {key} {x.get(key)!r} vs {y.get(key)!r}  max |diff| {diff:.3g}")
    bad = differences(a, b)
    for line in bad:
        print("DIFFERS:", line)
    print(f"{'FAILED' if bad else 'OK'}: per-step values {'differ' if bad else 'agree'} within {TOLERANCE:g}")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "run":
        train(Path(argv[1]))
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return compare(argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
