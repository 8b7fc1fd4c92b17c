"""layer_spec's overrides on every spec shape megatron-core has had (ModuleSpec up to 0.16,
functools.partial for the MoE layer and its experts from 0.17), and the check after the build."""

import dataclasses
import functools
import logging
import re

import pytest

from moe_rl.config import ParallelConfig


def test_replace_spec_rebuilds_module_specs_and_partials():
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from moe_rl.megatron.local_layers import GroupedExperts
    from moe_rl.megatron.model import replace_spec, spec_module, spec_submodules

    mlp = MLPSubmodules(linear_fc1=object, linear_fc2=object)
    fields = {f.name for f in dataclasses.fields(MoESubmodules)}
    as_partial = functools.partial(
        MoELayer, submodules=MoESubmodules(experts=functools.partial(SequentialMLP, submodules=mlp))
    )
    as_spec = ModuleSpec(
        module=MoELayer, submodules=MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=mlp))
    )
    for spec in (as_partial, as_spec):
        experts = spec_submodules(spec).experts
        new = replace_spec(spec, experts=replace_spec(experts, GroupedExperts))
        assert type(new) is type(spec) and spec_module(new) is MoELayer
        assert spec_module(spec_submodules(new).experts) is GroupedExperts
        assert spec_submodules(spec_submodules(new).experts) is mlp  # the experts' own submodules kept
        assert spec_module(spec_submodules(spec).experts) is SequentialMLP  # the input is untouched
        assert {f.name for f in dataclasses.fields(spec_submodules(new))} == fields
    assert replace_spec(SequentialMLP, GroupedExperts) is GroupedExperts
    with pytest.raises(TypeError, match="megatron-core"):
        replace_spec(object(), GroupedExperts)


def test_the_built_model_has_our_modules(parallel_info, tiny_model_cfg):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_rl.megatron.local_layers import GroupedExperts, SDPAttention
    from moe_rl.megatron.model import build_gpt, check_built

    cfg = tiny_model_cfg.__class__(**{**tiny_model_cfg.__dict__, "qk_norm": True})
    model = build_gpt(cfg, ParallelConfig())
    moes = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(moes) == cfg.num_layers and all(isinstance(m.experts, GroupedExperts) for m in moes)
    assert sum(isinstance(m, SDPAttention) for m in model.modules()) == cfg.num_layers
    stock = build_gpt(cfg, ParallelConfig(), stock_local=True)
    with pytest.raises(RuntimeError, match=r"megatron-core \S+ built .*GroupedExperts"):
        check_built(stock, cfg)


def test_an_override_that_does_not_take_is_an_error(parallel_info, tiny_model_cfg, monkeypatch):
    """megatron-core 0.17's silent mis-build: the experts' override landed on a partial and the
    model came with SequentialMLP experts. Such a model is refused, naming the version."""
    from megatron.core import __version__

    from moe_rl.megatron import model as model_mod

    replace = model_mod.replace_spec

    def ignores_modules(spec, module=None, **submodules):  # keeps the spec's own class
        return replace(spec, None, **submodules) if submodules else spec

    monkeypatch.setattr(model_mod, "replace_spec", ignores_modules)
    with pytest.raises(
        RuntimeError, match=rf"megatron-core {re.escape(__version__)} .*SequentialMLP, not GroupedExperts"
    ):
        model_mod.build_gpt(tiny_model_cfg, ParallelConfig())


def test_only_the_gpt_model_deprecation_is_silenced(caplog):
    from moe_rl.megatron.model import _quiet_gpt_model_deprecation

    _quiet_gpt_model_deprecation()
    _quiet_gpt_model_deprecation()  # idempotent
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    assert len(logger.filters) == sum(type(f).__name__ == "_GPTModelDeprecation" for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
