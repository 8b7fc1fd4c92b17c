"""A checkpoint saved under one layer spec's key layout loads under the other (spec_keys).

transformer-engine does not build on CPU, so the "TE model" here is the local model whose
``sharded_state_dict`` files every key under its transformer-engine name: a key-for-key rename
written out independently of ``spec_keys`` (``TE_NAMES``, from megatron-core's TE spec), so a
wrong ``spec_keys`` mapping loads the wrong tensors and fails the equality checks.
"""

import dataclasses
import json

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig

# local key end -> transformer-engine key end (get_gpt_decoder_block_spec(config,
# use_transformer_engine=True) with moe_grouped_gemm=False: an MoE layer's pre-MLP norm is an unfused
# TENorm; the local spec's sharded_state_dict_keys_map files it under the fused dense-layer name)
TE_NAMES = {"decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.pre_mlp_layernorm.weight"}


def _te_key(key: str) -> str:
    for local, te in TE_NAMES.items():
        if key.endswith(local):
            return key[: -len(local)] + te
    return key


def as_te(model, rename=_te_key):
    """Make ``model`` file its checkpoint keys under the transformer-engine layout, with an
    ``_extra_state`` object the local layout lacks (TE modules' fp8 metadata)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from moe_rl.megatron.checkpoint import _sharded_items

    own = model.sharded_state_dict

    def sharded_state_dict(*args, **kwargs):
        sd = own(*args, **kwargs)
        for _, node, k, v in list(_sharded_items(sd)):
            node[k] = dataclasses.replace(v, key=rename(v.key))
        sd["decoder.final_layernorm._extra_state"] = ShardedObject(
            "decoder.final_layernorm._extra_state", None, (1,), (0,), replica_id=0
        )
        return sd

    model.sharded_state_dict = sharded_state_dict
    return model


def tokens(b=4, t=17, v=64, seed=0):
    return torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(seed))


def trained(parallel_info, tiny_model_cfg, seed, te=False):
    """A tiny policy with random norm weights (the norms differ from each other) and an optimizer
    that stepped twice."""
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    cfg = tiny_model_cfg.__class__(**{**tiny_model_cfg.__dict__, "seed": seed})
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    if te:
        as_te(policy.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.rand(p.shape, generator=g))
    opt = Optimizer(policy.model, OptimConfig(lr=1e-3), parallel_info)
    for _ in range(2):
        (-policy.logprobs(tokens()).logp_BT.mean()).backward()
        opt.step()
    return policy, opt


@pytest.mark.parametrize("save_te", [False, True], ids=["local->te", "te->local"])
def test_a_checkpoint_loads_under_the_other_layer_spec(parallel_info, tiny_model_cfg, tmp_path, save_te):
    from moe_rl.megatron import spec_keys
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint

    src, opt = trained(parallel_info, tiny_model_cfg, seed=1, te=save_te)
    path = save_checkpoint(tmp_path, 2, src.model, opt)
    saved_as = json.loads((path / "meta.json").read_text())["layer_spec"]
    assert saved_as == (spec_keys.TRANSFORMER_ENGINE if save_te else spec_keys.LOCAL)
    tok = tokens(seed=1)
    (-src.logprobs(tok).logp_BT.mean()).backward()
    opt.step()
    with torch.no_grad():
        want = src.logprobs(tok).logp_BT

    dst, opt2 = trained(parallel_info, tiny_model_cfg, seed=7, te=not save_te)
    load_checkpoint(path, dst.model, opt2)
    # the weights as saved (src took one more step since): every parameter, norms included
    src_sd = dict(src.model.named_parameters())
    for name, p in dst.model.named_parameters():
        if "norm" in name:
            assert not torch.equal(p, torch.ones_like(p)), name
    # one more step from the loaded state (Adam moments and step count) gives src's logprobs
    (-dst.logprobs(tok).logp_BT.mean()).backward()
    opt2.step()
    with torch.no_grad():
        torch.testing.assert_close(dst.logprobs(tok).logp_BT, want, atol=0, rtol=0)
    for name, p in dst.model.named_parameters():
        torch.testing.assert_close(p, src_sd[name], atol=0, rtol=0, msg=name)


def test_model_only_load_restores_equal_weights(parallel_info, tiny_model_cfg, tmp_path):
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint

    src, _ = trained(parallel_info, tiny_model_cfg, seed=1, te=True)
    path = save_checkpoint(tmp_path, 1, src.model)
    dst, _ = trained(parallel_info, tiny_model_cfg, seed=5)
    load_checkpoint(path, dst.model)
    want = dict(src.model.named_parameters())
    for name, p in dst.model.named_parameters():
        torch.testing.assert_close(p, want[name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize(
    "wrong",
    [
        # the pre-MLP norm read from the input norm (same shape)
        (
            (
                "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            ),
        ),
        (),  # the rename forgotten
    ],
    ids=["pre_mlp<-input_norm", "none"],
)
def test_a_planted_wrong_mapping_fails(parallel_info, tiny_model_cfg, tmp_path, monkeypatch, wrong):
    """With a wrong spec_keys.RENAMES the cross-layout load above cannot pass: it is refused, or
    it restores other weights than were saved."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from moe_rl.megatron import spec_keys
    from moe_rl.megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    src, _ = trained(parallel_info, tiny_model_cfg, seed=1, te=True)
    path = save_checkpoint(tmp_path, 1, src.model)
    monkeypatch.setattr(spec_keys, "RENAMES", wrong)
    dst, _ = trained(parallel_info, tiny_model_cfg, seed=5)
    want = dict(src.model.named_parameters())
    with pytest.raises((AssertionError, CheckpointError, CheckpointingException)):
        load_checkpoint(path, dst.model)
        for name, p in dst.model.named_parameters():
            torch.testing.assert_close(p, want[name], atol=0, rtol=0, msg=name)


def test_a_key_with_no_counterpart_is_refused_naming_both_layouts(parallel_info, tiny_model_cfg, tmp_path):
    """A transformer-engine checkpoint of grouped-GEMM experts (TEGroupedMLP: other expert keys)."""
    from moe_rl.megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    def grouped(key):
        return _te_key(key).replace("mlp.experts.experts.", "mlp.experts.grouped.")

    src, _ = trained(parallel_info, tiny_model_cfg, seed=1)
    as_te(src.model, grouped)
    path = save_checkpoint(tmp_path, 1, src.model)
    dst, _ = trained(parallel_info, tiny_model_cfg, seed=5)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, dst.model)
    msg = str(e.value)
    assert "\n" not in msg and "transformer_engine layer spec" in msg and "local layer spec" in msg
    assert "mlp.experts.experts.linear_fc" in msg
