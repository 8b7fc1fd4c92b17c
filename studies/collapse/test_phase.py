"""studies/collapse/phase.py: the pre-registered plan, its rules, and a smoke stage end to end with resume."""

import json
import math
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_recipe
from moe_rl.lab import arms, starts
from moe_rl.lab.arms import DEMO, ROOT, flatten
from moe_rl.lab.collapse import CRITERION
from moe_rl.lab.starts import sft_key
from studies.collapse import phase


def _keys(overrides: dict) -> set[str]:
    return {o.split("=", 1)[0] for o in flatten(overrides)}


def test_levers_are_turned_one_at_a_time():
    cells = phase.cells()
    assert list(cells)[0] == "base" and cells["base"]["overrides"] == {}
    keys = {
        lever: set().union(*(_keys(ov) for ov in levels.values())) for lever, levels in phase.LEVERS.items()
    }
    for lever, levels in phase.LEVERS.items():
        first, *rest = levels.values()
        assert first == {}, f"the first level of {lever} is the base itself"
        for other, ks in keys.items():  # no two levers touch the same setting
            assert other == lever or not ks & keys[lever], (lever, other)
        ref = cells[phase.cell_of(lever, next(iter(levels)))]  # the first level is the reference cell
        for level in list(levels)[1:]:
            c = cells[phase.cell_of(lever, level)]
            assert c["lever"] == lever and c["reference"] == phase.reference_cell(lever)
            assert cells[c["reference"]] is ref
            own = _keys(c["overrides"]) - _keys(ref["overrides"])  # differs from its reference in this lever
            assert own and own <= keys[lever]
            assert all(
                c["overrides"][sec][k] == v for sec, d in ref["overrides"].items() for k, v in d.items()
            )
    # revision 1: length, granularity and depth are turned at 4 minibatches, where ratios leave 1
    assert phase.reference_cell("depth") == "minibatches-4" and phase.reference_cell("precision") == "base"
    assert cells["granularity-64x8"]["overrides"]["train"] == {"minibatches": 4}
    assert {c for c in cells if c != "base"} == {
        f"{lv}-{level}" for lv, levels in phase.LEVERS.items() for level in list(levels)[1:]
    }
    # the levels
    assert set(phase.LEVERS["minibatches"]) == {"1", "2", "4", "8"}
    assert set(phase.LEVERS["depth"]) == {"4", "8", "12"}
    assert {"bf16-bypass", "bf16-recompute", "fp16-bypass", "fp16-recompute"} <= set(
        phase.LEVERS["precision"]
    )
    assert phase.SCREEN_ARMS == ("GRPO", "GRPO+R2", "GRPO+R3", "GRPO+TIS", "GSPO")
    assert len(phase.SEEDS["screen"]) == 2 and len(phase.SEEDS["confirm"]) >= 5
    assert not set(phase.SEEDS["screen"]) & set(phase.SEEDS["confirm"])  # fresh confirmation seeds


def test_every_cell_loads_as_a_recipe_and_model_or_task_cells_get_their_own_sft_start():
    base_key = sft_key(load_recipe(DEMO, phase.common_overrides(phase.STABLE_BASE, phase.cells()["base"])))
    for name, cell in phase.cells().items():
        common = phase.common_overrides(phase.STABLE_BASE, cell)
        for arm in phase.SCREEN_ARMS:
            ov = [*common, *flatten(phase.ARMS[arm]), "train.seed=1235"]
            if arm in cell["skip_arms"]:
                with pytest.raises(ConfigError):  # the skip is not arbitrary: the config rejects it
                    load_recipe(DEMO, ov)
                continue
            r = load_recipe(DEMO, ov)
            assert r.train.rl_steps == phase.STABLE_BASE["train"]["rl_steps"]
            assert r.rollout.engine == "embedded" and r.algo.rollout_correction in ("none", "tis")
        changes_start = any(k.startswith(("model.", "task.")) for k in _keys(cell["overrides"]))
        key = sft_key(load_recipe(DEMO, common))
        assert (key != base_key) == changes_start, name
    # equal active expert width in the granularity lever
    fine = load_recipe(
        DEMO, phase.common_overrides(phase.STABLE_BASE, phase.cells()["granularity-64x8"])
    ).model
    coarse = load_recipe(DEMO, phase.common_overrides(phase.STABLE_BASE, phase.cells()["base"])).model
    assert (
        fine.moe_router_topk * fine.moe_ffn_hidden_size == coarse.moe_router_topk * coarse.moe_ffn_hidden_size
    )
    assert (fine.num_experts, fine.moe_router_topk, coarse.num_experts, coarse.moe_router_topk) == (
        64,
        8,
        8,
        2,
    )


def test_the_committed_preregistration_is_the_plan():
    committed = json.loads(phase.PLAN_FILE.read_text())
    assert committed == json.loads(json.dumps(phase.plan_doc()))
    assert (
        committed["criterion"]["window"] == CRITERION.window and committed["learning_rule"]["margin"] == 0.03
    )
    assert committed["skipped_in_bypass_cells"]["arms"] == ["GRPO+TIS"]


def test_fisher_exact_one_sided():
    assert phase.fisher_greater(5, 5, 0, 5) == pytest.approx(1 / 252)
    assert phase.fisher_greater(4, 5, 1, 5) == pytest.approx(26 / 252)  # scipy: 0.10317
    assert phase.fisher_greater(4, 5, 0, 5) == pytest.approx(6 / 252)  # scipy: 0.02381
    assert phase.fisher_greater(0, 5, 0, 5) == pytest.approx(1.0)
    assert phase.fisher_greater(3, 10, 1, 10) == pytest.approx(0.29102, abs=1e-5)  # scipy fisher_exact
    assert phase.fisher_greater(1, 5, 4, 5) == pytest.approx(1 - 1 / 252)


def test_learning_rule():
    assert phase.learned([(0, 0.2), (10, 0.22), (20, 0.25), (30, 0.26), (30, 0.26)], False)
    assert not phase.learned([(0, 0.2), (10, 0.22), (20, 0.22), (30, 0.24)], False)  # +0.027 < 0.03
    assert not phase.learned(
        [(0, 0.2), (10, 0.5), (20, 0.5), (30, 0.5)], True
    )  # a collapsed run does not learn
    assert not phase.learned([(0, 0.2), (10, 0.5), (20, 0.5)], False)  # too few evaluations


def _arms(**counts):
    return {a: {"collapsed": c, "runs": n, "cpu_s": cpu} for a, (c, n, cpu) in counts.items()}


def test_best_cell_rule():
    table = {
        "base": {"GRPO": {"collapsed": 0, "runs": 2}, "GSPO": {"collapsed": 0, "runs": 2}},
        "minibatches-8": {"GRPO": {"collapsed": 2, "runs": 2}, "GSPO": {"collapsed": 1, "runs": 2}},
        "depth-12": {
            "GRPO": {"collapsed": 1, "runs": 2},
            "GSPO": {"collapsed": 0, "runs": 2},
            "GRPO+R2": {"collapsed": 0, "runs": 2},
        },
        "length-short": {"GRPO": {"collapsed": 1, "runs": 2}, "GSPO": {"collapsed": 0, "runs": 2}},
        "no-gspo": {"GRPO": {"collapsed": 2, "runs": 2}},
    }
    for c in table.values():
        for a in c.values():
            a["cpu_s"] = 100.0
    table["length-short"]["GRPO"]["cpu_s"] = table["length-short"]["GSPO"]["cpu_s"] = 50.0
    best = phase.best_cell(table)
    # separation 1 in three cells; fewer GSPO collapses rules out minibatches-8; the cheaper wins
    assert best["cell"] == "length-short" and best["separation"] == 1 and best["separates"]
    assert (best["grpo_collapsed"], best["gspo_collapsed"], best["grpo_runs"]) == (1, 0, 2)
    table["length-short"]["GSPO"]["cpu_s"] = table["length-short"]["GRPO"]["cpu_s"] = 100.0
    assert phase.best_cell(table)["cell"] == "depth-12"  # then plan order
    table["minibatches-8"]["GSPO"]["collapsed"] = 0
    assert phase.best_cell(table)["cell"] == "minibatches-8"  # a larger separation wins outright
    none = phase.best_cell({"base": table["base"]})
    assert none["cell"] == "base" and not none["separates"]


def test_repro_headline():
    def arm(collapsed, learned, acc, sft=0.3):
        return {
            "collapsed": collapsed,
            "runs": 5,
            "learned": learned,
            "ingredients": {"final_acc": acc, "sft_acc": sft},
        }

    h = phase.repro_headline(
        {"GRPO": arm(5, 0, 0.01), "GRPO+R3": arm(1, 3, 0.35), "GSPO": arm(0, 5, 0.4)}, "GRPO+R3"
    )
    assert h["success"] and (h["grpo_collapsed"], h["gspo_collapsed"], h["seeds"]) == (5, 0, 5)
    assert h["p_value"] == pytest.approx(1 / 252) and h["sft_acc"] == pytest.approx(0.3)
    assert h["others"]["GRPO+R3"]["collapsed"] == 1 and h["gspo_final_acc"] == 0.4
    assert not phase.repro_headline({"GRPO": arm(4, 0, 0.0), "GSPO": arm(0, 5, 0.29)}, None)["success"]  # acc
    assert not phase.repro_headline({"GRPO": arm(3, 0, 0.0), "GSPO": arm(0, 5, 0.4)}, None)["success"]
    assert not phase.repro_headline({"GRPO": arm(5, 0, 0.0), "GSPO": arm(2, 3, 0.4)}, None)["success"]


def test_paper_gap_names_the_highest_cell_and_the_best_cells_effect():
    def cell(flip, rollout, grpo=(1, 2, 0.5), gspo=(0, 2, 0.9)):
        arm = lambda c, n, acc: {"collapsed": c, "runs": n, "ingredients": {"final_acc": acc}}  # noqa: E731
        ing = {"flip_step": flip, "flip_rollout": rollout}
        return {"arms": {"GRPO": arm(*grpo), "GSPO": arm(*gspo)}, "ingredients": ing}

    tables = {
        "base": cell(0.001, math.nan),
        "precision-bf16-bypass": cell(0.002, 0.004),
        "depth-12": cell(0.004, 0.0),
    }
    gap = phase.paper_gap(tables, {"cell": "precision-bf16-bypass"})
    assert gap["reached"]["flip_step"] == {
        "cell": "depth-12",
        "value": 0.004,
        "paper": 0.1,
        "below_by": pytest.approx(25),
    }
    assert gap["reached"]["flip_rollout"]["cell"] == "precision-bf16-bypass"  # NaN (not measured) is skipped
    e = gap["effect"]
    assert e["collapse_rate"] == {"GRPO": 0.5, "GSPO": 0.0} and e["risk_difference"] == 0.5
    assert e["p_value"] == pytest.approx(phase.fisher_greater(1, 2, 0, 2)) and e[
        "final_acc_gspo_minus_grpo"
    ] == pytest.approx(0.4)
    assert phase.paper_gap(tables, None)["effect"] is None


def test_scale_trends_fit_a_power_law_and_extrapolate_to_the_paper_scale():
    def cell(flip, rollout=3e-7):  # fp32 engine: round-off, not a mismatch
        return {"ingredients": {"flip_step": flip, "flip_rollout": rollout}}

    # depth is turned from minibatches-4 (its 4-layer level); flip/step doubles with the depth
    tables = {
        "minibatches-4": cell(0.001),
        "depth-8": cell(0.002),
        "depth-12": cell(0.003),
        "granularity-64x8": cell(0.0005),  # falls with finer experts: no level where it reaches 10%
        "base": cell(math.nan),
    }
    t = phase.scale_trends(tables)
    d = t["depth"]["flip_step"]
    assert d["x"] == "num_layers" and d["measured"] == {"4": 0.001, "8": 0.002, "12": 0.003}
    assert d["exponent"] == pytest.approx(1.0) and d["paper_x"] == 48
    assert d["at_paper_x"] == pytest.approx(0.012) and d["reaches_paper_level_at_x"] == pytest.approx(400)
    g = t["granularity"]["flip_step"]
    assert g["measured"] == {"8": 0.001, "64": 0.0005} and g["exponent"] < 0
    assert g["reaches_paper_level_at_x"] is None and g["at_paper_x"] < 0.0005
    assert set(t["depth"]) == {"flip_step"}  # fp32 round-off is not fitted
    assert phase.scale_trends({"minibatches-4": cell(0.001)}) == {}  # one level: no trend
    assert phase.paper_gap(tables, None)["trend"] == t


def _png(path):
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_stage_end_to_end_with_resume(tmp_path, parallel_info):
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    argv = ["--stage", "smoke", "--runs-dir", str(runs), "--cache", str(cache)]
    doc = phase.main([*argv, "--out", str(tmp_path / "phase.json")])
    assert json.loads((tmp_path / "phase.json").read_text())["headline"] == json.loads(
        json.dumps(doc["headline"], default=str)
    )
    _png(tmp_path / "phase.png")
    assert doc["headline"]["best_plot"] == "phase-best.png"
    _png(tmp_path / "phase-best.png")
    assert doc["headline"]["paper_gap"]["effect"]["cell"] == doc["headline"]["best"]["cell"]
    assert doc["runs_finished"] == doc["runs_planned"] == 4
    assert set(doc["cells"]) == {"base", "precision-bf16-recompute"}
    for r in doc["runs"]:
        assert (
            r["status"] == "done"
            and len(r["reward"]) == 3
            and Path(r["out_dir"]).parent.parent == runs / "smoke"
        )
        assert r["verdict"]["state"] in ("fine", "never_good", "unresolved", "collapsed")
    cell = doc["cells"]["precision-bf16-recompute"]
    assert set(cell["arms"]) == {"GRPO", "GSPO"} and cell["arms"]["GRPO"]["runs"] == 1
    ing = cell["ingredients"]
    assert ing["mismatch_k3"] > doc["cells"]["base"]["ingredients"]["mismatch_k3"]  # bf16 engine vs fp32
    assert 0 <= ing["flip_step"] <= 1 and 0 <= ing["clip_token"] <= 1 and ing["grad_norm"] > 0
    assert not math.isnan(ing["final_acc"]) and ing["entropy"] > 0
    (row,) = doc["diagram"]["precision"][1:]
    assert row["cell"] == "precision-bf16-recompute" and set(row["collapse_rate"]) == {"GRPO", "GSPO"}
    assert doc["headline"]["best"]["cell"] in doc["cells"] and len(doc["headline"]["ranking"]) == 2
    # a rerun skips every finished run and reports the same runs
    status = [Path(r["out_dir"]) / "status.json" for r in doc["runs"]]
    stamps = [p.stat().st_mtime_ns for p in status]
    again = phase.main([*argv, "--out", str(tmp_path / "again.json")])
    assert [p.stat().st_mtime_ns for p in status] == stamps
    assert [r["reward"] for r in again["runs"]] == [r["reward"] for r in doc["runs"]]
    assert again["wall_s"] < doc["wall_s"]
    # --report reads the finished runs only; --dry-run marks them done
    assert phase.main([*argv, "--report", "--out", str(tmp_path / "r.json")])["runs_finished"] == 4
    lines = phase.dry_run(phase.make_stage(phase.parse(argv)), cache, None)
    assert len(lines) == 4 and all(line.startswith("# done: ") for line in lines)
    # the repro report on the same runs (one seed): the headline's fields and the curves' PNG
    smoke = phase.make_stage(phase.parse(argv))
    st = phase.Stage(
        "repro-smoke", smoke.base, {"base": smoke.cells["base"]}, ("GRPO", "GSPO"), (0,), smoke.root
    )
    rep = phase.report(st, str(tmp_path / "repro.json"), 0.0, 0.0)
    _png(tmp_path / "repro.png")
    h = rep["headline"]
    assert h["cell"] == "base" and h["seeds"] == 1 and not h["success"] and h["replay_arm"] is None
    assert {"grpo_collapsed", "gspo_collapsed", "p_value", "gspo_final_acc", "sft_acc", "others"} <= set(h)
    assert h["p_value"] == pytest.approx(phase.fisher_greater(h["grpo_collapsed"], 1, h["gspo_collapsed"], 1))


def test_confirm_and_repro_stages(tmp_path):
    argv = ["--runs-dir", str(tmp_path)]
    with pytest.raises(
        SystemExit, match="0 of 52 deciding runs"
    ):  # 13 cells x GRPO, GSPO x 2 seeds  # confirm needs the screen, or a cell
        phase.make_stage(phase.parse(["--stage", "confirm", *argv]))
    st = phase.make_stage(phase.parse(["--stage", "confirm", "--cells", "minibatches-4", *argv]))
    assert list(st.cells) == ["minibatches-4"] and st.arms == phase.SCREEN_ARMS and len(st.items()) == 25
    st = phase.make_stage(phase.parse(["--stage", "repro", "--cells", "depth-8", "--variant", "gpu", *argv]))
    assert (
        st.arms == ("GRPO", "GRPO+R3", "GSPO")
        and st.seeds == (0, 1, 2, 3, 4)
        and st.root == tmp_path / "repro-gpu"
    )
    r = load_recipe(DEMO, st.overrides("depth-8", "GRPO", 0))
    assert r.model.num_layers == 8 and r.train.prompts_per_step == 32  # the cell, then the GPU variant
    assert (
        len(phase.screen_stage(tmp_path).items()) == 124
    )  # 13 cells x 5 arms x 2 seeds, TIS not in 3 bypass cells


def test_screen_order_covers_every_cell_once_and_deciding_arms_run_first(tmp_path):
    assert sorted(phase.SCREEN_ORDER) == sorted(phase.cells()) and phase.SCREEN_ORDER[0] == "base"
    items = phase.screen_stage(tmp_path).items()
    arms = [a for _, a, _, _ in items]
    n = 13 * 2 * 2
    assert set(arms[:n]) == set(phase.DECIDING_ARMS) and not set(arms[n:]) & set(phase.DECIDING_ARMS)
    first = [(c, a, s) for c, a, s, _ in items[:4]]
    assert first == [
        ("base", "GRPO", 0),
        ("base", "GSPO", 0),
        ("precision-bf16-bypass", "GRPO", 0),
        ("precision-bf16-bypass", "GSPO", 0),
    ]


def test_run_when_ready_builds_starts_in_order_while_the_other_worker_runs():
    """Items (name, cell): cells "a" and "c" have no start yet, "b" has. With two workers, one
    builds a's start, then c's, while the other runs b's items, then a's; builds never overlap;
    every item runs once, after its start exists; results come back in item order."""
    import threading
    import time

    built, log, lock = {"b"}, [], threading.Lock()
    active = {"build": 0, "max_build": 0}

    def build(item):
        with lock:
            active["build"] += 1
            active["max_build"] = max(active["max_build"], active["build"])
            log.append(("build start", item[1]))
        time.sleep(0.5)
        with lock:
            built.add(item[1])
            active["build"] -= 1
            log.append(("build end", item[1]))

    def run(item):
        assert item[1] in built
        with lock:
            log.append(("run", item[0]))
        time.sleep(0.05)
        return item[0].upper()

    items = [("a1", "a"), ("a2", "a"), ("b1", "b"), ("b2", "b"), ("c1", "c")]
    out = phase.run_when_ready(items, jobs=2, ready=lambda it: it[1] in built, build=build, run=run)
    assert out == ["A1", "A2", "B1", "B2", "C1"]
    assert sorted(e[1] for e in log if e[0] == "run") == ["a1", "a2", "b1", "b2", "c1"]
    assert active["max_build"] == 1 and [e[1] for e in log if e[0] == "build start"] == ["a", "c"]
    at = log.index
    assert at(("run", "b1")) < at(("build end", "a"))  # ran while a's start was building
    assert at(("build end", "a")) < at(("build start", "c"))  # one build at a time, in item order
    assert at(("run", "a1")) < at(("build end", "c"))  # a's items ran while c's start was building


def test_run_when_ready_raises_the_first_error_and_a_build_that_leaves_no_start():
    def boom(item):
        raise ValueError(f"run {item} failed")

    with pytest.raises(ValueError, match="run x failed"):
        phase.run_when_ready(["x", "y"], jobs=2, ready=lambda it: True, build=None, run=boom)
    with pytest.raises(RuntimeError, match="left it not ready"):
        phase.run_when_ready(["x"], jobs=1, ready=lambda it: False, build=lambda it: None, run=boom)
    assert phase.run_when_ready([], jobs=2, ready=None, build=None, run=None) == []


def test_the_screen_stops_after_the_base_gate_when_the_base_is_not_stable(tmp_path, monkeypatch):
    ran = []

    def fake_run(label, base, ov, out, *, start=None, launch=None):  # a run that never learns
        ran.append(label)
        return {"finished": True}

    monkeypatch.setattr(phase, "warm_start", lambda *a, **k: (tmp_path / "sft", {}))
    monkeypatch.setattr(phase.runner, "resumable_run", fake_run)
    monkeypatch.setattr(phase, "finished", lambda st: ([it for it in st.items()], [{}] * len(st.items())))
    monkeypatch.setattr(phase, "analyse", lambda items, st: items)
    never_learned = {"runs": 2, "collapsed": 0, "learned": 0}
    monkeypatch.setattr(
        phase, "cell_tables", lambda items: {"base": {"arms": {"GRPO": never_learned, "GSPO": never_learned}}}
    )
    with pytest.raises(SystemExit, match="base is not stable"):
        phase.execute(phase.screen_stage(tmp_path), jobs=1, cache=tmp_path, launch=None)
    assert sorted(ran) == sorted(f"base {a} seed {s}" for a in ("GRPO", "GSPO") for s in (0, 1))


def test_the_demo_is_the_closest_cell_from_its_shipped_start():
    """recipes/demo/closest.yaml is the phase's minibatches-8 cell (seed 0) field for field, apart
    from where it starts and writes; the start it ships is that cell's SFT start (same SFT key) and
    its files are the ones recorded when it was exported."""
    import hashlib

    from moe_rl.config import to_dict

    root = Path(__file__).resolve().parents[2]
    ov = phase.common_overrides(phase.STABLE_BASE, phase.cells()["minibatches-8"])
    cell, demo = to_dict(load_recipe(DEMO, ov)), to_dict(load_recipe(root / "recipes/demo/closest.yaml"))
    for d in (cell, demo):
        d["model"].pop("hf_path"), d["train"].pop("stages"), d["train"].pop("out_dir")
    assert demo == cell
    start = json.loads((root / "recipes/demo/start.json").read_text())
    assert start["sft_key"] == sft_key(load_recipe(DEMO, [*ov, "train.stages=[sft]"]))
    files = {p.name: p for p in (root / "recipes/demo/start").iterdir()}
    assert set(files) == set(start["sha256"])
    assert all(hashlib.sha256(p.read_bytes()).hexdigest() == start["sha256"][n] for n, p in files.items())


def test_runs_of_the_shipped_starts_key_begin_from_it_and_a_changed_file_is_refused(tmp_path):
    """With nothing cached, a phase run whose SFT key is the shipped start's begins from that HF folder
    (``model.hf_path``) instead of training 1200 SFT steps; another key finds nothing; a shipped file
    that no longer matches its recorded hash is an error naming the file and the fix."""
    import shutil

    from moe_rl.errors import UserError

    ov = phase.common_overrides(phase.STABLE_BASE, phase.cells()["minibatches-8"])
    start, info = starts.cached_start(DEMO, ov, cache=tmp_path / "empty")
    assert start == ROOT / "recipes/demo/start" and info["shipped"] and info["reused"]
    assert arms.start_overrides(start) == [f"model.hf_path={start}"]
    assert arms.start_overrides(tmp_path / "ckpts") == [f"checkpoint.load={tmp_path / 'ckpts'}"]
    other = phase.common_overrides(phase.STABLE_BASE, phase.cells()["depth-8"])
    assert starts.cached_start(DEMO, other, cache=tmp_path / "empty") is None

    copy = tmp_path / "start"
    shutil.copytree(start, copy)
    shutil.copy(start.with_suffix(".json"), tmp_path / "start.json")
    assert starts.shipped_start(info["key"], (tmp_path / "start.json",)) == copy
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    with pytest.raises(UserError, match=r"config\.json is .* restore it"):
        starts.shipped_start(info["key"], (tmp_path / "start.json",))


def test_runs_span_is_first_start_to_last_end_and_finished_reads_each_end(tmp_path):
    """The repro's wall time is measured from its runs: two jobs, each running two runs back to back."""
    statuses = [
        {"ended_at": 600.0, "wall_s": 500.0},  # 100 -> 600
        {"ended_at": 650.0, "wall_s": 550.0},  # 100 -> 650, beside it
        {"ended_at": 1200.0, "wall_s": 600.0},
        {"ended_at": 1100.0, "wall_s": 450.0},
    ]
    assert phase.runs_span_s(statuses) == 1100.0
    st = phase.Stage("repro-cpu", {}, {"c": {"skip_arms": []}}, ("GRPO",), (0,), tmp_path)
    (out := tmp_path / "c" / "GRPO-s0").mkdir(parents=True)
    (out / "status.json").write_text(json.dumps({"status": "done", "wall_s": 5.0}))
    (_, statuses) = phase.finished(st)
    assert statuses[0]["ended_at"] == (out / "status.json").stat().st_mtime and statuses[0]["wall_s"] == 5.0


def test_same_runs_ignores_times_and_names_a_run_that_differs(tmp_path):
    def run(seed, reward_last, step_s):
        summary = {"reward_last": reward_last, "step_s": step_s, "flip_step": 1e-3}
        return {"cell": "c", "arm": "GRPO", "seed": seed, "summary": summary, "eval": [(0, 0.5), (99, 0.25)]}

    committed = [run(0, 0.15, 4.4), run(1, 0.6, 6.0)]
    (tmp_path / "phase-m-screen-deciding-abc.json").write_text(json.dumps({"runs": committed}))
    again = [run(0, 0.15, 3.5), run(1, 0.61, 6.0), run(2, 0.7, 1.0)]  # s1 differs, s2 is new
    got = phase.same_runs(again, tmp_path)
    assert got == {
        "compared": 2,
        "identical": 1,
        "differ": ["GRPO-s1"],
        "from": ["phase-m-screen-deciding-abc.json"],
    }


def test_explore_cells_stay_outside_the_plan_and_turn_their_levers_together(tmp_path):
    st = phase.make_stage(phase.parse(["--stage", "explore", "--runs-dir", str(tmp_path)]))
    assert st.root == tmp_path / "explore" and st.arms == ("GRPO", "GRPO+R3", "GSPO") and st.seeds == (0, 1)
    assert len(st.items()) == 6 * len(phase.EXPLORE) and not set(phase.EXPLORE) & set(phase.cells())
    assert not set(phase.EXPLORE) & set(phase.plan_doc()["cells"])
    r = load_recipe(DEMO, st.overrides("minibatches-8+bf16-bypass", "GRPO", 0))
    ref = load_recipe(DEMO, phase.screen_stage(tmp_path).overrides("minibatches-8", "GRPO", 0))
    assert (r.train.minibatches, r.rollout.dtype, r.algo.old_logprobs) == (8, "bf16", "rollout")
    assert r.train == ref.train and r.model == ref.model and r.optim == ref.optim  # only the engine differs
    r = load_recipe(DEMO, st.overrides("minibatches-8+lr-1e-4", "GSPO", 1))
    ref = load_recipe(DEMO, phase.screen_stage(tmp_path).overrides("minibatches-8", "GSPO", 1))
    assert r.optim.lr == 1e-4 and r.train == ref.train and r.rollout == ref.rollout and r.algo == ref.algo
    with pytest.raises(SystemExit, match="unknown cell"):
        phase.make_stage(phase.parse(["--stage", "explore", "--cells", "base"]))
