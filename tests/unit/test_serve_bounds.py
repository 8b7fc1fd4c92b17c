"""Issue 47, item 4: ``moe-rl serve`` bounds a request before any work.

``n`` x prompts x (prompt + max_tokens) against ``--max-running-requests`` / ``--max-total-tokens``
before a row is built, every number in its range and every token id in the vocabulary before the
engine is asked, each refusal a 400 naming the field. In process, on the app (no HTTP).
"""

from __future__ import annotations

import time
import tracemalloc

import pytest
import torch

from moe_rl.serve.app import SGLangProtocolApp
from tests.unit.test_serve_text import TOK, ScriptedEngine


class CountingEngine(ScriptedEngine):
    """The scripted engine, counting its calls; it has a vocabulary and one served weight."""

    vocab_size = TOK.vocab_size

    def __init__(self):
        super().__init__()
        self.calls = 0

    def generate(self, prompts, n, sampling):
        self.calls += 1
        self.sampling = sampling
        return super().generate(prompts, n, sampling)

    def hf_param_meta(self):
        return {"w": ((2, 2), torch.float32)}


@pytest.fixture
def app():
    return SGLangProtocolApp(CountingEngine(), tokenizer=TOK, model_path="tiny")


def refused(app, path: str, body: dict, field: str) -> str:
    status, out = app.handle("POST", path, body)
    message = out.get("message") or out.get("error", {}).get("message", "")
    assert status == 400 and field in message, (status, out)
    assert app.engine.calls == 0
    return message


def test_n_is_multiplied_out_only_after_the_budget_is_checked(app):
    """A 60-byte request with ``n: 1000000`` used to build a million rows (54 s, 450 MB) before the
    limits refused it."""
    tracemalloc.start()
    t0 = time.perf_counter()
    message = refused(
        app, "/v1/completions", {"prompt": "hi", "n": 1_000_000, "max_tokens": 4}, "body.n=1000000"
    )
    wall = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "--max-running-requests" in message
    assert wall < 0.5 and peak < 5 << 20, (wall, peak)


def test_n_times_the_tokens_past_the_token_limit_names_n_and_max_tokens(app):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 200, "max_completion_tokens": 2000}
    message = refused(
        app, "/v1/chat/completions", body, "body.n=200 x (prompt + body.max_completion_tokens=2000)"
    )
    assert "--max-total-tokens" in message


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**70}},
            "sampling_params.sampling_seed=",
        ),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"sampling_seed": -1}},
            "sampling_params.sampling_seed=-1",
        ),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "sampling_params.top_k=0"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}},
            "sampling_params.max_new_tokens=0",
        ),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p=0"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}},
            "sampling_params.temperature=",
        ),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [-3]}},
            "sampling_params.stop_token_ids",
        ),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**6]}},
            "stop_token_ids[0]: token id 1000000",
        ),
        ("/generate", {"input_ids": [1, 10**9]}, "body.input_ids[0]: token id 1000000000"),
        ("/generate", {"input_ids": [[1]] * 300}, "number of prompts (300)"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**63}, "body.seed="),
        ("/v1/completions", {"prompt": [[5, 10**7]]}, "body.prompt[0]: token id 10000000"),
        ("/v1/completions", {"prompt": ["a"] * 300}, "body.n=1 x 300 prompt(s)"),
        ("/v1/completions", {"prompt": "a", "top_p": 0}, "body.top_p=0"),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1, "world_size": 2},
            "body.master_port=70000",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 0, "world_size": 2},
            "body.rank_offset=0",
        ),
        ("/get_weights_by_name", {"name": "w", "truncate_size": -1}, "body.truncate_size=-1"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.startswith("/") else None,
)
def test_every_number_is_range_checked_before_any_work_naming_the_field(app, path, body, field):
    refused(app, path, body, field)


def test_a_weight_push_of_a_shape_the_model_lacks_is_refused_before_anything_is_allocated(app):
    """``shapes`` used to go straight to ``torch.empty``: ``[[10**12]]`` asked for 4 TB."""
    assert app.handle("POST", "/begin_weight_update", {})[0] == 200
    body = {"names": ["w"], "dtypes": ["float32"], "shapes": [[10**12]]}
    refused(app, "/update_weights_from_distributed", body, "body.shapes[0]=[1000000000000]")
    body = {"names": ["nope"], "dtypes": ["float32"], "shapes": [[2, 2]]}
    refused(app, "/update_weights_from_distributed", body, "body.names[0]='nope'")


def test_a_denormal_temperature_samples_greedily_as_in_sglang(app):
    """Below 1e-6 SGLang samples greedily; 5e-324 used to divide the logits into infinities."""
    status, out = app.handle(
        "POST",
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"temperature": 5e-324, "max_new_tokens": 2}},
    )
    assert status == 200 and app.engine.calls == 1, out
    assert app.engine.sampling.temperature == 0.0  # greedy, not logits / 5e-324
