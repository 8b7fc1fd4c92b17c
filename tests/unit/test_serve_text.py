"""``moe-rl serve`` with the model's tokenizer: text in ``/generate`` and the OpenAI endpoints.

- text in, text out: the served demo checkpoint (``recipes/demo/start``, an HF export with the
  character tokenizer) through :func:`moe_rl.serve.embedded.build_engine`; the answer's ``text`` is
  the decoded ``output_ids``, and ``moe-rl serve`` hands the engine's tokenizer to the server unless
  ``--skip-tokenizer-init``;
- ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` on a scripted engine (its replies
  are known): choices, ``n``, ``max_tokens``, ``finish_reason`` stop vs length, usage equal to the
  token counts, chat templates (the tokenizer's, and the simple one without), field-naming 400s;
- every OpenAI answer validated by SGLang's own pydantic response models, built from the wheel's
  ``sglang/srt/entrypoints/openai/protocol.py`` (the module itself needs ``openai`` and ``zmq``,
  absent here, so :func:`tests.unit.sglang_wheels.openai_models` executes only the classes), and
  the request fields we read checked against SGLang's request classes.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from moe_rl.rollout.types import Rollouts
from moe_rl.serve import http as srv_http
from moe_rl.serve.openai import CHAT_FIELDS, COMPLETION_FIELDS
from moe_rl.serve.text import SIMPLE_CHAT_TEMPLATE
from moe_rl.tasks.tokenizer import CharTokenizer, HFTokenizer

DEMO_START = Path(__file__).resolve().parents[2] / "recipes/demo/start"
TOK = CharTokenizer()
REPLY_STOP = "the answer is 42."
"What the scripted engine says to a prompt holding a question mark, then EOS."
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
A_ID = TOK.encode("a")[0]


class ScriptedEngine:
    """Replies known in advance (char tokenizer ids): to a prompt holding ``?``, :data:`REPLY_STOP`
    then EOS (finish ``stop``); to any other, the alphabet from letter ``seed + row`` (0 without a
    seed), cycling, never EOS (finish ``length``). Records the prompts it was given."""

    weight_version = "x"
    max_context_length = 4096

    def __init__(self):
        self.prompts: list[list[int]] = []

    def reply(self, prompt: list[int], row_seed: int | None) -> list[int]:
        if "?" in TOK.decode(prompt):
            return TOK.encode(REPLY_STOP) + [TOK.eos_id]
        start = 0 if row_seed is None else row_seed % 26
        return TOK.encode((ALPHABET[start:] + ALPHABET * 40)[:1000])

    def generate(self, prompts, n, sampling):
        self.prompts += [list(p) for p in prompts]
        R = sampling.max_new_tokens
        replies = []
        for j, p in enumerate(prompts):
            full = self.reply(p, None if sampling.seed is None else sampling.seed + j)
            stops = set(sampling.stop_token_ids) | ({TOK.eos_id} if not sampling.ignore_eos else set())
            cut = next((k + 1 for k, t in enumerate(full) if t in stops), None)
            replies.append((full[: min(R, cut or R)], cut is not None and cut <= R))
        B, T = len(prompts), max(map(len, prompts)) + R
        tok, mask, logp = torch.zeros(B, T, dtype=torch.int64), torch.zeros(B, T), torch.zeros(B, T)
        for b, (p, (r, _)) in enumerate(zip(prompts, replies)):
            tok[b, : len(p) + len(r)] = torch.tensor(list(p) + r)
            mask[b, len(p) : len(p) + len(r)] = 1
            logp[b, len(p) : len(p) + len(r)] = -0.25
        return Rollouts(
            tokens_BT=tok,
            prompt_lens_B=torch.tensor([len(p) for p in prompts]),
            total_lens_B=torch.tensor([len(p) + len(r) for p, (r, _) in zip(prompts, replies)]),
            response_mask_BT=mask,
            logprobs_BT=logp,
            finish_reasons=["stop" if s else "length" for _, s in replies],
            weight_version=self.weight_version,
            prompt_index_B=torch.arange(B),
            routes_BTLK=None,
        )


@pytest.fixture
def scripted():
    engine = ScriptedEngine()
    server = srv_http.ServerThread(engine, tokenizer=TOK, model_path="tiny-moe")
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c, engine
    server.stop()


@pytest.fixture(scope="module")
def sglang_openai():
    """SGLang 0.5.23's OpenAI response models and request fields, from its wheel; (None, None) where
    the wheel was not fetched (``make sglang-wheels``, which CI runs first; this fast-tier file starts
    no download): the behaviour is still checked, the shapes by SGLang's models not."""
    from tests.sglang_wheels import OPENAI_PROTOCOL, cached_wheel, openai_models, read, struct_fields

    whl = cached_wheel("0.5.23")
    if whl is None:
        return None, None
    src = read(whl, OPENAI_PROTOCOL)
    models = openai_models(
        src, ["ModelList", "CompletionResponse", "ChatCompletionResponse", "ErrorResponse"]
    )
    return models, struct_fields(src)


def fits(model: type | None, body: dict) -> None:
    """``body`` validates as SGLang's ``model`` and has no key that the model lacks (top level, choices)."""
    if model is None:  # no wheel: see sglang_openai
        return
    model.model_validate(body)
    assert set(body) <= set(model.model_fields), set(body) - set(model.model_fields)
    if "choices" in body:
        choice = model.model_fields["choices"].annotation.__args__[0]
        for c in body["choices"]:
            assert set(c) <= set(choice.model_fields), set(c) - set(choice.model_fields)


# ---------------------------------------------------------------- text in, text out (the real checkpoint)
def test_text_in_text_out_on_the_served_checkpoint(monkeypatch):
    """The demo checkpoint served as ``moe-rl serve --model-path`` builds it: ``text`` (one and a
    batch) is encoded with the checkpoint's tokenizer and every answer's ``text`` is its
    ``output_ids`` decoded; ``main`` gives the server that tokenizer unless --skip-tokenizer-init."""
    from moe_rl.serve import embedded

    args = srv_http.build_arg_parser().parse_args(["--model-path", str(DEMO_START)])
    engine = embedded.build_engine(args)
    tok = HFTokenizer(DEMO_START)
    assert isinstance(engine.tokenizer, HFTokenizer) and engine.tokenizer.path == DEMO_START

    server = srv_http.ServerThread(engine, tokenizer=engine.tokenizer)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            sp = {"max_new_tokens": 6, "temperature": 0}
            one = c.post("/generate", json={"text": "12+30=", "sampling_params": sp})
            assert one.status_code == 200, one.text
            one = one.json()
            assert one["text"] == tok.decode(one["output_ids"]) and len(one["output_ids"]) == 6
            assert one["meta_info"]["prompt_tokens"] == len(tok.encode("12+30="))
            batch = c.post("/generate", json={"text": ["7*6=", "hello"], "sampling_params": sp}).json()
            assert [b["text"] for b in batch] == [tok.decode(b["output_ids"]) for b in batch]
            by_ids = c.post("/generate", json={"input_ids": tok.encode("7*6="), "sampling_params": sp}).json()
            assert by_ids["output_ids"] == batch[0]["output_ids"] and by_ids["text"] == batch[0]["text"]
    finally:
        server.stop()

    seen = {}
    monkeypatch.setattr(srv_http, "serve", lambda engine, *a, **kw: seen.update(kw))
    for extra, want in (([], engine.tokenizer), (["--skip-tokenizer-init"], None)):
        srv_http.main(["--model-path", "m", "--port", "0", *extra], factory=lambda args: engine)
        assert seen["tokenizer"] is want


def test_without_a_tokenizer_text_is_refused_and_answers_carry_none():
    """``--skip-tokenizer-init`` (the RL launcher's mode): token ids only, as before."""
    server = srv_http.ServerThread(ScriptedEngine())
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post("/generate", json={"text": "hi"})
            assert r.status_code == 400 and r.json()["message"].startswith(
                "body.text: this server has no tokenizer"
            )
            r = c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"stop": "x"}})
            assert r.status_code == 400 and "body.sampling_params.stop" in r.json()["message"]
            out = c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
            assert "text" not in out.json() and c.get("/server_info").json()["skip_tokenizer_init"] is True
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = c.post(path, json={"prompt": "a", "messages": [{"role": "user", "content": "a"}]})
                assert r.status_code == 400 and "needs the model's tokenizer" in r.json()["message"]
    finally:
        server.stop()


def test_generate_stop_strings_cut_tokens_and_text(scripted):
    c, _ = scripted
    out = c.post(
        "/generate", json={"text": "q?", "sampling_params": {"max_new_tokens": 40, "stop": ["is", "42"]}}
    )
    out = out.json()
    kept = TOK.encode("the answer is")
    assert out["output_ids"] == kept and out["text"] == "the answer "
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "is"}
    assert out["meta_info"]["completion_tokens"] == len(kept)
    keep = c.post(
        "/generate", json={"text": "q?", "sampling_params": {"stop": "is", "no_stop_trim": True}}
    ).json()
    assert keep["text"] == "the answer is"
    eos = c.post("/generate", json={"text": "q?", "sampling_params": {"max_new_tokens": 40}}).json()
    assert eos["text"] == REPLY_STOP and eos["output_ids"][-1] == TOK.eos_id
    assert eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": TOK.eos_id}


# ---------------------------------------------------------------- OpenAI endpoints
def test_completions_choices_n_max_tokens_and_usage(scripted, sglang_openai):
    c, _ = scripted
    models = sglang_openai[0] or {}
    body = {
        "model": "tiny-moe",
        "prompt": ["ab", "cde"],
        "n": 3,
        "max_tokens": 4,
        "seed": 1,
        "temperature": 0.5,
    }
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    fits(models.get("CompletionResponse"), out)
    assert out["object"] == "text_completion" and out["model"] == "tiny-moe" and out["id"].startswith("cmpl-")
    # prompt-major: prompt i's choice j is index i * n + j; choice j samples with seed + j
    assert [ch["index"] for ch in out["choices"]] == list(range(6))
    assert [ch["text"] for ch in out["choices"]] == ["bcde", "cdef", "defg"] * 2
    assert {ch["finish_reason"] for ch in out["choices"]} == {"length"}
    assert out["usage"] == {"prompt_tokens": 2 + 3, "completion_tokens": 6 * 4, "total_tokens": 5 + 24}

    ids = c.post("/v1/completions", json={"prompt": TOK.encode("xy"), "max_tokens": 2, "echo": True}).json()
    assert ids["choices"][0]["text"] == "xyab" and ids["usage"]["prompt_tokens"] == 2
    assert ids["model"] == "tiny-moe"  # no model in the request: the served name


def test_completions_finish_reason_stop_vs_length(scripted, sglang_openai):
    c, _ = scripted
    models = sglang_openai[0] or {}
    cases = [
        ({"prompt": "why?", "max_tokens": 64}, REPLY_STOP, "stop", TOK.eos_id, len(REPLY_STOP) + 1),
        ({"prompt": "why?", "max_tokens": 5}, REPLY_STOP[:5], "length", None, 5),
        ({"prompt": "why?", "max_tokens": 64, "stop": "answer"}, "the ", "stop", "answer", len("the answer")),
        ({"prompt": "plain", "max_tokens": 7, "stop": ["zz"]}, "abcdefg", "length", None, 7),
        # a stop token ends the output (kept in the ids) and is trimmed from the text, as in SGLang
        ({"prompt": "why?", "max_tokens": 64, "stop_token_ids": [A_ID]}, "the ", "stop", A_ID, len("the a")),
    ]
    for body, text, reason, matched, completion in cases:
        out = c.post("/v1/completions", json=body).json()
        fits(models.get("CompletionResponse"), out)
        ch = out["choices"][0]
        assert (ch["text"], ch["finish_reason"]) == (text, reason), body
        assert ch["matched_stop"] == matched, body
        assert out["usage"]["completion_tokens"] == completion, body
        assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + completion


def test_chat_completions_simple_template(scripted, sglang_openai):
    c, engine = scripted
    models = sglang_openai[0] or {}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is 6*7"}, {"type": "text", "text": "?"}]},
    ]
    r = c.post("/v1/chat/completions", json={"model": "tiny-moe", "messages": messages, "n": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    fits(models.get("ChatCompletionResponse"), out)
    rendered = "system: be brief\nuser: what is 6*7?\nassistant:"
    assert TOK.decode(engine.prompts[-1]) == rendered
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert [ch["index"] for ch in out["choices"]] == [0, 1]
    for ch in out["choices"]:
        assert ch["message"] == {"role": "assistant", "content": REPLY_STOP} and ch["finish_reason"] == "stop"
    assert out["usage"] == {
        "prompt_tokens": len(rendered),
        "completion_tokens": 2 * (len(REPLY_STOP) + 1),
        "total_tokens": len(rendered) + 2 * (len(REPLY_STOP) + 1),
    }
    short = c.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 3}).json()
    assert short["choices"][0]["message"]["content"] == "the"
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 3
    assert "assistant:" in SIMPLE_CHAT_TEMPLATE


def test_chat_uses_the_tokenizers_chat_template(tmp_path):
    d = TOK.save_pretrained(tmp_path / "tok")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    engine = ScriptedEngine()
    server = srv_http.ServerThread(engine, tokenizer=HFTokenizer(d))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x?"}], "max_tokens": 4},
            )
            assert r.status_code == 200, r.text
            assert TOK.decode(engine.prompts[-1], skip_special_tokens=False) == "<bos>[USER]x?[ASSISTANT]"
            assert r.json()["usage"]["prompt_tokens"] == len(engine.prompts[-1])
    finally:
        server.stop()


def test_models_endpoint(scripted, sglang_openai):
    c, _ = scripted
    models = sglang_openai[0] or {}
    out = c.get("/v1/models").json()
    fits(models.get("ModelList"), out)
    assert [m["id"] for m in out["data"]] == ["tiny-moe"] and out["data"][0]["max_model_len"] == 4096


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"max_tokens": 4}, "body.prompt: field required"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "4"}, "body.max_tokens: expected int"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "body.max_tokens=0"),
        ("/v1/completions", {"prompt": "a", "n": 0}, "body.n=0"),
        ("/v1/completions", {"prompt": "a", "temperature": -1}, "body.temperature=-1"),
        ("/v1/completions", {"prompt": "a", "top_p": 2}, "body.top_p=2"),
        ("/v1/completions", {"prompt": "a", "stop": [1]}, "body.stop: expected a string or a list"),
        ("/v1/completions", {"prompt": "a", "logprobs": 2}, "body.logprobs=2 is not supported"),
        ("/v1/completions", {"prompt": [1, "a"]}, "body.prompt: expected a string"),
        ("/v1/completions", {"prompt": "a", "stream": True}, "body.stream: streaming is not implemented"),
        ("/v1/chat/completions", {"messages": []}, "body.messages: expected a non-empty list"),
        ("/v1/chat/completions", {"messages": [{"content": "a"}]}, "body.messages[0].role: field required"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "body.messages[0].content[0]: only text parts",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "seed": 1.5}, "body.seed"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -2},
            "body.max_completion_tokens=-2",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
            "body.tools=",
        ),
        ("/generate", {"text": "a", "input_ids": [1]}, "body.text: send either text or input_ids"),
        ("/generate", {"text": ["a", 3]}, "body.text: expected a string or a non-empty list"),
        ("/generate", {"text": "a", "sampling_params": {"stop": 3}}, "body.sampling_params.stop: expected"),
    ],
)
def test_bad_fields_are_400_naming_the_field(scripted, sglang_openai, path, body, field):
    c, _ = scripted
    models = sglang_openai[0] or {}
    r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["message"], r.json()
    fits(models.get("ErrorResponse"), r.json())


def test_the_fields_we_read_are_sglangs(sglang_openai):
    _, fields = sglang_openai
    if fields is None:
        pytest.skip("the sglang 0.5.23 wheel could not be fetched")
    assert set(COMPLETION_FIELDS) <= fields["CompletionRequest"], (
        set(COMPLETION_FIELDS) - fields["CompletionRequest"]
    )
    assert set(CHAT_FIELDS) <= fields["ChatCompletionRequest"], (
        set(CHAT_FIELDS) - fields["ChatCompletionRequest"]
    )


def test_an_unknown_model_is_a_404_as_openai_answers_it(scripted):
    """Issue 49: the served model (the id /v1/models lists, or none) is answered; another name is
    OpenAI's 404 ``model_not_found`` (an OpenAI client raises NotFoundError), not a reply from a
    model the client did not ask for."""
    c, engine = scripted
    served = c.get("/v1/models").json()["data"][0]["id"]
    assert served == "tiny-moe"
    for path, body in (
        ("/v1/completions", {"prompt": "ab", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}),
    ):
        asked = len(engine.prompts)
        r = c.post(path, json={**body, "model": "gpt-4o"})
        assert r.status_code == 404, r.text
        assert r.json() == {
            "error": {
                "message": "The model `gpt-4o` does not exist: this server serves `tiny-moe` (GET /v1/models)",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
        assert len(engine.prompts) == asked  # nothing generated
        assert c.post(path, json={**body, "model": served}).status_code == 200
        assert c.post(path, json=body).status_code == 200  # no model named: the one served
