"""One trainer rank of test_sglang_multinode, run inside its own network namespace.

``python sglang_multinode_trainer.py RECIPE.json``, with RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT set as torchrun sets them: runs the recipe and
prints one JSON line with what this rank saw: the engine URL it generated from, the weight version
of every generate call, the version the engine served after each push (asked by this rank, so
over its own network path), and the RL stage's last metrics.
"""

from __future__ import annotations

import json
import math
import os
import sys


def main(recipe_path: str) -> int:
    from moe_rl.config import recipe_from_dict
    from moe_rl.rollout import factory
    from moe_rl.trainer.run import run

    seen: dict = {"rank": int(os.environ["RANK"]), "generate": [], "pushes": [], "url": None}
    ranked = factory.RankedSGLangEngine
    generate, update = ranked.generate, ranked.update_weights

    def traced_generate(self, prompts, n, sampling):
        seen["url"] = self.inner.client.base_url
        seen["engines"] = [e.base_url for e in self.inner.engines]
        fleet = self.inner.launcher
        seen["launched_here"] = [lc.url for lc in fleet.launchers] if fleet is not None else []
        ro = generate(self, prompts, n, sampling)
        seen["generate"].append({"version": ro.weight_version, "rows": ro.batch_size})
        return ro

    def traced_update(self, source, version):
        out = update(self, source, version)
        seen["pushes"].append({"pushed": version, "served": self.inner.served_version()})
        return out

    ranked.generate, ranked.update_weights = traced_generate, traced_update
    with open(recipe_path) as f:
        res = run(recipe_from_dict(json.load(f)))
    seen["rl"] = {k: v for k, v in res["rl"].items() if isinstance(v, (int, float)) and math.isfinite(v)}
    seen["non_finite"] = sorted(
        k for k, v in res["rl"].items() if isinstance(v, float) and not math.isfinite(v)
    )
    print(json.dumps(seen), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
