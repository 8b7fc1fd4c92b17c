"""Where colocated engines run and which trainer rank builds each engine rank's payload (issue 45).

The push itself, over eight gloo ranks, is tests/dist/test_colocated_payloads.py; here the
placement rules alone: engines spread over every node of the trainer, each node tiled by TP, each
engine rank served by the trainer rank on its GPU, and the refusals, one line naming the field.
"""

from __future__ import annotations

import pytest

from moe_rl.config import ConfigError, recipe_from_dict
from moe_rl.rollout.colocated import colocated_placement, node_of, payload_ranks


def _cfg(*over: str):
    base = ["rollout.engine=sglang", "rollout.sglang.colocate=true", "rollout.weight_sync=tensor"]
    return recipe_from_dict({}, base + list(over)).rollout.sglang


def _layout(nodes: int, per_node: int) -> list[tuple[int, int]]:
    return [(r // per_node, r % per_node) for r in range(nodes * per_node)]


@pytest.mark.parametrize(
    ("nodes", "per_node", "engines", "tp", "want"),
    [
        (1, 8, 8, 1, [[r] for r in range(8)]),  # 8 engines: each reads its own GPU
        (1, 8, 2, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # 2 engines
        (1, 8, 1, 8, [list(range(8))]),  # one engine of TP = GPUs per node: every TP rank its own GPU
        (2, 8, 2, 8, [list(range(8)), list(range(8, 16))]),  # one engine per node of two
        (2, 4, 8, 1, [[r] for r in range(8)]),  # 8 engines over two nodes of 4
    ],
)
def test_each_engine_rank_is_served_from_its_own_gpu(nodes, per_node, engines, tp, want):
    layout = _layout(nodes, per_node)
    placement = colocated_placement(_cfg(f"rollout.sglang.tp={tp}"), engines, layout)
    assert [n for n, _ in placement] == [i * nodes // engines for i in range(engines)]  # every node its share
    assert payload_ranks(placement, layout) == want


def test_placement_refusals_name_the_field():
    with pytest.raises(
        ConfigError, match=r"rollout.sglang.engines=1: .* every one of the trainer's 2 nodes.*e.g. 2"
    ):
        colocated_placement(_cfg("rollout.sglang.tp=8"), 1, _layout(2, 8))
    with pytest.raises(ConfigError, match="2 engines x tp 8 need 16 GPUs, got 8"):
        colocated_placement(_cfg("rollout.sglang.tp=8"), 2, _layout(1, 8))
    layout = _layout(1, 4)
    placement = colocated_placement(_cfg("rollout.sglang.gpus=[2,6]"), 2, layout)
    with pytest.raises(ConfigError, match=r"no trainer rank runs on \[6\].*rollout.sglang.gpus"):
        payload_ranks(placement, layout)
    assert colocated_placement(_cfg(), 2, [(0, None), (0, None)]) == [(0, None), (0, None)]  # no CUDA


def test_node_of_reads_torchruns_variables():
    assert node_of({}) == 0
    assert node_of({"RANK": "13", "LOCAL_WORLD_SIZE": "8"}) == 1
    assert node_of({"RANK": "13", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "3"}) == 3
