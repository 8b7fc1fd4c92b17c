"""CPU proxies of the GPU step's host cost (benchmarks/step_ops.py): one parameter per expert
projection, ops per training pass and per optimizer step independent of the number of experts, and
no device-to-host read in the training pass."""


def test_host_cost_of_the_step_does_not_grow_with_experts(parallel_info):
    from benchmarks.step_ops import measure

    rows = {e: measure(e, layers=2) for e in (8, 64)}
    for r in rows.values():
        assert r["params_per_moe_layer"] == 3, r  # the router and two stacked projections
        assert r["syncs_per_pass"] == 0, r["sync_sites"]
    assert rows[8]["params"] == rows[64]["params"]
    assert rows[8]["ops_per_pass"] == rows[64]["ops_per_pass"], (
        rows[8]["top_ops_per_pass"],
        rows[64]["top_ops_per_pass"],
    )
    assert rows[8]["ops_per_optimizer_step"] == rows[64]["ops_per_optimizer_step"]
