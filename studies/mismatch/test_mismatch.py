"""The mismatch study's driver at its smoke preset."""

import json


def test_mismatch_smoke(tmp_path, sft_cache, png, parallel_info):
    """studies/mismatch/mismatch.py: every cell measured, fp32 exact, bf16 not; a rerun reuses the cells."""
    from studies.mismatch.mismatch import main

    out = tmp_path / "mismatch.json"
    doc = main(["--preset", "smoke", "--out", str(out), "--cache", str(sft_cache)])
    png(out.with_suffix(".png"))
    assert json.loads(out.read_text())["headline"] == doc["headline"]
    assert set(doc["cells"]) == {"smoke-fp32-same-8", "smoke-bf16-same-8", "smoke-bf16-fp32-8"}
    fp32, bf16 = doc["headline"]["smoke/fp32"], doc["headline"]["smoke/bf16"]
    assert fp32["router_disagreement"] == 0 and fp32["abs_log_ratio"] < 1e-5
    assert bf16["abs_log_ratio"] > 100 * max(fp32["abs_log_ratio"], 1e-9) and bf16["tokens_per_cpu_s"] > 0
    again = main(["--preset", "smoke", "--out", str(tmp_path / "again.json"), "--cache", str(sft_cache)])
    assert again["cells"] == doc["cells"]  # resumed from the saved cells
