"""benchmarks.arms: an interrupted SFT start resumes and ends where an uninterrupted one does."""

import json

import pytest
import torch

from benchmarks import arms

SFT = [*arms.flatten(arms.SMOKE_BASE), "train.sft_steps=5", "train.sft_batch_size=4"]


def _weights(ckpt) -> dict[str, torch.Tensor]:
    from moe_rl.config import load_recipe
    from moe_rl.megatron.checkpoint import load_checkpoint
    from moe_rl.megatron.parallel import parallel_info
    from moe_rl.megatron.policy import build_policy

    recipe = load_recipe(arms.DEMO, SFT)
    policy = build_policy(recipe.model, recipe.parallel, parallel_info())
    load_checkpoint(ckpt, policy.model, load_rng=False)
    return {
        k: v.detach().clone() for k, v in policy.model.state_dict().items() if isinstance(v, torch.Tensor)
    }


def _losses(root) -> list[float]:
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["stage"] == "sft"]


def test_an_interrupted_sft_start_resumes_to_the_same_weights(tmp_path, parallel_info, monkeypatch):
    from moe_rl.trainer import sft

    monkeypatch.setattr(arms, "SFT_CHECKPOINT_EVERY", 2)
    ref, info = arms.warm_start(arms.DEMO, SFT, cache=tmp_path / "ref")
    assert not info["reused"] and info["steps"] == 5

    real, calls, kill_at = sft.sft_step, [], [4]

    def counted(*a, **k):  # the 4th step of the first attempt dies (its checkpoint: after step 2)
        calls.append(1)
        if len(calls) == kill_at[0]:
            raise KeyboardInterrupt("killed")
        return real(*a, **k)

    monkeypatch.setattr(sft, "sft_step", counted)
    with pytest.raises(KeyboardInterrupt):
        arms.warm_start(arms.DEMO, SFT, cache=tmp_path / "cut")
    root = tmp_path / "cut" / ref.parent.name
    assert not (root / "sft.json").exists() and (root / "checkpoints").is_dir()

    calls.clear()
    kill_at[0] = 0
    cut, info = arms.warm_start(arms.DEMO, SFT, cache=tmp_path / "cut")
    assert len(calls) == 3  # steps 2, 3, 4 only: resumed from the checkpoint after step 2
    assert not info["reused"] and info["steps"] == 5  # resumed: every step once in metrics.jsonl
    assert _losses(root) == _losses(ref.parent)
    want, got = _weights(ref), _weights(cut)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    again, info = arms.warm_start(arms.DEMO, SFT, cache=tmp_path / "cut")
    assert info["reused"] and again == cut
