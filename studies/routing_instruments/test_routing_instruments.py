"""The routing-instruments benchmark's smoke preset runs and writes its figures."""

import json


def test_routing_instruments_smoke(tmp_path, parallel_info):
    from studies.routing_instruments.routing_instruments import main

    out = tmp_path / "ri.json"
    res = main(["--preset", "smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["per_lr"].keys() == {"0.0001", "0.001"}
    for lr in saved["per_lr"].values():
        assert 0.0 <= lr["flip"]["flip/rate"] <= 1.0
        assert set(lr["clip"]) == {"grpo", "gspo"}
    assert res["r2_overhead_ratio"] > 0 and res["probe_overhead_ratio_full_batch"] > 0
