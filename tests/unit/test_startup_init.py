"""Start-up: a policy built from ``model.hf_path`` draws no random weights; a seeded one is unchanged.

megatron-core's init methods (``init_method_normal`` / ``scaled_init_method_normal``) are
``functools.partial(torch.nn.init.normal_, ...)`` made when the TransformerConfig is built, so
counting calls of ``torch.nn.init.normal_`` during the build counts every random init.
"""

import hashlib

import pytest
import torch

from moe_rl.config import ParallelConfig
from tests.tiny import tiny_model_config

pytest.importorskip("transformers")

# sha256 over (HF name, fp32 bytes) of every weight of build_policy(tiny_model_config(**kw)) in
# HF layout, sorted by name: independent of how the experts are held (one parameter per expert
# at 726d054, stacked since 34ee443: both give these values; torch 2.13.0 CPU, megatron-core 0.16.1)
SEEDED = {
    (): "4a3fadee06b0a0e4e6f115afd46aa6c75ab484f878797951bab69a0709ac13f0",
    (("dtype", "bfloat16"), ("seed", 7)): "2a0db5b4d8bd17ac6e886be66b57a0a585f38dbcfb9434b94dbe870db7234644",
}


def _hash(policy) -> str:
    from moe_rl.megatron.hf import PolicyHFSource

    h = hashlib.sha256()
    for name, t in sorted(PolicyHFSource(policy).hf_tensors()):
        h.update(name.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture
def normal_calls(monkeypatch):
    """How many times torch.nn.init.normal_ (every megatron-core init method) ran."""
    calls = []
    real = torch.nn.init.normal_

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", counting)
    return calls


@pytest.mark.parametrize("kw", list(SEEDED))
def test_seeded_init_is_unchanged(parallel_info, normal_calls, kw):
    from moe_rl.megatron.policy import build_policy

    policy = build_policy(tiny_model_config(**dict(kw)), ParallelConfig(), parallel_info)
    assert normal_calls, "the seeded build draws its weights with megatron-core's init methods"
    assert policy.model.config.use_cpu_initialization and policy.model.config.perform_initialization
    assert _hash(policy) == SEEDED[kw]


def test_hf_build_draws_nothing_and_imports_every_weight(parallel_info, normal_calls, tmp_path):
    from safetensors.torch import load_file

    from moe_rl.megatron.hf import PolicyHFSource, model_config_from_path
    from moe_rl.megatron.policy import build_policy
    from tests.unit.test_hf import tiny_hf

    tiny_hf(tmp_path / "ck")
    normal_calls.clear()  # the transformers model's own init
    cfg = model_config_from_path(tmp_path / "ck")
    assert cfg.hf_path
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    assert normal_calls == []
    assert not policy.model.config.perform_initialization
    assert policy.model.config.use_cpu_initialization == (not torch.cuda.is_available())
    want = {}
    for f in sorted((tmp_path / "ck").glob("*.safetensors")):
        want.update(load_file(f))
    got = dict(PolicyHFSource(policy).hf_tensors())
    assert set(got) == set(want) - {"lm_head.weight"} or set(got) == set(want)
    for name, t in got.items():
        assert torch.equal(t.float(), want[name].float()), name


def test_an_unfilled_parameter_is_refused(parallel_info, tmp_path, monkeypatch):
    """No parameter stays torch.empty garbage: import_hf counts every element it writes."""
    from moe_rl.megatron import hf
    from moe_rl.megatron.hf import model_config_from_path
    from moe_rl.megatron.policy import build_policy
    from tests.unit.test_hf import tiny_hf

    tiny_hf(tmp_path / "ck")
    real = hf._copy
    monkeypatch.setattr(
        hf, "_copy", lambda param, piece, src: 0 if param.dim() == 1 else real(param, piece, src)
    )  # norms left unwritten
    with pytest.raises(RuntimeError, match="wrong number of elements"):
        build_policy(model_config_from_path(tmp_path / "ck"), ParallelConfig(), parallel_info)
