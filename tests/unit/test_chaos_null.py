"""``train.start_jitter`` (issue 31): the chaos null's no-op perturbation is applied, by its effect.

Two one-step runs of the tiny recipe from the same initial weights, one with a 1e-6 jitter: they
end apart by about that much (a jitter read and not applied leaves them bit for bit equal: CPU,
fp32, fixed seeds)."""

from __future__ import annotations

import pytest
import torch

from moe_rl.trainer.run import jitter_weights, run
from tests.tiny import tiny_rl_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _final_weights(tmp_path, name, jitter):
    seen = {}

    def keep(event):
        seen["w"] = [p.detach().clone() for p in event.run.policy.model.parameters()]

    recipe = tiny_rl_recipe(tmp_path / name, train={"start_jitter": jitter, "flip_probe_sequences": 0})
    run(recipe, hooks=[keep])
    return seen["w"]


def test_start_jitter_moves_the_run_by_about_its_size(tmp_path, parallel_info):
    base = _final_weights(tmp_path, "a", 0.0)
    jittered = _final_weights(tmp_path, "c", 1e-6)
    diff = max(float((x - y).abs().max()) for x, y in zip(base, jittered))
    assert 1e-7 < diff < 1e-3, diff


def test_jitter_is_seeded_and_scaled(parallel_info):
    from tests.tiny import tiny_policy

    a, b = tiny_policy(seed=3), tiny_policy(seed=3)
    before = [p.detach().clone() for p in a.model.parameters()]
    jitter_weights(a, 1e-3, seed=7)
    jitter_weights(b, 1e-3, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    d = torch.cat([(p.detach() - q).flatten() for p, q in zip(a.model.parameters(), before)])
    assert d.std().item() == pytest.approx(1e-3, rel=0.05)
