"""``make demo``: SFT once (cached), then GRPO, GRPO + R2 and GSPO from the same start; report
(``report.png``: :func:`moe_rl.trainer.report.story`; ``report-detail.png``: every metric).

The arms are :data:`moe_rl.trainer.arms.DEMO_ARMS`: ``recipes/demo/base.yaml`` plus each arm's
overrides, so the demo and the benchmarks compare the same algorithm settings.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from moe_rl.config import load_recipe
from moe_rl.megatron.checkpoint import latest_checkpoint
from moe_rl.trainer.arms import DEMO_ARMS, arm_dir, arm_overrides
from moe_rl.trainer.report import load_arm, report, story
from moe_rl.trainer.timer import StepTimer

log = logging.getLogger(__name__)


def _train(recipe: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", str(recipe), *overrides]
    log.info("running %s", " ".join(cmd))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, check=True, env=env)


def run_demo(
    recipe_dir: str | Path = "recipes/demo", overrides: list[str] = (), *, out: str | Path = "runs/demo"
) -> str:
    """Run (or reuse) the SFT start and the RL arms; write report.png and report.json under ``out``."""
    recipe_dir, out = Path(recipe_dir), Path(out)
    base_file = recipe_dir / "base.yaml"
    timer = StepTimer()
    with timer.record("sft"):
        base = load_recipe(base_file, overrides)
        sft_ckpt = Path(base.train.out_dir) / "checkpoints"
        if latest_checkpoint(sft_ckpt) is None:
            _train(base_file, list(overrides))
        else:
            log.info("reusing the SFT start at %s (delete it to retrain)", sft_ckpt)
    runs = {}
    with timer.record("arms"):
        for name in DEMO_ARMS:
            arm_out = out / arm_dir(name)
            shutil.rmtree(arm_out, ignore_errors=True)
            rl_only = ["train.stages=[rl]", f"train.out_dir={arm_out}", f"checkpoint.load={sft_ckpt}"]
            _train(base_file, [*overrides, *arm_overrides(name), *rl_only])
            runs[name] = str(arm_out)
    with timer.record("report"):
        table, rows = report(runs, out / "report-detail.png")
        told = story({name: load_arm(d) for name, d in runs.items()}, out / "report.png")
    t_sft, wall = timer.seconds["sft"], timer.total()
    doc = {"rows": rows, "story": told, "sft_s": t_sft, "wall_s": wall}
    (out / "report.json").write_text(json.dumps(doc, indent=1))
    return (
        f"{table}\n\n{told['title']}; {told['ingredient']}: {told['why']}\n"
        f"SFT {t_sft:.0f}s, total {wall:.0f}s; picture: {out / 'report.png'} (every metric: {out / 'report-detail.png'})"
    )
