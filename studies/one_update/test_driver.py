"""Design (e)'s plan and driver: the committed pre-registration is the plan, its seeds are fresh, its
states are design (b)'s cells, its engine noise the committed calibration's; the whole driver at a
smoke size (states, the decisions, scoring, the report), resumable; the GPU arm's function on CPU."""

from __future__ import annotations

import json

import pytest

from moe_rl.lab import cells
from moe_rl.lab.arms import DEMO_SEEDS, ROOT
from studies.one_update import driver, states
from studies.one_update.harness import ARMS

PLAN = driver.load_plan()


def test_the_committed_preregistration_is_the_plan():
    assert json.loads(driver.PLAN_FILE.read_text())["plan"] == PLAN


def test_the_seeds_are_fresh():
    """No design, the phase nor the demo used them (their plans' seed lists and stages)."""
    used = set(range(DEMO_SEEDS))
    for name in ("noise", "dial", "ladder", "gates"):  # designs (a) to (d)
        p = cells.load_plan(ROOT / "studies" / "noise" / f"{name}.plan.yaml")
        used |= set(p["seeds"]) | {s for e in p["order"] for s in e.get("seeds", [])}
    phase = cells.load_plan(ROOT / "studies" / "collapse" / "phase.plan.yaml")["seeds"]
    used |= {s for v in phase.values() for s in v}
    mine = [s for v in PLAN["states"]["sets"].values() for s in v["seeds"]]
    from studies.one_update.gpu import GPU_SEED

    assert len(set(mine + [GPU_SEED])) == len(mine) + 1 and not (set(mine) | {GPU_SEED}) & used


def test_the_states_are_design_bs_cells_and_the_moe_one_starts_from_the_shipped_start(tmp_path):
    runs = {r.name: r for r in states.state_runs(PLAN, tmp_path)}
    assert len(runs) == 5 and sum(r.set == "moe" for r in runs.values()) == 3
    moe = states.run_overrides(PLAN, runs["moe-s500"])
    assert moe[: len(moe) - 1] == cells.run_overrides(
        cells.load_plan(states.CELL_PLANS["b"]), "moe-dial30", "GRPO", 500, 100
    )
    assert "train.router_lr_mult=30.0" in moe and "checkpoint.keep=25" in moe
    dense = states.run_overrides(PLAN, runs["dense-s503"])
    assert "model.num_experts=2" in dense and "model.moe_router_topk=2" in dense
    assert states.start_of(PLAN, runs["moe-s500"]) == states.SHIPPED[0].with_suffix("")
    assert set(PLAN["scoring"]["arms"]["moe"]) <= set(ARMS) and set(PLAN["scoring"]["arms"]["dense"]) <= set(
        ARMS
    )


def test_the_engine_noise_is_the_committed_calibrations():
    (cal,) = sorted(driver.RESULTS.glob("one_update-*-calibrate-dial-start-*.json"))
    assert json.loads(cal.read_text())["headline"]["reaches_r3"] == PLAN["scoring"]["engine_sigma"]


def test_the_scoring_order_puts_every_other_state_first(tmp_path):
    for run in states.state_runs(PLAN, tmp_path):
        (run.out / "checkpoints").mkdir(parents=True)
        (run.out / "status.json").write_text('{"status": "done"}')
        for i, step in enumerate(range(0, 101, run.every)):
            (run.out / "checkpoints" / f"{i + 1:04d}-rl-step-{step:06d}").mkdir()
    order = driver.score_order(PLAN, tmp_path)
    moe = [s for s in order if s.run.set == "moe"]
    assert len(moe) == 60 and len(order) == 80 and all(s.run.set == "dense" for s in order[60:])
    assert all(s.step % 10 == 0 for s in moe[:30]) and all(s.step % 10 == 5 for s in moe[30:])
    assert len({s.run.seed for s in moe[:10]}) == 3  # the gate's ten span the three runs
    assert [s.name for s in driver.score_order(PLAN, tmp_path)] == [s.name for s in order]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, parallel_info):
    root = tmp_path_factory.mktemp("smoke")
    assert driver_main(["--smoke", "--root", str(root)]) == 0
    return root


def driver_main(argv):
    from studies.one_update.__main__ import main

    return main(argv)


def test_the_whole_driver_at_a_smoke_size(smoke):
    doc = json.loads((smoke / "one_update-smoke.json").read_text())
    h = doc["headline"]
    assert (smoke / "one_update-smoke.png").stat().st_size > 10_000
    for key in ("Delta_R2", "Delta_GSPO", "Delta_R3"):
        assert set(h[key]) == {"M2", "M4"} and h[key]["M4"]["n"] == 2, key
    assert set(h["Delta_null"]) == {"order", "jitter"} and h["Delta_null"]["order"]["M4"]["n"] == 2
    assert h["gate"][0]["minibatches"] == 4 and "passed" in h["gate"][0] and "se" in h["se_rule"]
    assert h["cost_per_state"]["moe"]["states"] == 2 and h["cost_per_state"]["dense"]["states"] == 1
    assert h["dense_r2_equals_grpo"]["max_abs"] == 0.0
    assert all(r["s"]["dJ"] == 0.0 for r in doc["records"])
    assert h["states"] == {"moe": 2, "dense": 1}


def test_a_rerun_scores_nothing_again(smoke):
    before = {p: p.stat().st_mtime_ns for p in (smoke / "scores").rglob("*.json")}
    assert driver_main(["--report", "--smoke", "--root", str(smoke)]) == 0
    assert driver_main(["--smoke", "--root", str(smoke)]) == 0
    assert {p: p.stat().st_mtime_ns for p in (smoke / "scores").rglob("*.json")} == before


def test_the_gpu_arm_runs_on_cpu_at_a_smoke_size(smoke, tmp_path):
    from studies.one_update.gpu import gpu_check

    start = next(
        p / "checkpoints"
        for p in (smoke / "cache").iterdir()
        if json.loads((p / "sft.json").read_text())["signature"]["model"]["num_experts"] == 4
    )
    h = gpu_check(start, tmp_path, device="cpu", dtype="float32", states_wanted=2, every=1, minibatches=2,
                  v_per_prompt=2, cell_base=driver.SMOKE_CELLS["cell_base"])  # fmt: skip
    assert h["Delta_R3"]["M2"]["n"] == 2 and "cost_per_state" in h
    assert len(list(tmp_path.glob("one_update_gpu-*.json"))) == 1


def test_bad_device_settings_fail_in_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: --device cuda is valid here")
    assert driver_main(["--device", "cuda", "--report", "--root", "/nonexistent"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert driver_main(["--dtype", "bfloat16", "--report", "--root", "/nonexistent"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err


def test_the_gpu_arm_command_refuses_a_missing_start_and_bf16_off_cuda(capsys, tmp_path):
    assert driver_main(["--gpu-arm", str(tmp_path / "absent"), "--smoke", "--root", str(tmp_path)]) == 2
    assert "no such SFT start" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        start = ROOT / "recipes" / "demo" / "dial_start"
        assert driver_main(["--gpu-arm", str(start), "--dtype", "bfloat16", "--root", str(tmp_path)]) == 2
        assert "needs --device cuda" in capsys.readouterr().err
