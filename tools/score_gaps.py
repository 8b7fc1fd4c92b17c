"""The push check's score gaps on the tiny model (issue 45; ``SCORE_TOLERANCE``'s figures): an engine (embedded, fp32 or bf16) holding the
trainer's weights, or with experts 1 and 2 of layer 0 swapped, continues the check's fixed prompt
(moe_rl.rollout.weight_sync.verify.probe_prompt, 32 ids, 32 sampled tokens: the tiny context of 64);
the trainer (fp32) scores the same tokens; the mean |log-prob difference| over 5 samplings.

    python -m tools.score_gaps
"""

import torch

from moe_rl.megatron.hf import PolicyHFSource
from moe_rl.rollout.embedded import EmbeddedEngine
from moe_rl.rollout.types import SamplingParams
from moe_rl.rollout.weight_sync.verify import probe_prompt
from tests.tiny import tiny_policy


def swapped(named):
    d = dict(named)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.0.mlp.experts.{e}.{proj}.weight" for e in (1, 2))
        d[a], d[b] = d[b], d[a]
    return list(d.items())


def main() -> None:
    trainer = tiny_policy(vocab_size=104)
    named = list(PolicyHFSource(trainer).hf_tensors())
    prompt = probe_prompt(104, 32)
    for dtype in ("fp32", "bf16"):
        for wrong in (False, True):
            gaps = []
            for seed in range(5):
                server = tiny_policy(vocab_size=104)
                PolicyHFSource(server).load_hf_tensors(swapped(named) if wrong else named)
                ro = EmbeddedEngine(server, pad_id=0, dtype=dtype).generate(
                    [prompt],
                    1,
                    SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=seed),
                )
                t, p = int(ro.total_lens_B[0]), len(prompt)
                with torch.no_grad():
                    mine = trainer.logprobs(ro.tokens_BT[:, :t]).logp_BT[0, p:t]
                gaps.append(float((mine - ro.logprobs_BT[0, p:t]).abs().mean()))
            print(
                f"{dtype} engine, {'experts 1<->2 swapped' if wrong else 'faithful'}: mean |dlogp| "
                f"{min(gaps):.2e} .. {max(gaps):.2e} over 5 samplings"
            )


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
