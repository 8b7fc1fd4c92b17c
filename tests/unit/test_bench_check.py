"""benchmarks/check.py against benchmarks/baselines.yaml (issue 46, item 2): every benchmark has a
committed baseline whose figures exist, and the check fails when a figure falls well below it."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import check
from benchmarks.common import RESULTS

BASELINES = check.load()


@pytest.mark.parametrize("bench", sorted(BASELINES))
def test_every_baseline_is_a_committed_result_holding_its_figures(bench):
    spec = BASELINES[bench]
    assert (check.HERE / f"{bench}.py").exists(), f"benchmarks/{bench}.py"
    if spec.get("pending"):
        assert set(spec) <= {"pending", "needs"} and len(spec["pending"]) > 20, "say why there is none yet"
        return
    base = json.loads((RESULTS / spec["result"]).read_text())
    assert spec["result"].startswith(f"{bench}-{spec['machine']}-"), spec["result"]
    assert base.get("machine", spec["machine"]) == spec["machine"]
    assert "{out}" in " ".join(spec["args"]), "the rerun must write under the check's scratch folder"
    for figure, f in spec["figures"].items():
        value = check.value_at(base, figure)
        assert value is not None and math.isfinite(value) and value >= 0, figure
        assert f["better"] in ("higher", "lower") and f["tolerance"] >= 1, figure
        assert f.get("needs", "cuda") in check.NEEDS
    rows = check.compare(bench, spec, base, base, spec["machine"])
    assert {r.verdict for r in rows} == {"ok"} and all(r.worse_by == 1 for r in rows)


def test_a_count_that_was_zero_fails_on_any_rise():
    assert check.worse_by(0, 0, "lower") == 1 and check.worse_by(0, 1, "lower") == math.inf
    assert (
        check.worse_by(10, 11, "lower") == pytest.approx(1.1) and check.worse_by(2, 0, "higher") == math.inf
    )


def test_every_performance_benchmark_has_a_baseline():
    helpers = {"__init__", "common", "check", "trl_peer", "throughput_report", "gemm_floor"}
    # gemm_floor is measured inside throughput (headline.own_gemms_small), its trl_peer beside it
    benches = {p.stem for p in check.HERE.glob("*.py")} - helpers
    assert benches == set(BASELINES), benches ^ set(BASELINES)
    assert any("own_gemms" in f for f in BASELINES["throughput"]["figures"])


SPEC = {
    "machine": "cpu2-x86_64",
    "figures": {
        "rate": {"better": "higher", "tolerance": 1.5, "absolute": True},
        "share": {"better": "lower", "tolerance": 1.33},
        "speedup.tiny": {"better": "higher", "tolerance": 1.33},
        "versus_peer": {"better": "higher", "tolerance": 1.33, "needs": "trl"},
    },
}
BASE = {"rate": 1000.0, "share": 0.05, "speedup": {"tiny": 2.0}, "versus_peer": 1.0}


def verdicts(new, here="cpu2-x86_64"):
    return {r.figure: r.verdict for r in check.compare("b", SPEC, BASE, new, here)}


def test_a_figure_well_below_its_baseline_fails_and_noise_does_not(monkeypatch):
    monkeypatch.setitem(check.NEEDS, "trl", lambda: True)
    noisy = {"rate": 700.0, "share": 0.06, "speedup": {"tiny": 1.6}, "versus_peer": 0.8}
    assert set(verdicts(noisy).values()) == {"ok"}
    halved = {"rate": 500.0, "share": 0.1, "speedup": {"tiny": 1.0}, "versus_peer": 0.5}
    assert set(verdicts(halved).values()) == {"regressed"}
    # a time or a share is worse when it grows; a rate when it falls
    assert verdicts({**noisy, "share": 0.01})["share"] == "ok"
    assert verdicts({**noisy, "rate": 5000.0})["rate"] == "ok"


def test_machine_units_count_only_on_the_baselines_machine(monkeypatch):
    monkeypatch.setitem(check.NEEDS, "trl", lambda: True)
    slow_cpu = {"rate": 100.0, "share": 0.05, "speedup": {"tiny": 2.0}, "versus_peer": 1.0}
    assert verdicts(slow_cpu, here="cpu8-aarch64")["rate"] == "other machine (cpu2-x86_64)"
    assert verdicts(slow_cpu)["rate"] == "regressed"
    assert (
        verdicts({**slow_cpu, "speedup": {"tiny": 1.0}}, here="cpu8-aarch64")["speedup.tiny"] == "regressed"
    )


def test_a_figure_gone_from_the_result_fails_unless_its_tool_is_absent(monkeypatch):
    new = {"rate": 1000.0, "share": 0.05, "speedup": {}}
    monkeypatch.setitem(check.NEEDS, "trl", lambda: False)
    v = verdicts(new)
    assert v["speedup.tiny"] == "missing" and v["versus_peer"] == "not measured (needs trl)"
    monkeypatch.setitem(check.NEEDS, "trl", lambda: True)
    assert verdicts(new)["versus_peer"] == "missing"


def test_the_command_exits_1_on_a_regressed_result_and_names_it(tmp_path, capsys):
    spec = BASELINES["engine_throughput"]
    doc = json.loads((RESULTS / spec["result"]).read_text())
    assert check.main(["engine_throughput", "--result", str(RESULTS / spec["result"])]) == 0
    doc["speedup_engine_vs_naive_cpu"] /= 2
    (tmp_path / "new.json").write_text(json.dumps(doc))
    assert check.main(["engine_throughput", "--result", str(tmp_path / "new.json")]) == 1
    assert "speedup_engine_vs_naive_cpu regressed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check.main(["no_such_bench"])
