"""studies/noise/ladder_kernels.py (issue 31): design (c)'s ladders under another CPU kernel set. The
ladders climb from the bottom and stop at the first fall; the four pre-registered claims, by hand;
the committed pre-registration is the script's plan."""

import json
import math

import pytest

from studies.noise import design as noise
from studies.noise import ladder_kernels as lk

PLAN = lk.plan_of()
MODELS = PLAN["ladder"]["models"]
OK = {"collapsed": False, "evals": [(0, 0.8), (10, 0.8)], "gauges": {"ratio/routing_share": 0.05}}
FELL = {"collapsed": False, "evals": [(0, 0.8), (10, 0.3)], "gauges": {"ratio/routing_share": 0.05}}


def _ladders(falls_at: dict[tuple[str, str], list[int | None]], share: float = 0.05) -> dict:
    """(cell, arm, seed) -> a run, climbed as the script climbs: per (model, arm) and seed, the
    rung index of the first fall (None: none fell), rungs above it never run."""
    out = {}
    for (model, arm), per_seed in falls_at.items():
        for seed, at in zip(lk.SEEDS, per_seed):
            for i, cell in enumerate(MODELS[model]):
                run = FELL if at is not None and i == at else OK
                out[(cell, arm, seed)] = {**run, "gauges": {"ratio/routing_share": share}}
                if at is not None and i == at:
                    break
    return out


def _claims(results: dict) -> dict:
    return lk.claims(PLAN, results, noise.ladder(PLAN, results))


def _critical(results: dict) -> dict:
    return lk.critical_rungs(noise.ladder(PLAN, results))


# design (c)'s seeds 300-302 on the machine's own kernels (rung index: 0 = 4e-5 .. 3 = 1e-4)
REFERENCE = {
    ("moe", "GRPO"): [3, 2, 2],
    ("moe", "GSPO"): [2, 2, 2],
    ("dense", "GRPO"): [3, 3, 2],
    ("dense", "GSPO"): [2, 3, 3],
}


def test_a_ladder_climbs_from_the_bottom_and_stops_at_its_first_fall():
    assert noise.next_rungs(PLAN, {}) == [
        (cells[0], arm, s) for cells in MODELS.values() for arm in ("GSPO", "GRPO") for s in lk.SEEDS
    ]
    cells = MODELS["moe"]
    results = {(cells[0], "GRPO", 300): OK, (cells[1], "GRPO", 300): FELL, (cells[0], "GSPO", 300): OK}
    todo = noise.next_rungs({**PLAN, "seeds": [300]}, results)
    assert (cells[1], "GSPO", 300) in todo  # its bottom held: one rung up
    assert not any(a == "GRPO" and c in cells for c, a, _ in todo)  # fell at 6e-5: decided
    assert noise.next_rungs(PLAN, _ladders(REFERENCE)) == []  # every ladder decided: done


def test_climb_runs_rung_by_rung_under_the_kernel_set_and_never_above_a_fall(monkeypatch, tmp_path):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    done: dict = {}
    target = _ladders(REFERENCE)
    batches: list[list] = []

    def execute(plan, specs, *, jobs):
        import os

        assert os.environ["ATEN_CPU_CAPABILITY"] == "default"  # the child runs inherit it
        batches.append([(s.cell, s.arm, s.seed) for s in specs])
        for s in specs:
            done[(s.cell, s.arm, s.seed)] = target[(s.cell, s.arm, s.seed)]

    monkeypatch.setattr(lk, "execute", execute)
    monkeypatch.setattr(lk, "collect", lambda specs: (dict(done), []))
    lk.climb(PLAN, tmp_path, "default", jobs=2)
    assert done == target  # exactly the rungs up to each first fall
    assert len(batches) == 4 and len(batches[0]) == 12  # every ladder's bottom rung first
    assert sum(map(len, batches)) == len(target) == 41


def test_the_four_claims_hold_on_the_reference_and_each_fails_on_its_own_counterexample():
    assert _claims(_ladders(REFERENCE)) == dict.fromkeys(
        ("moe_same_rung", "no_larger_headroom", "lr_breaks_both", "routing_small"), True
    )
    gspo_higher = {**REFERENCE, ("moe", "GSPO"): [2, 3, 2]}  # seed 301: GSPO survives 8e-5, GRPO not
    got = _claims(_ladders(gspo_higher))
    assert got["moe_same_rung"] is False and got["no_larger_headroom"] is True  # mean contrast 0
    headroom = {**gspo_higher, ("dense", "GSPO"): [2, 2, 3]}
    assert _claims(_ladders(headroom))["no_larger_headroom"] is False  # contrast 0, +0.64, -0.32
    censored = {**REFERENCE, ("dense", "GRPO"): [None, 3, 2]}
    assert _claims(_ladders(censored))["lr_breaks_both"] is False
    assert _claims(_ladders(REFERENCE, share=0.2))["routing_small"] is False
    partial = _ladders(REFERENCE)
    del partial[(MODELS["dense"][2], "GRPO", 302)]  # a ladder undecided: no claim read yet
    assert set(_claims(partial).values()) == {None}


def test_rungs_moved_counts_how_far_the_kernels_moved_each_ladder():
    ref = _critical(_ladders(REFERENCE))
    other = _critical(_ladders({**REFERENCE, ("moe", "GRPO"): [2, None, 2]}))
    assert ref["moe/GRPO/300"] == pytest.approx(1e-4) and other["moe/GRPO/301"] == math.inf
    moved = lk.rungs_moved(PLAN, ref, other)
    assert moved["moe/GRPO/300"] == -1 and moved["moe/GRPO/301"] == 2 and moved["dense/GSPO/302"] == 0
    assert sum(1 for v in moved.values() if v) == 2


def test_the_committed_preregistration_is_the_scripts_plan():
    assert json.loads(lk.PLAN_FILE.read_text())["plan"] == lk.PLAN
    assert not set(lk.SEEDS) - set(noise.load_plan("c")["seeds"])  # design (c)'s own seeds: a check


def test_climb_stops_with_a_clear_error_when_runs_end_without_finishing(monkeypatch, tmp_path):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    monkeypatch.setattr(lk, "execute", lambda plan, specs, *, jobs: None)  # every run "stopped"
    monkeypatch.setattr(lk, "collect", lambda specs: ({}, []))
    with pytest.raises(RuntimeError, match="ended without finishing"):
        lk.climb(PLAN, tmp_path, "default", jobs=2)  # not a loop that never ends
