"""``train.shuffle_minibatches`` (issue 31): each update sees rows of several prompts, by its effect.

Without it, minibatch j is the contiguous slice of whole prompt groups (4 prompts x 2 samples, 4
minibatches: one prompt per update); with it, the step's rows are permuted (seeded per step) and
every row of the batch is trained on exactly once, with its own advantage and pi_old."""

from __future__ import annotations

import pytest
import torch

from moe_rl.trainer.rl import collect, train_on
from tests.unit.test_wiring import _run


@pytest.mark.parametrize("shuffle", [False, True])
def test_minibatches_draw_rows_across_prompts_only_when_shuffled(tmp_path, parallel_info, shuffle):
    run = _run(tmp_path)
    import dataclasses

    derived = run.derive(
        train=dataclasses.replace(
            run.recipe.train, prompts_per_step=4, group_size=2, minibatches=4, shuffle_minibatches=shuffle
        )
    )
    seen = []
    real = derived.policy.logprobs

    def logprobs(tokens_BT, **kw):
        if torch.is_grad_enabled():
            seen.append(tokens_BT.detach().clone())
        return real(tokens_BT, **kw)

    derived.policy.logprobs = logprobs
    try:
        batch, _ = collect(derived, 0)
        ro_tokens = [tuple(r) for r in batch.tokens_BT.tolist()]
        train_on(derived, batch)
    finally:
        del derived.policy.logprobs
        derived.close()
        run.close()
    assert len(seen) == 4
    trained = [tuple(r) for mb in seen for r in mb.tolist()]
    assert sorted(trained) == sorted(ro_tokens)  # every row once
    prompts_per_update = []
    for mb in seen:
        # rows of one prompt share its prompt tokens: count distinct prompt prefixes (first 4 tokens)
        prompts_per_update.append(len({tuple(r[:4]) for r in mb.tolist()}))
    if shuffle:
        assert max(prompts_per_update) > 1, prompts_per_update
    else:
        assert prompts_per_update == [1, 1, 1, 1], prompts_per_update
