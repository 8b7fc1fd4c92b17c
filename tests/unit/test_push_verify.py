"""Every push verified (issues 28, 45): scores of the same tokens, and tensors read back by name.

SGLang's Qwen3-MoE loader skips names it does not know, so a push can succeed and leave a tensor
stale. A ``moe-rl serve`` engine (which answers ``/get_weights_by_name`` as SGLang's models that
implement it do) takes pushes from a trainer policy; the check reads a sample of every kind back.
A planted loader that skips one expert's projection must be caught, naming the tensor and the
engine; a server that cannot read weights by name is said once and not asked again.

SGLang 0.5.x's Qwen3-MoE cannot read weights by name, so on the model users train the read-back
never ran (issue 45). The score check does: at the rollout after a checked push each engine
continues a fixed prompt and the trainer scores the same tokens. A run whose engine swaps two
experts' weights on load (experts the read-back sample does not hold, on a server that cannot read
by name) must stop at that rollout, naming the engine; a faithful push passes with its scores equal.
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


# ---------------------------------------------------------------- scores (issue 45)
def _run_with_engine(tmp_path, *, swap: bool):
    """A tiny colocated run over a ``moe-rl serve`` engine that cannot read weights by name (as
    SGLang's Qwen3-MoE) and, with ``swap``, loads experts 1 and 2 of layer 0 into each other's place."""
    from moe_rl.megatron.hf import PolicyHFSource
    from moe_rl.rollout.embedded import EmbeddedEngine
    from moe_rl.trainer.run import Run
    from tests.tiny import tiny_rl_recipe

    served = tiny_policy(vocab_size=104)
    server = ServerThread(EmbeddedEngine(served, pad_id=0), weight_version="0", enable_memory_saver=True)
    original, sink = server.app.handle, PolicyHFSource(served)

    def handle(method, path, body):
        if path == "/get_weights_by_name":
            return 400, {"error": {"message": "Get parameter by name failed"}}
        return original(method, path, body)

    def load(named):
        named = dict(named)
        for proj in ("gate_proj", "up_proj", "down_proj") if swap else ():
            a, b = (f"model.layers.0.mlp.experts.{e}.{proj}.weight" for e in (1, 2))
            if a in named and b in named:
                named[a], named[b] = named[b], named[a]
        sink.load_hf_tensors(named.items())

    server.app.handle, server.app.engine.load_hf_tensors = handle, load
    rollout = {"engine": "sglang", "weight_sync": "tensor", "verify_every": 1, "dtype": "fp32"}  # as served
    rollout["sglang"] = {"url": server.url, "colocate": True}
    run = Run(tiny_rl_recipe(tmp_path / f"run-{swap}", rollout=rollout, train={"rl_steps": 2}))
    run.make_optimizer("rl")
    run.ensure_engine()
    return run, server


@pytest.mark.parametrize("swap", [False, True])
def test_a_push_with_one_expert_swapped_stops_at_the_next_rollout(tmp_path, parallel_info, monkeypatch, swap):
    from moe_rl.rollout.weight_sync import verify
    from moe_rl.trainer.loop import evaluate
    from moe_rl.trainer.rl import rl_step
    from moe_rl.trainer.timer import StepTimer

    checked, check = [], getattr(verify, "check_scores", None)  # (None before issue 45)
    monkeypatch.setattr(
        verify, "check_scores", lambda *a: checked.append(check(*a)) or checked[-1], raising=False
    )
    run, server = _run_with_engine(tmp_path, swap=swap)
    try:
        rl_step(run, 0, StepTimer())  # its push is checked at the next rollout
        if swap:
            with pytest.raises(
                WeightSyncError,
                match=rf"{server.url} scores tokens differently.*push of '2': mean \|log-prob difference\| 0.003",
            ):
                evaluate(run, 1)
        else:
            evaluate(run, 1)
            rl_step(run, 1, StepTimer())
            evaluate(run, 2)  # every push checked (verify_every=1), once, at the rollout after it
            assert len(checked) == 2 and max(checked) < 1e-5, checked  # fp32 engine: the same scores
    finally:
        run.close()
        server.stop()


def test_score_tolerance_follows_the_lower_precision():
    from moe_rl.rollout.weight_sync.verify import SCORE_TOLERANCE, Probe, check_scores, score_tolerance

    assert score_tolerance("float32", "fp32") == SCORE_TOLERANCE["fp32"]
    assert (
        score_tolerance("float32", "bf16") == score_tolerance("bfloat16", "fp32") == SCORE_TOLERANCE["bf16"]
    )
    assert score_tolerance("float32", "fp16") == SCORE_TOLERANCE["fp16"]
    assert score_tolerance("bfloat16", "bf16", 0.5) == 0.5
    probe = Probe("http://e:1", [1, 2, 3, 4], 2, [-1.0, -2.0])
    assert check_scores([probe], [[-1.0, -2.01]], 0.01, "v") == pytest.approx(0.005)
    with pytest.raises(
        WeightSyncError, match=r"http://e:1 scores tokens differently.*'v'.*0.05 over 2 tokens"
    ):
        check_scores([probe], [[-1.0, -2.1]], 0.01, "v")
    with pytest.raises(WeightSyncError):  # a NaN score never passes
        check_scores([probe], [[-1.0, float("nan")]], 0.01, "v")
