"""The target-regime benchmark's sizing (benchmarks/moe_target.py): its parameter count is the built
policy's, its batches hold exactly the positions asked for, and the layers it fits on an H100 and an
H200 leave room for the optimizer."""

import torch


def test_layer_params_is_the_built_layers(parallel_info):
    from benchmarks import moe_target

    policy, _ = moe_target.build(moe_target.DRY, 2, "local")
    per_layer = sum(
        p.numel() for n, p in policy.model.named_parameters() if n.startswith("decoder.layers.0.")
    )
    assert moe_target.layer_params(moe_target.DRY) == per_layer


def test_batches_hold_the_positions_asked_for():
    from benchmarks import moe_target

    for positions in (192, 8192, 16384):
        tokens, lens = moe_target.batch(positions, 100)
        assert int(lens.sum()) == positions and tokens.shape[1] == int(lens.max()) + 1
        assert int(lens.min()) >= 1 and len(set(lens.tolist())) > 1  # ragged


def test_the_target_fits_an_h100_and_an_h200():
    from benchmarks.moe_target import STATE_BYTES, TARGET, activation_bytes, layer_params, layers_to_fit

    gib = 2**30
    h100, h200 = layers_to_fit(79 * gib, TARGET, 16384), layers_to_fit(139 * gib, TARGET, 16384)
    assert 4 <= h100 < h200 <= 48, (h100, h200)
    used = 2 * TARGET["vocab_size"] * TARGET["hidden_size"] * STATE_BYTES + h200 * (
        layer_params(TARGET) * STATE_BYTES + activation_bytes(TARGET, 16384)
    )
    assert used <= 139 * gib * 0.85 and torch.tensor(layer_params(TARGET)) > 300e6  # 64 experts of width 768
