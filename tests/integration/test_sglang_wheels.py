"""moe-rl against SGLang's own files, for the oldest and newest supported releases (TESTED_SGLANG).

The wheels are fetched with ``pip download --no-deps`` (cached in .cache/sglang-wheels) and read as
zips: nothing is installed and no CUDA is needed. What is checked, per version:
- every endpoint the client calls exists in ``http_server.py`` with that method and is neither
  deprecated nor removed (the begin/end session exists only from 0.5.23 and is probed);
- every request the client builds fits the request class its handler takes (``io_struct.py``) and
  SGLang's ``SamplingParams``; where the wheel ships ``sglang/api/v1/api_types.py`` (0.5.23, not
  0.5.11), requests and the double's responses decode with SGLang's own msgspec contract;
- routed experts are accepted and base64-encoded with --skip-tokenizer-init;
- the double's removed endpoints, admin endpoints and session errors are SGLang's.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import httpx
import pytest

from moe_rl.rollout.sglang_client import SESSION_ENDPOINT, SGLangClient
from moe_rl.rollout.sglang_engine import SGLangEngine
from moe_rl.rollout.sglang_protocol import (
    SUPPORTED_SGLANG,
    TESTED_SGLANG,
    SGLangVersionError,
    check_sglang_version,
)
from moe_rl.rollout.types import SamplingParams
from moe_rl.serve import http as srv_http
from moe_rl.serve import weights as srv_weights
from tests.sglang_wheels import (
    HTTP_SERVER,
    IO_STRUCT,
    REPO,
    SAMPLING,
    SERVER_ARGS,
    TOKENIZER_MANAGER,
    WEIGHT_UPDATER,
    init_params,
    load_api_types,
    read,
    route_table,
    struct_fields,
    wheel,
)
from tests.unit.test_sglang_contract import PINNED_ROUTES_0, _EchoEngine

SESSION_PATHS = {SESSION_ENDPOINT, "/end_weight_update"}
NO_API_TYPES = {"0.5.11"}
"Releases whose wheel has no sglang/api/v1/api_types.py (their requests are checked against io_struct.py)."


@pytest.fixture(scope="module", params=TESTED_SGLANG)
def sgl(request):
    version = request.param
    whl = wheel(version)
    return {
        "version": version,
        "whl": whl,
        "routes": route_table(read(whl, HTTP_SERVER)),
        "structs": struct_fields(read(whl, IO_STRUCT)),
        "sampling": init_params(read(whl, SAMPLING), "SamplingParams"),
    }


def _answer(path: str, body: Any) -> Any:
    if path == "/model_info":
        return {"model_path": "m", "weight_version": "v1"}
    if path == "/server_info":
        return {"version": "x", "enable_deterministic_inference": True}
    if path == "/generate":
        ids = [5, 6]
        meta = {
            "id": body.get("rid", "r"),
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": 2,
            "weight_version": "v1",
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "routed_experts": _routes(len(body["input_ids"]) + 1),
        }
        return {"output_ids": ids, "meta_info": meta}
    return {"success": True, "message": "ok", "new_version": "v1", "status": "ok"}


def _routes(n: int) -> str:
    import torch

    from moe_rl.routing.codec import encode_sglang_routes

    return encode_sglang_routes(torch.tensor(PINNED_ROUTES_0[:1] * n))


@pytest.fixture(scope="module")
def recorded() -> list[tuple[str, str, Any]]:
    """Every (method, path, body) the client and engine send in one exercise of all their calls."""
    calls: list[tuple[str, str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content) if request.content else None
        calls.append((request.method, request.url.path, body))
        return httpx.Response(200, json=_answer(request.url.path, body))

    c = SGLangClient("http://sglang:30000", timeout_s=5, retries=0, transport=httpx.MockTransport(handler))
    c.health(), c.health_generate(), c.get_weight_version(), c.server_info(), c.flush_cache()
    c.pause_generation(), c.continue_generation(), c.abort_request("r1"), c.abort_request(abort_all=True)
    c.begin_weight_update(), c.end_weight_update(), c.update_weight_version("v1")
    c.init_weights_update_group(
        master_address="10.0.0.1", master_port=1, rank_offset=1, world_size=3, group_name="g", backend="nccl"
    )
    c.update_weights_from_distributed(
        names=["a"], dtypes=["bfloat16"], shapes=[[2]], group_name="g", weight_version="v1"
    )
    c.update_weights_from_tensor(["payload"], weight_version="v1")
    c.update_weights_from_disk("/ckpt", weight_version="v1")
    (
        c.release_memory_occupation(),
        c.resume_memory_occupation(["weights"]),
        c.destroy_weights_update_group("g"),
    )
    engine = SGLangEngine(c, num_layers=2, topk=2, num_experts=8)
    sp = SamplingParams(
        max_new_tokens=2, temperature=0.7, top_k=5, seed=3, stop_token_ids=(2,), return_routes=True
    )
    engine.generate([[1, 2], [3]], 2, sp)
    return calls


def test_every_client_endpoint_exists_and_is_current(sgl, recorded):
    routes, version = sgl["routes"], sgl["version"]
    assert ("0.5.23" <= version) == (SESSION_ENDPOINT in routes)  # the session endpoints arrived after 0.5.11
    for method, path, _ in recorded:
        if path in SESSION_PATHS and path not in routes:
            continue  # probed: a 404 makes the client run without the session
        assert path in routes, f"sglang {version} has no {path}"
        r = routes[path]
        assert method in r.methods, f"sglang {version} {path} takes {r.methods}, the client sends {method}"
        assert not r.deprecated and not r.removed, f"sglang {version} deprecates {path}"
    weight_version = routes.get("/get_weight_version")  # what moe-rl read before: gone or a 404
    assert weight_version is None or weight_version.removed
    assert routes["/get_model_info"].deprecated and routes["/get_server_info"].deprecated


def test_every_request_fits_sglangs_request_classes(sgl, recorded):
    routes, structs = sgl["routes"], sgl["structs"]
    for _, path, body in recorded:
        r = routes.get(path)
        if not body or r is None or r.request_class is None:
            continue
        extra = set(body) - structs[r.request_class]
        assert not extra, f"sglang {sgl['version']} {r.request_class} has no field {sorted(extra)} ({path})"
        if path == "/generate":
            assert set(body["sampling_params"]) <= sgl["sampling"], body["sampling_params"]
            assert "return_routed_experts" in structs[r.request_class]


def test_requests_and_double_responses_match_api_types(sgl, recorded, tmp_path):
    api = load_api_types(sgl["whl"], tmp_path, sgl["version"])
    if api is None:
        assert sgl["version"] in NO_API_TYPES  # pinned: this release ships no api_types.py
        return
    assert sgl["version"] not in NO_API_TYPES
    generates = [b for _, p, b in recorded if p == "/generate"]
    assert len(generates) == 4  # one request per sample
    for body in generates:
        api.GenerateRequest.from_json_value(body)
        api.SamplingParams.from_json_value(body["sampling_params"])  # unknown keys rejected
    for _, p, b in recorded:
        if p == "/abort_request":
            api.AbortRequest.from_json_value(b)
    server = srv_http.ServerThread(_EchoEngine(), weight_version="v0", enable_return_routed_experts=True)
    try:
        c = SGLangClient(server.url, timeout_s=10, retries=0)
        for body in generates:
            item = c.request("POST", "/generate", body)
            resp = api.GenerateResponse.from_json_value(item)
            assert resp.meta_info.weight_version == "v0" and len(resp.meta_info.output_token_logprobs) == 2
        api.GetModelInfoResponse.from_json_value(c.request("GET", "/model_info"))
        api.GetServerInfoResponse.from_json_value(c.request("GET", "/server_info"))
        c.pause_generation()  # a paused request aborted by /abort_request: SGLang's abort shape
        import threading

        out: dict = {}
        th = threading.Thread(
            target=lambda: out.update(r=c.request("POST", "/generate", {**body, "rid": "z"}))
        )
        th.start()
        while "z" not in server.app.inflight:
            th.join(0.01)
        c.abort_request("z")
        th.join(10)
        c.continue_generation()
        aborted = api.GenerateResponse.from_json_value(out["r"])
        assert type(aborted.meta_info.finish_reason).__name__ == "FinishAbort" and aborted.output_ids == []
    finally:
        server.stop()


def test_routed_experts_are_accepted_and_base64(sgl):
    whl = sgl["whl"]
    arg_files = [n for n in whl.namelist() if n == SERVER_ARGS or n.startswith("sglang/srt/arg_groups/")]
    # the server option of sglang#12162 (server_args.py in 0.5.11, arg_groups/fields/ in 0.5.23)
    assert any(re.search(r"enable_return_routed_experts\s*:", read(whl, n) or "") for n in arg_files)
    src = read(whl, TOKENIZER_MANAGER)
    block = [m.start() for m in re.finditer(r'meta_info\["routed_experts"\]', src)]
    assert block, "tokenizer_manager no longer fills meta_info['routed_experts']"
    # with --skip-tokenizer-init the tensor bypasses the detokenizer: encoded right there (0.5.11 on)
    assert any("b64encode" in src[max(0, i - 600) : i] for i in block)


def test_the_double_removes_and_guards_what_sglang_does(sgl):
    from moe_rl.serve.app import SGLangProtocolApp

    routes, newest = sgl["routes"], sgl["version"] == TESTED_SGLANG[-1]
    app = SGLangProtocolApp(_EchoEngine())  # the double follows the newest release
    for path in app.routes:
        r = routes.get(path)
        if (r is None and newest) or (r is not None and r.removed):  # gone, or a deprecation 404
            assert app.handle("GET", path, None)[0] == 404, path
    admin = {p for p, r in routes.items() if r.auth and p in app.routes}
    assert admin <= srv_http.ADMIN_PATHS, sorted(admin - srv_http.ADMIN_PATHS)
    if sgl["version"] == TESTED_SGLANG[-1]:
        assert admin == set(srv_http.ADMIN_PATHS) & set(routes)


def test_session_errors_are_sglangs(sgl):
    src = read(sgl["whl"], WEIGHT_UPDATER)
    if SESSION_ENDPOINT not in sgl["routes"]:
        assert src is None or "begin_weight_update" not in src
        return
    strings = {
        n.value for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    for msg in (
        srv_weights.SESSION_ALREADY_OPEN,
        srv_weights.NO_SESSION,
        srv_weights.OUTSIDE_SESSION.format(op="update_weights_from_distributed"),
        srv_weights.OUTSIDE_SESSION.format(op="update_weights_from_tensor"),
    ):
        assert msg in strings, msg


def test_supported_range_is_stated_and_enforced():
    extra = re.search(r"^sglang = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.M)
    assert extra and f'"sglang{SUPPORTED_SGLANG}"' in extra.group(1)  # tomllib is 3.11+ only
    assert SUPPORTED_SGLANG.startswith(f">={TESTED_SGLANG[0]},")
    for v in TESTED_SGLANG:
        assert check_sglang_version(v) == v
    for bad in ("0.5.10", "0.5.4", "0.6.0", "not-a-version"):
        with pytest.raises(SGLangVersionError, match=r"sglang>=0\.5\.11,<0\.6.*12162"):
            check_sglang_version(bad)


def test_memory_tags_are_sglangs(sgl):
    from moe_rl.rollout.sglang_engine import RESUME_ORDER

    tree = ast.parse(read(sgl["whl"], "sglang/srt/constants.py"))
    consts = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
    }
    all_types = next(
        n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "GPU_MEMORY_ALL_TYPES"
    )
    tags = [consts[e.id] for e in all_types.elts]
    assert (
        sorted(tags) == sorted(srv_weights.MEMORY_TAGS) == sorted(t for group in RESUME_ORDER for t in group)
    )
