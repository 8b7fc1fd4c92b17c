"""The local token dispatcher (EP = TP = 1) against megatron-core's alltoall dispatcher: the same
permuted tokens, counts, layer outputs and gradients, no host read of a device value, and no op
per expert."""

import pytest
import torch

from moe_rl.config import ParallelConfig


def _moe_layers(experts: int, *, local: bool):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_rl.megatron.dispatch import LocalTokenDispatcher
    from moe_rl.megatron.model import build_gpt
    from tests.tiny import tiny_model_config

    torch.manual_seed(0)
    model = build_gpt(tiny_model_config(num_experts=experts), ParallelConfig())
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert all(isinstance(m.token_dispatcher, LocalTokenDispatcher) for m in layers)
    if not local:  # back to megatron-core's own
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        for m in layers:
            m.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher
    return model, layers


def _routing(n: int, e: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(n, e, generator=g).topk(k, dim=-1).indices
    routing_map = torch.zeros(n, e, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.rand(n, e, generator=g) * routing_map
    return routing_map, probs


@pytest.mark.parametrize("experts", [4, 16])
def test_dispatch_and_combine_are_megatrons(parallel_info, experts):
    out = []
    for local in (True, False):
        _, layers = _moe_layers(experts, local=local)
        d = layers[0].token_dispatcher
        routing_map, probs = _routing(37, experts, 2, seed=experts)
        x = torch.randn(37, 1, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        tokens, p = d.dispatch_preprocess(x, routing_map, probs)
        tokens, p = d.token_dispatch(tokens, p)
        tokens, counts, p = d.dispatch_postprocess(tokens, p)
        y = d.combine_postprocess(d.token_combine(d.combine_preprocess(tokens * p[:, None])))
        (gx,) = torch.autograd.grad((y * torch.arange(64.0)).sum(), x)
        out.append((tokens, torch.as_tensor(counts), p, y, gx))
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_the_model_runs_megatrons_values_without_host_reads_or_per_expert_ops(parallel_info):
    """Whole-model forward and backward: megatron-core's dispatcher's logits and gradients; the local
    one reads no device value on the host and dispatches the same ops at 4 and 64 experts."""
    from tests.ops import CountOps

    tok = torch.randint(0, 64, (3, 21), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(21).expand_as(tok)
    res, ops = {}, {}
    for local in (True, False):
        model, _ = _moe_layers(4, local=local)
        out = model(input_ids=tok, position_ids=pos, attention_mask=None)
        out.square().mean().backward()
        res[local] = (out.detach(), [p.grad for p in model.parameters()])
    assert torch.equal(res[True][0], res[False][0])
    for a, b in zip(res[True][1], res[False][1]):
        assert torch.equal(a, b)
    for experts in (4, 64):
        model, layers = _moe_layers(experts, local=True)
        d = layers[0].token_dispatcher
        routing_map, probs = _routing(40, experts, 2, seed=0)
        with CountOps() as count:
            tokens, p = d.dispatch_preprocess(torch.randn(40, 1, 64, requires_grad=True), routing_map, probs)
            tokens, counts, p = d.dispatch_postprocess(*d.token_dispatch(tokens, p))
            d.combine_postprocess(d.token_combine(d.combine_preprocess(tokens))).sum().backward()
        ops[experts] = count.count
        assert counts.device == tokens.device and not count.count["aten._local_scalar_dense"]
    assert ops[4] == ops[64], set(ops[4].items()) ^ set(ops[64].items())


def test_layers_it_does_not_serve_keep_megatrons_dispatcher(parallel_info):
    import dataclasses

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from moe_rl.megatron import dispatch

    _, layers = _moe_layers(4, local=False)
    d = layers[0].token_dispatcher
    assert dispatch.serves(d)
    d.config = dataclasses.replace(d.config, moe_expert_capacity_factor=1.0)  # token dropping: dynamic sizes
    assert not dispatch.serves(d)
    d.config, d.ep_size = layers[1].token_dispatcher.config, 2
    assert not dispatch.serves(d) and type(d) is MoEAlltoAllTokenDispatcher
