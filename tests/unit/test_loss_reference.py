"""Every registered loss under every correction keeps its numbers: loss, gradient and each metric
on fixed inputs, against ``loss_reference.json``, recorded from the implementation before the
one-value API (commit 3821f12: ``loss(logp, old_logp, adv, mask, *, cfg, num_sequences,
num_tokens, ref_logp_BT, is_weights)``, each loss preparing its own inputs).

One deliberate change of the math since: ``icepop`` weights a kept token by rho instead of 1 (the
IcePop weight, as slime and TRL compute it). Its cases were re-recorded then; the mask-only
variant, ``icepop_mask``, runs on the inputs (seed) of the ``icepop`` case of the same loss and
aggregation and keeps the numbers recorded for ``icepop`` at 3821f12.

Bit for bit on the recording's platform (torch version and CPU capability: the order of small
vectorised sums follows the SIMD width); elsewhere within float64 / bfloat16 rounding.
``python -m tests.unit.test_loss_reference`` rewrites the file from the current code: only for a
deliberate change of the math, named in its commit.

Shape legend: B = sequences, T = padded tokens per sequence.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_rl.config import AlgoConfig
from moe_rl.losses.corrections import CORRECTIONS, correction_weights
from moe_rl.names import TOKEN_LEVEL
from tests.unit.test_losses import counts, make_batch, run

REFERENCE = Path(__file__).with_name("loss_reference.json")
RECORDED_AS = {"kl/ref_k3": "kl/k3"}
"Metrics renamed since the recording (issue 49: the KL to a reference is ``kl/ref_<estimator>``)."
NOT_RECORDED = ("kl/ref_k1", "kl/ref_k2")
"Metrics added since the recording (issue 49; tests/unit/test_kl_reference.py checks them)."
LossCall = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"(name, logp, old, adv, mask, cfg, num_sequences, num_tokens, ref, is_weights) -> (loss, metrics)."


def cases() -> dict[str, dict]:
    """Case key -> settings: each loss x aggregation x correction with dual clip, KL and a custom
    band; each loss x aggregation plain (paper band, nothing else); one bfloat16 case per loss."""
    out = {}
    for name in ("grpo", "gspo", "gspo_token"):
        for aggregation in ("seq_mean", "token_mean"):
            for correction in CORRECTIONS:
                if not (name == "gspo" and correction in TOKEN_LEVEL):
                    out[f"{name}/{aggregation}/{correction}/full"] = dict(
                        name=name, aggregation=aggregation, correction=correction, full=True, dtype="float64"
                    )
            out[f"{name}/{aggregation}/none/plain"] = dict(
                name=name, aggregation=aggregation, correction="none", full=False, dtype="float64"
            )
        correction = "seq_tis" if name == "gspo" else "tis"
        out[f"{name}/seq_mean/{correction}/full/bfloat16"] = dict(
            name=name, aggregation="seq_mean", correction=correction, full=True, dtype="bfloat16"
        )
    for seed, case in enumerate(c for c in out.values() if c["correction"] != "icepop_mask"):
        case["seed"] = seed
    for case in out.values():  # icepop_mask on icepop's inputs: the seeds of the other cases stay
        if case["correction"] == "icepop_mask":
            twin = f"{case['name']}/{case['aggregation']}/icepop/full"
            case["seed"] = out[twin]["seed"]
    return out


def evaluate(case: dict, call: LossCall) -> dict:
    """Loss, gradient wrt logp and metrics of one case, as exact float hex strings."""
    full, token_adv = case["full"], case["full"] and case["name"] != "gspo"
    logp, old, adv, mask, ref = make_batch(case["seed"], B=5, T=6, token_adv=token_adv)
    g = torch.Generator().manual_seed(1000 + case["seed"])
    roll = old + 0.3 * torch.randn(old.shape, generator=g, dtype=old.dtype)
    w = correction_weights(old, roll, mask, method=case["correction"], c=1.5, low=0.8, high=1.25)
    dtype = getattr(torch, case["dtype"])
    logp = logp.detach().to(dtype).requires_grad_()
    old, adv, ref = old.to(dtype), adv.to(dtype), ref.to(dtype)
    cfg = AlgoConfig(
        name=case["name"],
        aggregation=case["aggregation"],
        eps_low=0.05 if full else None,
        eps_high=0.08 if full else None,
        clip_ratio_c=1.05 if full else None,
        kl_coef=0.1 if full else 0.0,
    )
    ns, nt = counts(mask)
    loss, metrics = call(case["name"], logp, old, adv, mask, cfg, ns, nt, ref if full else None, w)
    (grad,) = torch.autograd.grad(loss, logp)
    metrics = {RECORDED_AS.get(k, k): v for k, v in metrics.items() if k not in NOT_RECORDED}
    return {
        "loss": float(loss.detach()).hex(),
        "grad": [float(x).hex() for x in grad.flatten().tolist()],
        "metrics": {k: float(v).hex() for k, v in sorted(metrics.items())},
    }


def platform() -> dict[str, str]:
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}


def record(call: LossCall) -> dict:
    """Every case evaluated with ``call``, and the platform that computed them."""
    return {"platform": platform(), "cases": {k: evaluate(c, call) for k, c in cases().items()}}


def dump(recorded: dict) -> str:
    """JSON with one line per case."""
    rows = ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in recorded["cases"].items())
    return f'{{"platform": {json.dumps(recorded["platform"])},\n"cases": {{\n{rows}\n}}}}\n'


def new_call(name, logp, old, adv, mask, cfg, num_sequences, num_tokens, ref, is_weights):
    return run(name, logp, old, adv, mask, cfg, ref=ref, num=(num_sequences, num_tokens), w=is_weights)


def _floats(d: dict) -> torch.Tensor:
    values = [d["loss"], *d["grad"], *d["metrics"].values()]
    return torch.tensor([float.fromhex(v) for v in values], dtype=torch.float64)


def test_reference_covers_every_loss_and_correction():
    recorded = json.loads(REFERENCE.read_text())["cases"]
    assert recorded.keys() == cases().keys()
    seen = {(c["name"], c["correction"]) for c in cases().values()}
    tokens = {"grpo", "gspo_token"}
    assert seen == {(n, c) for n in tokens for c in CORRECTIONS} | {
        ("gspo", c) for c in CORRECTIONS if c not in TOKEN_LEVEL
    }


@pytest.mark.parametrize("key", list(cases()))
def test_losses_match_the_recorded_reference(key):
    reference = json.loads(REFERENCE.read_text())
    want, got = reference["cases"][key], evaluate(cases()[key], new_call)
    assert got["metrics"].keys() == want["metrics"].keys()
    if reference["platform"] == platform():
        assert got == want  # bit for bit
        return
    bf16 = key.endswith("bfloat16")
    tol = dict(rtol=2e-2, atol=1e-6) if bf16 else dict(rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(_floats(got), _floats(want), **tol)


if __name__ == "__main__":
    REFERENCE.write_text(dump(record(new_call)))
    print(f"wrote {REFERENCE}", file=sys.stderr)
