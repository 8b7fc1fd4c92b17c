"""Every push verified (issue 28): the engine's tensors read back by name after a push.

SGLang's Qwen3-MoE loader skips names it does not know, so a push can succeed and leave a tensor
stale. A ``moe-rl serve`` engine (which answers ``/get_weights_by_name`` as SGLang's models that
implement it do) takes pushes from a trainer policy; the check reads a sample of every kind back.
A planted loader that skips one expert's projection must be caught, naming the tensor and the
engine; a server that cannot read weights by name is said once and not asked again.
"""

from __future__ import annotations

import logging

import pytest
import torch

from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_engine import SGLangEngine
from moe_rl.rollout.weight_sync import TensorWeightSync
from moe_rl.rollout.weight_sync.session import WeightSyncError
from moe_rl.serve.http import ServerThread
from tests.tiny import TINY_MODEL, tiny_policy


@pytest.fixture
def served(parallel_info):
    """(trainer policy, server, client, engine with every push verified)."""
    from moe_rl.megatron.hf import PolicyHFSource
    from moe_rl.rollout.embedded import EmbeddedEngine

    trainer = tiny_policy()
    server_policy = tiny_policy()
    with torch.no_grad():  # the trainer's weights differ from the server's start
        for p in trainer.model.parameters():
            p.add_(0.01)
    server = ServerThread(EmbeddedEngine(server_policy, pad_id=0), weight_version="v0")
    client = SGLangClient(server.url, timeout_s=10, retries=0)
    engine = SGLangEngine(
        client,
        num_layers=TINY_MODEL["num_layers"],
        topk=TINY_MODEL["moe_router_topk"],
        num_experts=TINY_MODEL["num_experts"],
        weight_sync=TensorWeightSync(client, serializer="bytes"),
        verify_every=1,
    )
    asked: list[str] = []
    original = server.app.handle

    def handle(method, path, body):
        if path == "/get_weights_by_name":
            asked.append(body["name"])
        return original(method, path, body)

    server.app.handle = handle
    yield PolicyHFSource(trainer), server, engine, asked
    server.stop()


def test_a_push_is_read_back_by_name_for_every_kind(served):
    source, _, engine, asked = served
    assert engine.update_weights(source, "v1") == "v1"
    last = TINY_MODEL["num_layers"] - 1
    e_last = TINY_MODEL["num_experts"] - 1
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        f"model.layers.{last}.mlp.experts.{e_last}.down_proj.weight",
        f"model.layers.{last}.post_attention_layernorm.weight",
    ):
        assert name in asked, name
    assert not any(".experts.1." in n for n in asked)  # a sample, not every tensor


def test_a_tensor_the_engine_did_not_load_is_named(served):
    source, server, engine, _ = served
    skipped = "model.layers.1.mlp.experts.3.down_proj.weight"
    load = server.app.engine.load_hf_tensors
    # SGLang's Qwen3-MoE load_weights skips a name it does not map: the push reports success
    server.app.engine.load_hf_tensors = lambda named: load((n, t) for n, t in named if n != skipped)
    with pytest.raises(WeightSyncError, match=rf"{server.url}.* serves {skipped} differently.*v1"):
        engine.update_weights(source, "v1")


def test_a_server_that_cannot_read_weights_is_said_once(served, caplog):
    source, server, engine, asked = served
    original = server.app.handle
    server.app.handle = lambda m, p, b: (
        (400, {"error": {"message": "Get parameter by name failed"}})
        if p == "/get_weights_by_name"
        else original(m, p, b)
    )  # noqa: E501
    engine.verifier.every = 1
    with caplog.at_level(logging.WARNING):
        engine.update_weights(source, "v1")
        engine.update_weights(source, "v2")
    said = [r for r in caplog.records if "cannot read weights by name" in r.getMessage()]
    assert len(said) == 1 and engine.weight_version == "v2"
