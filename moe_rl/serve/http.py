"""The standard-library HTTP server around :class:`~moe_rl.serve.app.SGLangProtocolApp`, and ``main``.

``python -m moe_rl.serve.http --engine-factory module:callable [SGLang launch_server options]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from moe_rl.serve.app import SGLangProtocolApp
from moe_rl.serve.protocol import error_response

logger = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    server_version = "moe-rl-serve"

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError as e:
            status, payload = 400, error_response(f"body: invalid JSON ({e})")
        else:
            status, payload = self.server.app.handle(method, self.path, body)
        if payload is None:
            data, ctype = b"", "text/plain"
        elif isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            logger.info("client went away before %s %s was answered", method, self.path)

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("%s - %s", self.address_string(), fmt % args)


def make_server(
    engine: Any, host: str = "127.0.0.1", port: int = 30000, **app_kwargs: Any
) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer speaking SGLang's protocol around ``engine`` (not yet serving)."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("moe-rl serve binds %s: the weight-update endpoints are unauthenticated", host)
    httpd = ThreadingHTTPServer((host, port), _Handler)
    httpd.daemon_threads = True
    httpd.app = SGLangProtocolApp(engine, **app_kwargs)
    return httpd


def serve(engine: Any, host: str = "127.0.0.1", port: int = 30000, **app_kwargs: Any) -> None:
    """Serve until SIGTERM/SIGINT, then close the engine."""
    httpd = make_server(engine, host, port, **app_kwargs)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
    logger.info("moe-rl serve listening on http://%s:%d", host, httpd.server_address[1])
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        logger.info("moe-rl serve shutting down")
    finally:
        httpd.server_close()
        if hasattr(engine, "close"):
            engine.close()


def build_arg_parser() -> argparse.ArgumentParser:
    """The subset of ``python -m sglang.launch_server`` options the launcher passes, plus ours."""
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
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--weight-version", default="default")
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
            print("moe-rl serve: --engine-factory module:callable is required", file=sys.stderr)
            return 2
        mod, _, attr = args.engine_factory.partition(":")
        factory = getattr(importlib.import_module(mod), attr)
    engine = factory(args)
    serve(
        engine,
        args.host,
        args.port,
        model_path=args.model_path,
        weight_version=args.weight_version,
        enable_return_routed_experts=args.enable_return_routed_experts,
        server_args={
            "tp_size": args.tp_size,
            "ep_size": args.ep_size,
            "dtype": args.dtype,
            "host": args.host,
            "port": args.port,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
