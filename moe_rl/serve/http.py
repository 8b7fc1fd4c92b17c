"""FastAPI + uvicorn around :class:`~moe_rl.serve.app.SGLangProtocolApp` (as SGLang's own server), and ``main``.

``python -m moe_rl.serve.http --engine-factory module:callable [SGLang launch_server options]``.
Every route is one ASGI handler that runs the app's blocking endpoint in a worker thread.
``--api-key`` / ``--admin-api-key`` follow SGLang's ``srt/utils/auth.py``: /health*, /ready and
/metrics are open; the admin endpoints (:data:`ADMIN_PATHS`) need the admin key when one is set,
else the api key; the others need the api key when one is set. Denied: 401 {"error": "Unauthorized"}.
Bodies (:mod:`.limits`): larger than the limit, 413 before they are read; stalled (no byte for
the read timeout, e.g. a ``Content-Length`` larger than what is sent), 408 and the connection
closed; parsed in the worker thread, refusing
NaN and Infinity (400); answers encoded without NaN or Infinity (null instead, logged).
Keep-alive connections close after 5 idle seconds (SGLang's SGLANG_TIMEOUT_KEEP_ALIVE).
(No ``from __future__ import annotations`` here: FastAPI reads the handler's annotations.)
"""

import argparse
import asyncio
import contextlib
import importlib
import logging
import secrets
import signal
import socket
import sys
import threading
from typing import Any

from moe_rl.argparsing import ArgParser, int_at_least, number_in, text_value
from moe_rl.dist import host_port
from moe_rl.errors import Interrupted, StopRequested
from moe_rl.serve.app import SGLangProtocolApp
from moe_rl.serve.limits import FLAGS, ServeLimits, add_limit_args, dumps, limits_from_args, strict_loads
from moe_rl.serve.protocol import error_response
from moe_rl.serve.weights import error_body

logger = logging.getLogger(__name__)

ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/get_weights_by_name",
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
WEIGHTS_BODY_PATHS = frozenset({"/update_weights_from_tensor"})
"Routes whose body carries serialized tensors (``max_weights_body_bytes``)."
TIMEOUT_KEEP_ALIVE_S = 5
"SGLang's SGLANG_TIMEOUT_KEEP_ALIVE default."
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"``--log-level`` values (any case): Python's logging levels, as SGLang's."


class BodyRefused(Exception):
    """A body over its size limit (413) or not received in time (408); ``message`` names the flag."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def read_body(request: Any, route: str, limits: ServeLimits) -> bytes:
    """The request body within ``limits`` (BodyRefused otherwise), read without holding a thread.

    The read timeout is one of inactivity: a body that keeps arriving is read however long it takes."""
    name = "max_weights_body_bytes" if route in WEIGHTS_BODY_PATHS else "max_body_bytes"
    limit, flag = getattr(limits, name), FLAGS[name]
    too_large = "request body of {} bytes exceeds the server's limit of {} bytes ({}): send less per request"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(413, too_large.format(int(declared), limit, flag))
    chunks, size, stream = [], 0, request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), limits.read_timeout_s)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise BodyRefused(
                408,
                f"no request body bytes received for {limits.read_timeout_s:g} s "
                f"({FLAGS['read_timeout_s']}): got {size} of {declared or 'unknown'} bytes; "
                "send a body as long as its Content-Length",
            ) from None
        size += len(chunk)
        if size > limit:
            raise BodyRefused(413, too_large.format(f"at least {size}", limit, flag))
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes) -> tuple[Any, dict | None]:
    """(JSON body or None, None) or (None, the 400 error body)."""
    if not raw.strip():
        return None, None
    try:
        return strict_loads(raw), None
    except (ValueError, RecursionError) as e:
        return None, error_response(f"body: invalid JSON ({e})")


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
    """The FastAPI application serving ``app`` (its limits: ``app.limits``)."""
    import anyio.to_thread
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect

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
        try:
            raw = await read_body(request, route, app.limits)
        except BodyRefused as e:
            logger.warning("%s %s refused (%d): %s", request.method, route, e.status, e.message)
            headers = {"Connection": "close"}
            return Response(dumps(error_body(e.message)), e.status, headers, "application/json")
        except ClientDisconnect:
            return Response(status_code=400)
        status, payload = await anyio.to_thread.run_sync(handle, request.method, route, raw)
        if payload is None:
            return Response(status_code=status)
        if isinstance(payload, str):
            return Response(payload, status_code=status, media_type="text/plain; charset=utf-8")
        return Response(payload, status_code=status, media_type="application/json")

    def handle(method: str, route: str, raw: bytes) -> tuple[int, bytes | str | None]:
        body, bad = parse_body(raw)
        status, payload = (400, bad) if bad is not None else app.handle(method, route, body)
        return status, (payload if payload is None or isinstance(payload, str) else dumps(payload, route))

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
            timeout_keep_alive=TIMEOUT_KEEP_ALIVE_S,
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
        return f"http://{host_port(self.host, self.port)}"

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
    """Serve until SIGTERM, SIGINT or SIGHUP (a closed terminal), then close the engine and end
    with :class:`~moe_rl.errors.StopRequested` (one line, exit 128 + the signal). uvicorn shuts
    down on SIGTERM / SIGINT (answering the requests in flight, ``timeout_graceful_shutdown``) and
    raises the signal again as it returns; SIGHUP is given the same shutdown here."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1") and not (api_key or admin_api_key):
        logger.warning("moe-rl serve binds %s without --api-key: the weight-update endpoints are open", host)
    app = SGLangProtocolApp(engine, **app_kwargs)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(app, api_key=api_key, admin_api_key=admin_api_key),
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=TIMEOUT_KEEP_ALIVE_S,
        )
    )
    hup: list[int] = []

    def hangup(signum, frame) -> None:
        hup.append(signum)
        server.handle_exit(signal.SIGTERM, frame)

    main_thread = threading.current_thread() is threading.main_thread()
    old_hup = signal.signal(signal.SIGHUP, hangup) if main_thread else None
    logger.info("moe-rl serve listening on http://%s:%d", host, port)
    try:
        server.run()
    except Interrupted as e:  # uvicorn raised the SIGTERM / SIGINT it shut down on again
        hup.append(e.signum)
    finally:
        if main_thread:
            signal.signal(signal.SIGHUP, old_hup)
        logger.info("moe-rl serve shut down")
        if hasattr(engine, "close"):
            engine.close()
    if hup:
        name = signal.Signals(hup[0]).name
        raise StopRequested(
            hup[0], f"{name} received: moe-rl serve shut down (requests in flight were answered)"
        )


def build_arg_parser() -> argparse.ArgumentParser:
    """The ``moe-rl serve`` command line: the ``sglang.launch_server`` options the launcher passes, plus ours."""
    p = ArgParser("moe-rl serve", description="SGLang-protocol server around a moe-rl rollout engine")
    p.add_argument("--model-path", default="moe-rl-embedded", type=text_value)
    p.add_argument("--host", default="127.0.0.1", type=text_value)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tp", type=int, default=1)
    p.add_argument("--ep-size", "--ep", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="weights and compute: auto (fp32) | bfloat16 | float16")
    p.add_argument("--router-dtype", default="same", choices=("same", "fp32"), help="router logits' dtype")
    p.add_argument("--mem-fraction-static", type=number_in(0.0, 1.0), default=None)
    p.add_argument("--base-gpu-id", type=int_at_least(0), default=0)
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="token ids only, as SGLang: no text in /generate, no /v1 completions",
    )
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--weight-version", default="default", type=text_value)
    p.add_argument("--api-key", default=None, type=text_value)
    p.add_argument("--admin-api-key", default=None, type=text_value)
    p.add_argument(
        "--engine-factory",
        default=None,
        type=text_value,
        help="module:callable taking the parsed args and returning the engine",
    )
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="as SGLang's")
    add_limit_args(p)
    return p


def check_args(args: argparse.Namespace) -> ServeLimits:
    """The limits of ``args``, after checking them and that ``--host``/``--port`` can be listened on
    (before the engine is built); ConfigError names the flag."""
    from moe_rl.config import ConfigError

    try:
        limits = limits_from_args(args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: expected 0..65535 (SGLang's default is 30000)")
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((args.host, args.port))
    except OSError as e:
        raise ConfigError(
            f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e}); "
            "pick a free port or an address of this machine"
        ) from None
    return limits


def main(argv: list[str] | None = None, factory: Any = None, check: Any = None) -> int:
    """CLI entry: parse SGLang-style args, build the engine with ``factory(args)``, serve.

    The engine's ``tokenizer`` attribute, when it has one, is the server's tokenizer (text and
    the OpenAI endpoints) unless ``--skip-tokenizer-init``."""
    args, unknown = build_arg_parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if unknown:
        logger.warning("ignoring SGLang options moe-rl serve does not use: %s", " ".join(unknown))
    limits = check_args(args)
    if check is not None:  # the factory's own flags (e.g. the embedded engine's TP and dtype), before it runs
        check(args)
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
        limits=limits,
        tokenizer=None if args.skip_tokenizer_init else getattr(engine, "tokenizer", None),
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
