"""benchmarks/demo_kernels.py (issue 31, item 8): the pre-registered claim and the kernels' own
spread, by hand; the committed pre-registration is the script's plan."""

import json
import math

from benchmarks import demo_kernels as dk


def _cell(r3: float, chaos: float) -> dict:
    return {
        "arms": {
            "GRPO+R3": {"auc_diff": {"n": 3, "mean": r3}},
            "CHAOS": {"auc_diff": {"n": 3, "mean": chaos}},
        }
    }


def test_the_claim_reads_r3_against_the_larger_of_chaos_and_the_kernel_spread():
    assert dk.within_noise(_cell(0.004, -0.005), 0.001) is True  # inside the chaos null's difference
    assert dk.within_noise(_cell(0.004, 0.001), 0.006) is True  # inside the kernels' own spread
    assert dk.within_noise(_cell(-0.02, 0.001), 0.006) is False  # outside both, either sign
    assert dk.within_noise(_cell(0.004, 0.001), math.nan) is False
    assert dk.within_noise(None, 0.1) is None and dk.within_noise({"arms": {}}, 0.1) is None


def test_the_kernel_spread_is_the_range_of_one_run_across_kernel_sets():
    runs = {}
    for seed, aucs in enumerate([(0.80, 0.82, 0.81), (0.70, 0.70, 0.76), (0.9, 0.9, 0.9)]):
        for cap, a in zip(dk.CAPS, aucs):
            for arm in dk.DEMO_ARMS:
                runs[(cap, arm, seed)] = {"auc": a}
    got = dk.kernel_spread(runs, list(dk.CAPS))
    assert math.isclose(got["GRPO"]["mean_range"], (0.02 + 0.06 + 0.0) / 3) and got["GRPO"]["n"] == 3
    del runs[("avx2", "GRPO", 0)]  # a seed missing under one kernel set is left out
    assert dk.kernel_spread(runs, list(dk.CAPS))["GRPO"]["n"] == 2


def test_the_committed_preregistration_is_the_plan():
    assert json.loads(dk.PLAN_FILE.read_text())["plan"] == dk.PLAN
