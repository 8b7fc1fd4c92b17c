"""SGLang's HTTP contract, pinned: our client parses real SGLang shapes, sends SGLang's request
fields, and our ``moe-rl serve`` answers with the same shapes.

Sources (sgl-project/sglang, 0.5.x and main as stored at the time of writing):
- python/sglang/api/v1/api_types.py: GenerateRequest, SamplingParams (unknown keys rejected),
  GenerateResponse/GenerateMetaInfo, LogprobEntry ([logprob, token_id, text] positional),
  FinishReason (object tagged by "type": stop{matched} | length{length} | abort{message, ...}),
  GetModelInfoResponse, GetServerInfoResponse, ErrorBody. That file is generated codec code; we
  vendor nothing from it and restate the parts we rely on as msgspec Structs below.
- python/sglang/srt/managers/io_struct.py: UpdateWeightsFromDistributedReqInput,
  InitWeightsUpdateGroupReqInput, UpdateWeightFromDiskReqInput, UpdateWeightVersionReqInput,
  PauseGenerationReqInput, BeginWeightUpdateReqInput (later main only).
- python/sglang/srt/managers/tokenizer_manager.py: meta_info keys (id, finish_reason,
  prompt_tokens, weight_version, completion_tokens, cached_tokens, routed_experts, e2e_latency);
  with --skip-tokenizer-init a response is {"output_ids", "meta_info"} without "text".
- python/sglang/srt/entrypoints/http_server.py: endpoint paths, {"success", "message"} bodies
  of weight updates, ErrorResponse {"object": "error", "message", "type", "param", "code"} for
  request validation (400), {"error": {"message"}} for generate errors (400).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import msgspec
import pytest
import torch

from moe_rl.dist import free_port
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_engine import SGLangEngine
from moe_rl.rollout.sglang_launcher import SGLangServerConfig, build_command
from moe_rl.rollout.sglang_protocol import (
    ROUTES_MISSING,
    RoutesMissing,
    SGLangBadRequest,
    SGLangError,
    SGLangHTTPError,
    SGLangNotFound,
    SGLangUnavailable,
    StaleWeightsError,
    parse_generate_response,
    to_sglang_sampling_params,
)
from moe_rl.rollout.types import Rollouts, SamplingParams
from moe_rl.routing.codec import decode_sglang_routes
from moe_rl.serve import http as srv_http
from moe_rl.serve import protocol as srv


# ---------------------------------------------------------------- the contract (msgspec)
class SGLSamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """api_types.py SamplingParams (the subset of its fields we use; unknown keys rejected)."""

    max_new_tokens: int | None = 128
    stop_token_ids: list[int] | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 1 << 30
    sampling_seed: int | None = None


class GenerateBatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    """api_types.py GenerateRequest with batched input_ids, plus io_struct's return_routed_experts."""

    input_ids: list[list[int]]
    sampling_params: SGLSamplingParams | list[SGLSamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    return_routed_experts: bool = False


class GenerateOneRequest(msgspec.Struct, forbid_unknown_fields=True):
    """api_types.py GenerateRequest for one sample (as the engine sends them), plus return_routed_experts."""

    input_ids: list[int]
    rid: str
    sampling_params: SGLSamplingParams
    return_logprob: bool
    return_routed_experts: bool = False


class LogprobEntry(msgspec.Struct, array_like=True):
    """api_types.py LogprobEntry: JSON positional array [logprob, token_id, text]."""

    logprob: float | None
    token_id: int
    text: str | None


class FinishStop(msgspec.Struct, tag_field="type", tag="stop"):
    matched: int | str | list[int] | None = None


class FinishLength(msgspec.Struct, tag_field="type", tag="length"):
    length: int | None = None


class FinishAbort(msgspec.Struct, tag_field="type", tag="abort"):
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class GenerateMetaInfo(msgspec.Struct):
    """api_types.py GenerateMetaInfo + tokenizer_manager's weight_version and routed_experts."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishStop | FinishLength | FinishAbort | None
    weight_version: str
    output_token_logprobs: list[LogprobEntry] | None = None
    routed_experts: str | None = None
    cached_tokens: int = 0
    e2e_latency: float | None = None


class GenerateResponse(msgspec.Struct):
    """api_types.py GenerateResponse as sent with --skip-tokenizer-init (no text)."""

    output_ids: list[int]
    meta_info: GenerateMetaInfo
    text: str = ""


class InitWeightsUpdateGroupReq(msgspec.Struct, forbid_unknown_fields=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReq(msgspec.Struct, forbid_unknown_fields=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightFromDiskReq(msgspec.Struct, forbid_unknown_fields=True):
    model_path: str
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightVersionReq(msgspec.Struct, forbid_unknown_fields=True):
    new_version: str
    abort_all_requests: bool = True


class PauseGenerationReq(msgspec.Struct, forbid_unknown_fields=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class BeginWeightUpdateReq(msgspec.Struct, forbid_unknown_fields=True):
    selector: str = "all"


class EndWeightUpdateReq(msgspec.Struct, forbid_unknown_fields=True):
    abort: bool = False  # ours (moe-rl serve): SGLang's EndWeightUpdateReqInput has no fields


class SuccessMessage(msgspec.Struct):
    success: bool
    message: str


class DiskUpdateResponse(SuccessMessage):
    num_paused_requests: int


class WeightVersionUpdateResponse(SuccessMessage):
    new_version: str


class StatusMessage(msgspec.Struct):
    message: str
    status: str


class GetModelInfoResponse(msgspec.Struct):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    preferred_sampling_params: str | None
    weight_version: str


class GetServerInfoResponse(msgspec.Struct):
    model_path: str
    max_context_length: int
    version: str
    internal_states: list[Any]
    weight_version: str


class WeightVersion(msgspec.Struct):
    weight_version: str


class ErrorResponse(msgspec.Struct):
    object: Literal["error"]
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(msgspec.Struct):
    message: str


class GenerateError(msgspec.Struct):
    error: ErrorBody


# ---------------------------------------------------------------- pinned SGLang responses
# /generate, batch of 2, --skip-tokenizer-init, return_logprob + return_routed_experts, on a
# 2-layer top-2 MoE. routed_experts: base64 little-endian int32 [prompt + completion - 1, L, K].
PINNED_GENERATE = json.loads("""[
 {"output_ids": [11, 12, 3],
  "meta_info": {"id": "0c5a3f6e9b2d4f18a7c1e2d3b4a59687", "finish_reason": {"type": "stop", "matched": 3},
   "prompt_tokens": 4, "weight_version": "step-7", "num_retractions": 0, "reasoning_tokens": 0,
   "completion_tokens": 3, "cached_tokens": 0,
   "output_token_logprobs": [[-0.51, 11, null], [-1.25, 12, null], [-0.0625, 3, null]],
   "routed_experts": "AAAAAAMAAAAGAAAAAQAAAAQAAAAHAAAAAgAAAAUAAAAAAAAAAwAAAAYAAAABAAAABAAAAAcAAAACAAAABQAAAAAAAAADAAAABgAAAAEAAAAEAAAABwAAAAIAAAAFAAAA",
   "e2e_latency": 0.118}},
 {"output_ids": [7, 8, 9, 10],
  "meta_info": {"id": "1d6b4a7fac3e5029b8d2f3e4c5b6a798", "finish_reason": {"type": "length", "length": 4},
   "prompt_tokens": 2, "weight_version": "step-7", "num_retractions": 0, "reasoning_tokens": 0,
   "completion_tokens": 4, "cached_tokens": 0,
   "output_token_logprobs": [[-2.0, 7, null], [-0.25, 8, null], [-1.0, 9, null], [-0.5, 10, null]],
   "routed_experts": "AAAAAAUAAAACAAAABwAAAAQAAAABAAAABgAAAAMAAAAAAAAABQAAAAIAAAAHAAAABAAAAAEAAAAGAAAAAwAAAAAAAAAFAAAAAgAAAAcAAAA=",
   "e2e_latency": 0.118}}
]""")
PINNED_ROUTES_0 = [[[0, 3], [6, 1]], [[4, 7], [2, 5]]] * 3
PINNED_ROUTES_1 = [[[0, 5], [2, 7]], [[4, 1], [6, 3]]] * 2 + [[[0, 5], [2, 7]]]
PINNED_ABORT = {
    "output_ids": [],
    "meta_info": {
        "id": "x",
        "finish_reason": {
            "type": "abort",
            "message": "Abort before prefill",
            "status_code": 503,
            "err_type": None,
        },
        "prompt_tokens": 2,
        "weight_version": "default",
        "completion_tokens": 0,
        "cached_tokens": 0,
    },
}
PINNED_VALIDATION_ERROR = {
    "object": "error",
    "message": "1 validation error: input_ids ...",
    "type": "Bad Request",
    "param": None,
    "code": 400,
}


def test_pinned_fixtures_satisfy_the_contract():
    msgspec.convert(PINNED_GENERATE, list[GenerateResponse])
    msgspec.convert(PINNED_ABORT, GenerateResponse)
    msgspec.convert(PINNED_VALIDATION_ERROR, ErrorResponse)


def test_client_parses_pinned_generate_response():
    a, b = (parse_generate_response(r, want_logprobs=True, want_routes=True) for r in PINNED_GENERATE)
    assert a.output_ids == [11, 12, 3] and b.output_ids == [7, 8, 9, 10]
    assert a.logprobs == [-0.51, -1.25, -0.0625] and b.logprobs == [-2.0, -0.25, -1.0, -0.5]
    assert (a.finish_reason, b.finish_reason) == ("stop", "length")
    assert a.weight_version == "step-7" and a.prompt_tokens == 4
    assert decode_sglang_routes(a.routed_experts, 2, 2).tolist() == PINNED_ROUTES_0
    assert decode_sglang_routes(b.routed_experts, 2, 2).tolist() == PINNED_ROUTES_1


def test_missing_routes_and_abort_are_clear_errors():
    no_routes = json.loads(json.dumps(PINNED_GENERATE[0]))
    del no_routes["meta_info"]["routed_experts"]
    with pytest.raises(RoutesMissing) as e:
        parse_generate_response(no_routes, want_logprobs=True, want_routes=True)
    assert str(e.value) == ROUTES_MISSING
    assert "--enable-return-routed-experts" in ROUTES_MISSING
    with pytest.raises(SGLangError, match="abort"):
        parse_generate_response(PINNED_ABORT, want_logprobs=False, want_routes=False)
    bad = json.loads(json.dumps(PINNED_GENERATE[0]))
    bad["meta_info"]["output_token_logprobs"][0][1] = 99
    with pytest.raises(SGLangError, match="disagree"):
        parse_generate_response(bad, want_logprobs=True, want_routes=False)


class _Canned:
    """Stands in for the socket: records requests, answers with canned (status, body)."""

    def __init__(self, answers: dict[str, Any]):
        self.answers, self.calls = answers, []

    def __call__(self, method: str, path: str, payload: bytes | None, timeout: float):
        body_in = None if payload is None else json.loads(payload)
        self.calls.append((method, path, body_in))
        answer = self.answers.get(path, (404, {"detail": "Not Found"}))
        answer = answer(body_in) if callable(answer) else answer
        status, body = answer if isinstance(answer, tuple) else (200, answer)
        if isinstance(body, Exception):
            raise body
        return status, (body if isinstance(body, bytes) else json.dumps(body).encode())

    def transport(self) -> httpx.MockTransport:
        """The same answers for httpx clients (the engine's per-sample async requests)."""

        def handler(request: httpx.Request) -> httpx.Response:
            status, raw = self(request.method, request.url.path, request.content or None, 0.0)
            return httpx.Response(status, content=raw)

        return httpx.MockTransport(handler)


def _pinned_per_prompt(body: dict) -> dict:
    """/generate answered per sample, as SGLang answers one request per prompt."""
    return PINNED_GENERATE[0] if body["input_ids"] == [1, 2, 3, 4] else PINNED_GENERATE[1]


def _engine_with(monkeypatch, answers, version="step-7") -> tuple[SGLangEngine, _Canned]:
    canned = _Canned(answers)
    client = SGLangClient("http://127.0.0.1:1", timeout_s=1, retries=0, transport=canned.transport())
    return SGLangEngine(client, num_layers=2, topk=2, num_experts=8, weight_version=version), canned


def test_engine_builds_rollouts_from_pinned_responses(monkeypatch, caplog):
    info = {"enable_deterministic_inference": False}  # SGLang's server_info carries all ServerArgs
    engine, canned = _engine_with(monkeypatch, {"/generate": _pinned_per_prompt, "/server_info": info})
    sp = SamplingParams(
        temperature=0.7, top_p=0.9, max_new_tokens=4, seed=100, return_routes=True, stop_token_ids=(3,)
    )
    ro = engine.generate([[1, 2, 3, 4], [5, 6]], 1, sp)
    assert isinstance(ro, Rollouts) and ro.weight_version == "step-7"
    assert ro.tokens_BT.tolist() == [[1, 2, 3, 4, 11, 12, 3], [5, 6, 7, 8, 9, 10, 0]]
    assert ro.prompt_lens_B.tolist() == [4, 2] and ro.total_lens_B.tolist() == [7, 6]
    assert ro.response_mask_BT.tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0]]
    assert ro.logprobs_BT[0, 4:].tolist() == pytest.approx([-0.51, -1.25, -0.0625])
    assert ro.logprobs_BT[1, 2:6].tolist() == [-2.0, -0.25, -1.0, -0.5] and ro.logprobs_BT[1, 6] == 0
    assert ro.finish_reasons == ["stop", "length"] and ro.prompt_index_B.tolist() == [0, 1]
    assert ro.routes_BTLK.dtype == torch.uint8 and ro.routes_BTLK.shape == (2, 7, 2, 2)
    assert ro.routes_BTLK[0, :6].tolist() == PINNED_ROUTES_0 and ro.routes_BTLK[0, 6].sum() == 0
    assert ro.routes_BTLK[1, :5].tolist() == PINNED_ROUTES_1 and ro.routes_BTLK[1, 5:].sum() == 0
    assert "--enable-deterministic-inference" in caplog.text  # seeds would be ignored: say so
    sent = sorted((c[2] for c in canned.calls if c[1] == "/generate"), key=lambda b: -len(b["input_ids"]))
    bodies = [msgspec.convert(b, GenerateOneRequest) for b in sent]  # one request per sample
    assert [b.sampling_params.sampling_seed for b in bodies] == [100, 101]
    assert all(b.return_routed_experts and b.sampling_params.stop_token_ids == [3] for b in bodies)
    assert len({b.rid for b in bodies}) == 2  # each row has its own rid (for /abort_request)


def test_engine_rejects_stale_weights(monkeypatch):
    engine, _ = _engine_with(monkeypatch, {"/generate": _pinned_per_prompt}, version="step-8")
    with pytest.raises(StaleWeightsError, match="'step-7'.*'step-8'"):
        engine.generate([[1, 2, 3, 4], [5, 6]], 1, SamplingParams(max_new_tokens=4))


def test_client_requests_match_contract(monkeypatch):
    ok = {"success": True, "message": "ok"}
    client = SGLangClient("http://127.0.0.1:1", timeout_s=1, retries=0)
    canned = _Canned(
        {
            "/init_weights_update_group": ok,
            "/update_weights_from_distributed": ok,
            "/update_weights_from_disk": {**ok, "num_paused_requests": 0},
            "/update_weight_version": {**ok, "new_version": "v1"},
            "/pause_generation": {"message": "Generation paused successfully.", "status": "ok"},
            "/continue_generation": {"message": "x", "status": "ok"},
            "/begin_weight_update": ok,
            "/end_weight_update": ok,
            "/server_info": (404, {"detail": "Not Found"}),
            "/get_server_info": {"version": "0.5.4"},
        }
    )
    monkeypatch.setattr(client, "_send", canned)
    client.init_weights_update_group(
        master_address="127.0.0.1",
        master_port=29500,
        rank_offset=1,
        world_size=2,
        group_name="g",
        backend="gloo",
    )
    client.update_weights_from_distributed(
        names=["a"],
        dtypes=["bfloat16"],
        shapes=[[2, 3]],
        group_name="g",
        flush_cache=False,
        weight_version="v1",
    )
    client.update_weights_from_disk("/ckpt/v1", weight_version="v1")
    client.update_weight_version("v1")
    client.pause_generation()
    client.continue_generation()
    assert client.begin_weight_update() is True  # not advertised: probed
    client.end_weight_update()
    client.end_weight_update(abort=True)
    structs = {
        "/init_weights_update_group": InitWeightsUpdateGroupReq,
        "/update_weights_from_distributed": UpdateWeightsFromDistributedReq,
        "/update_weights_from_disk": UpdateWeightFromDiskReq,
        "/update_weight_version": UpdateWeightVersionReq,
        "/pause_generation": PauseGenerationReq,
        "/begin_weight_update": BeginWeightUpdateReq,
        "/end_weight_update": EndWeightUpdateReq,
    }
    for _method, path, body in canned.calls:
        if path in structs:
            msgspec.convert(body, structs[path])
    assert [c[1] for c in canned.calls].count("/get_server_info") == 1  # fell back from /server_info
    ends = [c[2] for c in canned.calls if c[1] == "/end_weight_update"]
    assert ends == [{}, {}]  # "abort" is ours: never sent to a server that did not advertise it


def test_begin_weight_update_absent_on_sglang_05(monkeypatch):
    client = SGLangClient("http://127.0.0.1:1", timeout_s=1, retries=0)
    canned = _Canned(
        {
            "/server_info": (404, {"detail": "Not Found"}),
            "/get_server_info": {"version": "0.5.4"},
            "/begin_weight_update": (404, {"detail": "Not Found"}),
        }
    )
    monkeypatch.setattr(client, "_send", canned)
    assert client.begin_weight_update() is False and client.begin_weight_update() is False
    assert [c[1] for c in canned.calls].count("/begin_weight_update") == 1


def test_errors_retries_and_unavailable(monkeypatch):
    client = SGLangClient("http://127.0.0.1:1", timeout_s=1, retries=2, backoff_s=0.01)
    canned = _Canned(
        {
            "/generate": (400, PINNED_VALIDATION_ERROR),
            "/update_weights_from_disk": (400, {"success": False, "message": "bad shape"}),
            "/flush_cache": (503, b"busy"),
            "/model_info": (400, {"error": {"message": "nope"}}),
        }
    )
    monkeypatch.setattr(client, "_send", canned)
    with pytest.raises(SGLangBadRequest, match="validation error") as e:
        client.generate([[1]], {})
    assert e.value.status == 400 and len(canned.calls) == 1  # a 400 is never retried
    with pytest.raises(SGLangBadRequest, match="bad shape"):
        client.update_weights_from_disk("/x")
    with pytest.raises(SGLangBadRequest, match="nope"):
        client.get_weight_version()
    canned.calls.clear()
    with pytest.raises(SGLangHTTPError, match="HTTP 503: busy.*3 attempts"):
        client.flush_cache()
    assert len(canned.calls) == 3
    port = free_port()  # nothing listens there
    dead = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=1, retries=2, backoff_s=0.01)
    with pytest.raises(SGLangUnavailable, match=rf"127\.0\.0\.1:{port} is unavailable.*3 times over"):
        dead.get_weight_version()


def test_sampling_params_roundtrip():
    sp = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=33, stop_token_ids=(2, 7))
    d = to_sglang_sampling_params(sp, 41)
    msgspec.convert(d, SGLSamplingParams)
    back, seed = srv.to_sampling(d, "sp")
    assert back == sp and seed == 41
    assert srv.to_sampling({"top_k": 1 << 30}, "sp")[0].top_k == -1  # SGLang's TOP_K_ALL
    for bad, field in (
        ({"seed": 1}, "sp.seed"),
        ({"temperature": "hot"}, "sp.temperature"),
        ({"regex": "a+"}, "sp.regex"),
        ({"top_p": 0}, "top_p"),
    ):
        with pytest.raises(srv.BadRequest, match=field):
            srv.to_sampling(bad, "sp")


def test_launcher_command():
    cfg = SGLangServerConfig(
        model_path="/ckpt/qwen3-30b-a3b",
        tp_size=4,
        ep_size=4,
        enable_return_routed_experts=True,
        mem_fraction_static=0.8,
        dtype="bfloat16",
        weight_version="step-0",
        python="python3",
    )
    assert build_command(cfg, 31000) == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt/qwen3-30b-a3b",
        "--tp-size",
        "4",
        "--ep-size",
        "4",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--dtype",
        "bfloat16",
        "--mem-fraction-static",
        "0.8",
        "--skip-tokenizer-init",
        "--enable-return-routed-experts",
        "--weight-version",
        "step-0",
    ]
    plain = build_command(SGLangServerConfig(model_path="/m", python="py"), 1)
    assert "--enable-return-routed-experts" not in plain and "--mem-fraction-static" not in plain
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangServerConfig(model_path="/m", mem_fraction_static=1.5)


# ---------------------------------------------------------------- our server, same contract
class _EchoEngine:
    """Tiny deterministic engine: repeats (last token + 1) % 16; one weight named 'w'."""

    weight_version = "x"

    def __init__(self):
        self.w = torch.zeros(2)

    def generate(self, prompts, n, sampling):
        B, R = len(prompts), sampling.max_new_tokens
        T = max(map(len, prompts)) + R
        tok = torch.zeros(B, T, dtype=torch.int64)
        mask, logp = torch.zeros(B, T), torch.zeros(B, T)
        routes = torch.zeros(B, T, 2, 2, dtype=torch.uint8)
        for b, p in enumerate(prompts):
            tok[b, : len(p)] = torch.tensor(p)
            tok[b, len(p) : len(p) + R] = (p[-1] + 1) % 16
            mask[b, len(p) : len(p) + R] = 1
            logp[b, len(p) : len(p) + R] = -0.5 - float(self.w[0])
            routes[b, : len(p) + R - 1] = 1
        return Rollouts(
            tokens_BT=tok,
            prompt_lens_B=torch.tensor([len(p) for p in prompts]),
            total_lens_B=torch.tensor([len(p) + R for p in prompts]),
            response_mask_BT=mask,
            logprobs_BT=logp,
            finish_reasons=["length"] * B,
            weight_version=self.weight_version,
            prompt_index_B=torch.arange(B),
            routes_BTLK=routes if sampling.return_routes else None,
        )

    def hf_param_meta(self):
        return {"w": ((2,), torch.float32)}

    def load_hf_tensors(self, named):
        named = dict(named)
        for k, t in named.items():
            if k != "w" or t.shape != (2,):
                raise ValueError(f"bad {k}")
        self.w = named["w"].clone()


@pytest.fixture
def local_server():
    server = srv_http.ServerThread(_EchoEngine(), weight_version="v0", enable_return_routed_experts=True)
    yield SGLangClient(server.url, timeout_s=10, retries=0)
    server.stop()


def test_our_server_speaks_the_contract(local_server):
    c = local_server
    batch = c.request(
        "POST",
        "/generate",
        {
            "input_ids": [[1, 2], [3]],
            "return_logprob": True,
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        },
    )
    items = msgspec.convert(batch, list[GenerateResponse])
    assert items[0].output_ids == [3, 3, 3] and items[1].meta_info.prompt_tokens == 1
    assert isinstance(items[0].meta_info.finish_reason, FinishLength)
    assert items[0].meta_info.finish_reason.length == 3 and items[0].meta_info.weight_version == "v0"
    assert decode_sglang_routes(items[0].meta_info.routed_experts, 2, 2).shape == (4, 2, 2)
    single = msgspec.convert(
        c.request("POST", "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}),
        GenerateResponse,
    )
    assert single.output_ids == [6] and single.meta_info.output_token_logprobs is None
    for path in ("/model_info", "/get_model_info"):
        msgspec.convert(c.request("GET", path), GetModelInfoResponse)
    for path in ("/server_info", "/get_server_info"):
        assert msgspec.convert(c.request("GET", path), GetServerInfoResponse).weight_version == "v0"
    for path in ("/get_weight_version", "/weight_version"):  # removed in SGLang 0.5.11: 404, use /model_info
        with pytest.raises(SGLangNotFound, match=r"deprecated\. Please use '/model_info'"):
            c.request("GET", path)
    assert msgspec.convert(c.request("GET", "/model_info"), WeightVersion).weight_version == "v0"
    msgspec.convert(c.request("POST", "/pause_generation", {"mode": "abort"}), StatusMessage)
    assert not c.health_generate() and c.health()  # SGLang: /health_generate 503 while paused
    with pytest.raises(SGLangHTTPError) as e:
        c.request("GET", "/ready")
    assert e.value.status == 503
    msgspec.convert(c.request("POST", "/continue_generation", {}), StatusMessage)
    assert c.request("GET", "/ready") is None
    r = msgspec.convert(
        c.request("POST", "/update_weight_version", {"new_version": "v1"}), WeightVersionUpdateResponse
    )
    assert r.success and r.new_version == "v1" and c.get_weight_version() == "v1"
    assert c.health() and c.health_generate()
    assert c.request("GET", "/flush_cache").startswith("Cache flushed")


def test_our_server_errors_use_sglang_shapes(local_server):
    c = local_server
    cases = [
        ("/generate", {"input_ids": [[1]], "sampling_params": {"seed": 3}}, "sampling_params.seed"),
        ("/generate", {"text": "hi"}, "input_ids"),
        ("/generate", {"input_ids": [[1]], "sampling_params": {"top_p": "x"}}, "top_p"),
        ("/update_weights_from_distributed", {"dtypes": [], "shapes": []}, "body.names"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1"}, "body.master_port"),
        ("/update_weight_version", {}, "body.new_version"),
    ]
    for path, body, field in cases:
        with pytest.raises(SGLangBadRequest, match=field) as e:
            c.request("POST", path, body)
        msgspec.convert(e.value.body, ErrorResponse)
    with pytest.raises(SGLangHTTPError) as e:
        c.request("GET", "/no_such_endpoint")
    assert e.value.status == 404
    if not torch.cuda.is_available():
        with pytest.raises(SGLangBadRequest, match="nccl"):
            c.init_weights_update_group(
                master_address="127.0.0.1",
                master_port=1,
                rank_offset=1,
                world_size=2,
                group_name="g",
                backend="nccl",
            )


def test_our_server_session_is_atomic(local_server, tmp_path):
    from safetensors.torch import save_file

    c = local_server
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    save_file({"w": torch.tensor([1.0, 2.0])}, str(good / "model.safetensors"))
    save_file({"w": torch.zeros(3)}, str(bad / "model.safetensors"))
    assert c.begin_weight_update() is True
    with pytest.raises(SGLangBadRequest, match="a weight-update session is already open"):
        c.request("POST", "/begin_weight_update", {})
    msgspec.convert(
        c.request("POST", "/update_weights_from_disk", {"model_path": str(good), "weight_version": "v2"}),
        DiskUpdateResponse,
    )
    assert c.get_weight_version() == "v0"  # staged, not applied
    with pytest.raises(SGLangBadRequest, match=r"'w': shape \[3\]"):
        c.update_weights_from_disk(str(bad), weight_version="v3")
    with pytest.raises(SGLangBadRequest, match="Nothing applied"):
        c.end_weight_update()
    assert c.get_weight_version() == "v0"
    out = c.generate([[1]], {"max_new_tokens": 1})[0]
    assert out.logprobs == [-0.5] and out.weight_version == "v0"
    assert c.begin_weight_update() is True
    c.update_weights_from_disk(str(good), weight_version="v2")
    msgspec.convert(c.end_weight_update(), SuccessMessage)
    out = c.generate([[1]], {"max_new_tokens": 1})[0]
    assert out.logprobs == [-1.5] and out.weight_version == "v2"
    with pytest.raises(
        SGLangBadRequest, match=r"no weight-update session is open; call begin_weight_update\(\) first"
    ):
        c.end_weight_update()


def test_a_null_logprob_is_a_clear_error_naming_the_request():
    bad = json.loads(json.dumps(PINNED_GENERATE[0]))
    bad["meta_info"]["output_token_logprobs"][1][0] = None  # SGLang writes a non-finite float as null
    msgspec.convert(bad, GenerateResponse)  # still within SGLang's own contract
    with pytest.raises(SGLangError, match=r"non-finite\) log-probs, first at token 1"):
        parse_generate_response(bad, want_logprobs=True, want_routes=False)
    assert parse_generate_response(bad, want_logprobs=False, want_routes=False).logprobs is None
