"""Launch (or attach to) ``sglang-router`` in front of several SGLang engines.

The router is the PyPI package ``sglang-router`` (a Rust binary; runs on CPU):
``python -m sglang_router.launch_router --host H --port P --worker-urls U1 U2 ... --policy POLICY``.
It balances ``/generate`` across the engines (``cache_aware`` keeps a prompt's samples on one
engine's prefix cache) but does not forward control calls (``/abort_request`` answers 404), so
weight pushes, aborts and memory calls go to each engine directly. It rebuilds the /generate body
from its own struct and drops ``return_routed_experts``; see :mod:`moe_rl.rollout.sglang_engine`.
The process runs in its own session and is stopped by its process-group id (its PID), never by name.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from moe_rl.dist import free_port, host_port
from moe_rl.rollout.session_process import SessionProcess
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_protocol import SGLangError

logger = logging.getLogger(__name__)

ROUTER_VERSION = "0.3.2"
"The sglang-router release moe-rl pins (pyproject.toml) and tests against."


class RouterLaunchError(SGLangError):
    """The router exited or never answered /health; the message has its log tail."""


def router_command(
    worker_urls: list[str],
    *,
    host: str = "127.0.0.1",
    port: int,
    policy: str = "cache_aware",
    api_key: str | None = None,
    python: str = sys.executable,
    request_timeout_s: float | None = None,
) -> list[str]:
    """argv of ``sglang_router.launch_router`` for these workers."""
    cmd = [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port)]
    cmd += ["--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn"]
    # its Prometheus exporter binds a fixed port by default: a second router on the node would die
    cmd += ["--prometheus-host", host, "--prometheus-port", str(free_port(host))]
    if api_key:
        cmd += ["--api-key", api_key]
    if request_timeout_s:
        cmd += ["--request-timeout-secs", str(int(request_timeout_s))]
    return cmd


class SGLangRouterLauncher(SessionProcess):
    """Owns one sglang-router process: ``start()`` waits for /health, ``stop()`` ends it by PID."""

    kind = "sglang-router"
    stop_grace_s = 10.0

    def __init__(
        self,
        worker_urls: list[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = "cache_aware",
        api_key: str | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 120.0,
        request_timeout_s: float | None = None,
    ):
        self.worker_urls, self.host, self.port = list(worker_urls), host, port or free_port(host)
        self.policy, self.api_key, self.startup_timeout_s = policy, api_key, startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.log_path = Path(log_path) if log_path else Path.cwd() / f"sglang-router-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://{host_port(self.host, self.port)}"

    def start(self) -> SGLangClient:
        """Launch and wait until /health answers 200; return a client for the router."""
        cmd = router_command(
            self.worker_urls,
            host=self.host,
            port=self.port,
            policy=self.policy,
            api_key=self.api_key,
            request_timeout_s=self.request_timeout_s,
        )
        self._launch(cmd, self.log_path)
        try:
            return self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> SGLangClient:
        probe = SGLangClient(self.url, timeout_s=5.0, retries=0, api_key=self.api_key)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RouterLaunchError(f"sglang-router exited with {self.proc.returncode}: {self._tail()}")
            try:
                if probe.health():
                    return SGLangClient(self.url, api_key=self.api_key)
            except SGLangError:
                pass
            time.sleep(0.2)
        raise RouterLaunchError(
            f"sglang-router at {self.url} not healthy after {self.startup_timeout_s} s: {self._tail()}"
        )

    def _tail(self, n: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class Fleet:
    """Everything the factory launched (engines, then the router): ``stop()`` stops it all."""

    def __init__(self, launchers: list, router: SGLangRouterLauncher | None = None):
        self.launchers, self.router = launchers, router

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for launcher in self.launchers:
            launcher.stop()
