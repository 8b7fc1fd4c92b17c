"""The trainer side of test_sglang_netns, run inside its own network namespace.

``python sglang_netns_trainer.py URL``: waits for the server, pushes new weights by the distributed
path with the rendezvous address found from the route to the server, checks the server-side
version and that generation uses the pushed weights; prints one JSON line with what it found.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from test_sglang_e2e import DictSource, E, K, L, _check_matches, init_weights

from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_engine import SGLangEngine
from moe_rl.rollout.types import SamplingParams
from moe_rl.rollout.weight_sync import DistributedWeightSync


def main(url: str) -> int:
    client = SGLangClient(url, timeout_s=30, retries=0)
    deadline = time.monotonic() + 60
    while True:
        try:
            if client.health_generate():
                break
        except Exception:  # noqa: BLE001 - still starting
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)
    sync = DistributedWeightSync(client, backend="gloo", bucket_bytes=4096, timeout_s=60)
    engine = SGLangEngine(client, num_layers=L, topk=K, num_experts=E, weight_sync=sync)
    g = torch.Generator().manual_seed(7)
    w = {k: t + 0.1 * torch.randn(t.shape, generator=g) for k, t in init_weights(0).items()}
    engine.update_weights(DictSource(w), "v1")
    served = client.get_weight_version()
    ro = engine.generate(
        [[1, 2, 3], [4, 5]], 2, SamplingParams(max_new_tokens=4, temperature=0.0, return_routes=True)
    )
    err = _check_matches(ro, w, 0.0)
    sync.close()
    print(json.dumps({"master_address": sync.master_address, "served": served, "max_err": err}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
