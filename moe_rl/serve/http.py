"""FastAPI + uvicorn around :class:`~moe_rl.serve.app.SGLangProtocolApp` (as SGLang's own server), and ``main``.

``python -m moe_rl.serve.http --engine-factory module:callable [SGLang launch_server options]``.
Every route is one ASGI handler that runs the app's blocking endpoint in a worker thread.
``--api-key`` / ``--admin-api-key`` follow SGLang's ``srt/utils/auth.py``: /health*, /ready and
/metrics are open; the admin endpoints (:data:`ADMIN_PATHS`) need the admin key when one is set,
else the api key; the others need the api key when one is set. Denied: 401 {"error": "Unauthorized"}.
(No ``from __future__ import annotations`` here: FastAPI reads the handler's annotations.)
"""

import argparse
import contextlib
import importlib
import json
import logging
import secrets
import sys
import threading
from typing import Any

from moe_rl.serve.app import SGLangProtocolApp
from moe_rl.serve.protocol import error_response

logger = logging.getLogger(__name__)

ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_tensor",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_distributed",
        "/update_weight_version",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
    }
)
"Endpoints SGLang marks ``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` that moe-rl serve has (pinned by the wheel tests)."
OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def authorized(path: str, header: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """SGLang's decide_request_auth for the two levels moe-rl serve uses."""
    if path.startswith(OPEN_PREFIXES):
        return True
    key = (admin_api_key or api_key) if path in ADMIN_PATHS else api_key
    if not key:
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token, key)


def create_app(app: SGLangProtocolApp, *, api_key: str | None = None, admin_api_key: str | None = None):
    """The FastAPI application serving ``app``."""
    import anyio.to_thread
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    @contextlib.asynccontextmanager
    async def lifespan(_: Any):
        # weight updates and waiting requests each hold a worker thread: allow many
        anyio.to_thread.current_default_thread_limiter().total_tokens = 512
        yield

    api = FastAPI(title="moe-rl serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT"])
    async def dispatch(path: str, request: Request) -> Response:
        route = "/" + path
        if not authorized(route, request.headers.get("Authorization"), api_key, admin_api_key):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError as e:
            return JSONResponse(error_response(f"body: invalid JSON ({e})"), status_code=400)
        status, payload = await anyio.to_thread.run_sync(app.handle, request.method, route, body)
        if payload is None:
            return Response(status_code=status)
        if isinstance(payload, str):
            return Response(payload, status_code=status, media_type="text/plain; charset=utf-8")
        return JSONResponse(payload, status_code=status)

    return api


class ServerThread:
    """uvicorn serving ``engine`` in a background thread (tests, benchmarks): ``url``, ``stop()``."""

    def __init__(
        self,
        engine: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_key=None,
        admin_api_key=None,
        **app_kwargs: Any,
    ):
        import uvicorn

        self.app = SGLangProtocolApp(engine, **app_kwargs)
        config = uvicorn.Config(
            create_app(self.app, api_key=api_key, admin_api_key=admin_api_key),
            host=host,
            port=port,
            log_level="warning",
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="moe-rl-serve", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"moe-rl serve could not start on {host}:{port}")
            threading.Event().wait(0.01)
        sock = self.server.servers[0].sockets[0].getsockname()
        self.host, self.port = host, sock[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    api_key=None,
    admin_api_key=None,
    **app_kwargs: Any,
) -> None:
    """Serve until SIGTERM/SIGINT (uvicorn handles both), then close the engine."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1") and not (api_key or admin_api_key):
        logger.warning("moe-rl serve binds %s without --api-key: the weight-update endpoints are open", host)
    app = SGLangProtocolApp(engine, **app_kwargs)
    logger.info("moe-rl serve listening on http://%s:%d", host, port)
    try:
        uvicorn.run(
            create_app(app, api_key=api_key, admin_api_key=admin_api_key),
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    finally:
        logger.info("moe-rl serve shut down")
        if hasattr(engine, "close"):
            engine.close()


def build_arg_parser() -> argparse.ArgumentParser:
    """The ``moe-rl serve`` command line: the ``sglang.launch_server`` options the launcher passes, plus ours."""
    p = argparse.ArgumentParser(
        "moe-rl serve", description="SGLang-protocol server around a moe-rl rollout engine"
    )
    p.add_argument("--model-path", default="moe-rl-embedded")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tp", type=int, default=1)
    p.add_argument("--ep-size", "--ep", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="weights and compute: auto (fp32) | bfloat16 | float16")
    p.add_argument("--router-dtype", default="same", choices=("same", "fp32"), help="router logits' dtype")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-api-key", default=None)
    p.add_argument(
        "--engine-factory",
        default=None,
        help="module:callable taking the parsed args and returning the engine",
    )
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None, factory: Any = None) -> int:
    """CLI entry: parse SGLang-style args, build the engine with ``factory(args)``, serve."""
    args, unknown = build_arg_parser().parse_known_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if unknown:
        logger.warning("ignoring SGLang options moe-rl serve does not use: %s", " ".join(unknown))
    if factory is None:
        if not args.engine_factory or ":" not in args.engine_factory:
            logger.error("moe-rl serve: --engine-factory module:callable is required")
            return 2
        mod, _, attr = args.engine_factory.partition(":")
        factory = getattr(importlib.import_module(mod), attr)
    engine = factory(args)
    serve(
        engine,
        args.host,
        args.port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        model_path=args.model_path,
        weight_version=args.weight_version,
        enable_return_routed_experts=args.enable_return_routed_experts,
        enable_memory_saver=args.enable_memory_saver,
        server_args={
            "tp_size": args.tp_size,
            "ep_size": args.ep_size,
            "dtype": args.dtype,
            "host": args.host,
            "port": args.port,
            "base_gpu_id": args.base_gpu_id,
            "enable_deterministic_inference": args.enable_deterministic_inference,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
