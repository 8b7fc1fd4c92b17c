"""``make gpu-check``'s script cannot rot: its dry run (the same sections on tiny shapes, CPU here)
finishes every section with status ok and writes a headline, in under a minute of CPU time (about
30 s on an idle 2-core machine, design (e)'s GPU arm included; wall time is bounded loosely, as CI
machines are shared)."""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from tools.gpu_check import EXTRA_MODES, SECTIONS, requirements

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_finishes_every_section(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    res = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = tmp_path.glob("gpu_check-*-dry-*.json")
    doc = json.loads(path.read_text())
    assert path.with_suffix(".png").exists()
    for name in SECTIONS:
        sec = doc["sections"][name]
        assert sec["status"] == "ok", (name, sec.get("error"), sec.get("traceback"))
    h = doc["headline"]
    assert h["all_ok"] and h["matmul_tflops"] > 0
    assert set(h["rl_step"]) == {
        f"{a}/{r}" for a in ("grpo", "gspo", "gspo_token") for r in ("none", "r2", "r3")
    } | set(EXTRA_MODES) | {"resume"}
    assert all(h["rl_step"].values()), h["rl_step"]
    modes = doc["sections"]["rl_step"]["modes"]
    assert all(modes[name]["effect_ok"] for name in EXTRA_MODES), {n: modes[n]["effect"] for n in EXTRA_MODES}
    assert h["moe_1b"]["train_pass_profile"]["wall_ms"] > 0, doc["sections"]["moe_1b"]["profile"]
    # the dry run's passes are tiny: their time is noise, so the growth is only read, not judged
    assert h["moe_target"]["tokens_per_s_per_gpu"] > 0 and h["moe_target"]["pass_time_growth_8k_to_16k"] > 0
    assert (
        doc["sections"]["moe_1b"]["profile"]["top_host"]
        and doc["sections"]["moe_1b"]["profile"]["top_python"]
    )
    assert h["moe_1b"]["train_pass_profile"]["unprofiled_wall_ms"] > 0
    assert h["tests"]["failed"] + h["tests"]["error"] == 0
    assert h["colocated"]["ipc_ok"] and h["colocated"]["offload_ok"], doc["sections"]["colocated"]
    if not torch.cuda.is_available():  # tests/gpu skips on CPU, and the dry run records it
        assert h["tests"]["passed"] == 0 and h["tests"]["skipped"] > 0
    assert h["moe_1b"]["train_mfu"] > 0 and h["rollout_vs_trainer"]
    by_step = h["moe_1b"]["train_mfu_by_step"]
    assert by_step and all(r["mfu"] > 0 and r["positions"] > 0 for r in by_step)
    assert by_step[-1]["mfu"] == h["moe_1b"]["train_mfu"]  # the timed step is the last
    # design (e)'s GPU arm, run by its own command: one state scored, its JSON + PNG beside the run's
    assert h["one_update"]["states"] == {"moe": 1, "dense": 0}, h["one_update"]
    assert h["one_update"]["Delta_R3"]["M2"]["n"] == 1
    arm = tmp_path / doc["sections"]["one_update"]["result"]
    assert arm.name.startswith("one_update_gpu-") and arm.with_suffix(".png").exists()
    assert json.loads(arm.read_text())["headline"] == doc["sections"]["one_update"]["headline"]
    assert cpu < 60 and wall < 180, f"dry run took {cpu:.0f} CPU s, {wall:.0f} s wall"


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the dry run and its pytest)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def test_wheel_requirements_leave_out_what_the_gpu_has():
    reqs = requirements(("numpy",))
    names = [r.split(">")[0].split("=")[0] for r in reqs]
    assert "megatron-core" not in names and "torch" not in names and "tensorboard" not in names
    assert {"setuptools", "wheel", "pytest", "pytest-timeout", "fastapi", "pip", "numpy"} <= set(names)
