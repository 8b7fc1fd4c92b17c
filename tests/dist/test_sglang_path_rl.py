"""RL through the whole SGLang path on CPU: launcher, client, routes, weight sync, versions.

The trainer (this process) launches our SGLang-protocol server (``moe_rl.serve.embedded``)
with the same launcher code that starts ``sglang.launch_server``, samples through the
client with ``return_routed_experts`` (R3), and pushes new weights after every step by the
distributed path (gloo broadcast) or the disk path (safetensors). After each push the
server's log-probs and routes must equal the trainer's own recompute of the same tokens.
"""

import pytest

from moe_rl.config import recipe_from_dict
from moe_rl.trainer.metrics import read_metrics
from moe_rl.trainer.run import run

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("sync", ["distributed", "disk"])
def test_rl_over_the_sglang_protocol(tmp_path, parallel_info, sync):
    from tests.tiny import TINY_E2E as TINY

    data = {k: dict(v) for k, v in TINY.items()}
    data["train"].update(stages=["rl"], rl_steps=3, out_dir=str(tmp_path / "run"))
    data["algo"] = {"name": "grpo", "routing": "r3"}
    data["rollout"] = {
        "engine": "sglang",
        "weight_sync": sync,
        "sglang": {"module": "moe_rl.serve.embedded", "port": 0, "startup_timeout_s": 180.0},
    }
    res = run(recipe_from_dict(data))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl", "rl")
    assert len(rows) == 3
    for r in rows:  # each step samples with the weights the trainer pushed after the last one
        assert r["mismatch/abs_log_ratio"] < 1e-5, r["mismatch/abs_log_ratio"]
        assert r["flip/rollout_vs_trainer/rate"] == 0.0
        assert r["time/sync"] > 0
    assert rows[-1]["grad_norm"] > 0 or rows[-1]["adv/abs_mean"] == 0
    assert "eval/accuracy" in res["rl"]
