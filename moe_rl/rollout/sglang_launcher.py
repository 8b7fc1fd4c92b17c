"""Start, wait for, and stop SGLang servers and sglang-router; or attach to running ones.

The command is ``<python> -m <module> --model-path ... --host <host> --port ...`` with the
module ``sglang.launch_server`` by default; ``host`` is what the server binds (127.0.0.1, a node
address, or all interfaces) and ``advertise_host`` what clients dial (the choice across nodes:
:func:`moe_rl.rollout.factory.engine_address`). The server does not inherit the launching trainer
rank's torchrun variables (:func:`server_environ`). Option names are SGLang's ServerArgs
(sgl-project/sglang ``python/sglang/srt/server_args.py``): ``--tp-size``, ``--ep-size``,
``--mem-fraction-static``, ``--dtype``, ``--skip-tokenizer-init``,
``--enable-return-routed-experts``, ``--enable-memory-saver``, ``--enable-weights-cpu-backup``, ``--weight-version`` (initial ``weight_version``, default
"default") and ``--enable-deterministic-inference`` (needed for ``sampling_seed`` to make
non-greedy sampling reproducible). Tests point ``python``/``module`` at ``moe_rl.serve.http``
to launch ``moe-rl serve`` through the same code path.

Placement: ``gpu_ids`` becomes the server's ``CUDA_VISIBLE_DEVICES`` (and ``--base-gpu-id 0``), so
engine ``i`` of a recipe gets ``rollout.sglang.gpus[i*tp:(i+1)*tp]`` (:func:`plan_gpus`) and never
the trainer's devices unless colocated (``--enable-memory-saver``). Launching ``sglang.launch_server``
first checks the installed SGLang against ``SUPPORTED_SGLANG``.

The process is started in its own session, so stopping it signals exactly the process group
whose id is the PID we started: SIGTERM, then SIGKILL after a grace period. Never by name.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from moe_rl.dist import free_port, host_port
from moe_rl.rollout.session_process import SessionProcess
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_protocol import (
    SGLangError,
    SGLangHTTPError,
    SGLangUnavailable,
    check_sglang_version,
)
from moe_rl.rollout.weight_sync.address import local_dial

logger = logging.getLogger(__name__)


class SGLangLaunchError(SGLangError):
    """The server process exited or never became healthy; the message has its log tail."""


@dataclass(frozen=True, kw_only=True)
class SGLangServerConfig:
    """How to launch one SGLang server."""

    model_path: str
    "Local HF checkpoint directory the server loads."
    tp_size: int = 1
    "Tensor-parallel size (GPUs per server)."
    ep_size: int = 1
    "Expert-parallel size."
    host: str = "127.0.0.1"
    "Bind address: 127.0.0.1 (this node only), a routable address of the node, or 0.0.0.0 / :: (all)."
    advertise_host: str | None = None
    "Address clients dial, in :attr:`SGLangLauncher.url` (None: ``host``; for 0.0.0.0 / ::, loopback)."
    port: int | None = None
    "HTTP port (None: a free one)."
    enable_return_routed_experts: bool = False
    "Return routed experts (needed for R3 routing replay)."
    mem_fraction_static: float | None = None
    "Fraction of GPU memory for weights + KV cache (None: SGLang's default)."
    dtype: str = "auto"
    "Weight/compute dtype (auto, bfloat16, float16, float32)."
    skip_tokenizer_init: bool = True
    "Token ids in and out (the trainer tokenizes)."
    weight_version: str | None = None
    "Initial weight_version (None: SGLang's 'default')."
    enable_deterministic_inference: bool = False
    "Batch-invariant kernels; makes sampling_seed reproducible for non-greedy sampling."
    gpu_ids: tuple[int, ...] | None = None
    "GPUs of this server: its CUDA_VISIBLE_DEVICES, with --base-gpu-id 0 (None: inherit the environment)."
    enable_memory_saver: bool = False
    "--enable-memory-saver: colocated mode, memory released and resumed around training."
    enable_weights_cpu_backup: bool = False
    "--enable-weights-cpu-backup: released weights wait in host memory (SGLang frees them without it)."
    api_key: str | None = None
    "--api-key (every endpoint but /health*)."
    admin_api_key: str | None = None
    "--admin-api-key (weight updates, pause, abort, memory)."
    extra_args: tuple[str, ...] = ()
    "More command-line options, passed as is."
    python: str = sys.executable
    "Python executable that runs the server."
    module: str = "sglang.launch_server"
    "Module run with -m (tests use moe_rl.serve.http)."

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1:
            raise ValueError(f"sglang tp_size={self.tp_size}, ep_size={self.ep_size}: both must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"sglang mem_fraction_static={self.mem_fraction_static}: use a value in (0, 1)")
        if self.gpu_ids is not None and len(self.gpu_ids) != self.tp_size:
            raise ValueError(f"sglang gpu_ids={list(self.gpu_ids)}: give exactly tp_size={self.tp_size} GPUs")

    @property
    def dial_host(self) -> str:
        """The address in the server's URL: ``advertise_host``, else ``host`` (loopback for all interfaces)."""
        return self.advertise_host or local_dial(self.host)

    def env(self) -> dict[str, str]:
        """Environment the server process gets on top of ours (its device mask)."""
        return {} if self.gpu_ids is None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpu_ids))}


def plan_gpus(gpus: list[int], engines: int, tp: int) -> list[tuple[int, ...]]:
    """Engine ``i`` gets ``gpus[i*tp:(i+1)*tp]``; ValueError when there are too few or repeats."""
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"rollout.sglang.gpus={gpus} names a GPU twice")
    if len(gpus) < engines * tp:
        raise ValueError(
            f"rollout.sglang.gpus={gpus}: {engines} engines x tp {tp} need {engines * tp} GPUs, got {len(gpus)}"
        )
    return [tuple(gpus[i * tp : (i + 1) * tp]) for i in range(engines)]


def check_disjoint(rollout_gpus: list[int], trainer_gpus: list[int]) -> None:
    """Rollout engines must not land on the trainer's devices (unless colocated)."""
    shared = sorted(set(rollout_gpus) & set(trainer_gpus))
    if shared:
        raise ValueError(
            f"rollout.sglang.gpus={rollout_gpus} overlaps the trainer's GPUs {trainer_gpus} at {shared}: "
            f"give the engines other GPUs, or set rollout.sglang.colocate=true (memory saver)"
        )


def build_command(cfg: SGLangServerConfig, port: int) -> list[str]:
    """The argv that launches the server described by ``cfg`` on ``port``."""
    cmd = [
        cfg.python,
        "-m",
        cfg.module,
        "--model-path",
        str(cfg.model_path),
        "--tp-size",
        str(cfg.tp_size),
        "--ep-size",
        str(cfg.ep_size),
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--dtype",
        cfg.dtype,
    ]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if cfg.enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if cfg.enable_deterministic_inference:
        cmd.append("--enable-deterministic-inference")
    if cfg.weight_version is not None:
        cmd += ["--weight-version", cfg.weight_version]
    if cfg.gpu_ids is not None:
        cmd += ["--base-gpu-id", "0"]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.enable_weights_cpu_backup:
        cmd.append("--enable-weights-cpu-backup")
    if cfg.api_key:
        cmd += ["--api-key", cfg.api_key]
    if cfg.admin_api_key:
        cmd += ["--admin-api-key", cfg.admin_api_key]
    return cmd + list(cfg.extra_args)


def installed_sglang_version(python: str) -> str | None:
    """The sglang version ``python`` would import (None when it has none)."""
    if python == sys.executable:
        try:
            return version("sglang")
        except PackageNotFoundError:
            return None
    code = "import importlib.metadata as m\ntry: print(m.version('sglang'))\nexcept Exception: print('')"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or None


TRAINER_PROCESS_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"torchrun's variables of the trainer process that launched a server: not the server's."


def server_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a launched server inherits: ours without the launching trainer rank's
    torchrun variables (:data:`TRAINER_PROCESS_VARS`, ``TORCHELASTIC_*``), which would make the
    server take itself for a rank of the trainer's world (a world of 2 for a one-process server)."""
    environ = dict(os.environ if environ is None else environ)
    return {
        k: v
        for k, v in environ.items()
        if k not in TRAINER_PROCESS_VARS and not k.startswith("TORCHELASTIC_")
    }


def _log_tail(path: Path | None, n: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


class SGLangLauncher(SessionProcess):
    """Owns one server process: ``start()`` waits on /health_generate, ``stop()`` ends it by PID."""

    def __init__(
        self,
        cfg: SGLangServerConfig,
        *,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 900.0,
        poll_s: float = 0.5,
    ):
        self.cfg, self.env = cfg, env
        self.port = cfg.port or free_port(cfg.host)
        self.log_path = Path(log_path) if log_path else Path.cwd() / f"sglang-{self.port}.log"
        self.startup_timeout_s, self.poll_s = startup_timeout_s, poll_s

    @property
    def url(self) -> str:
        return f"http://{host_port(self.cfg.dial_host, self.port)}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def client(self, **kwargs: Any) -> SGLangClient:
        """A client for this server (with its keys)."""
        kwargs.setdefault("api_key", self.cfg.admin_api_key or self.cfg.api_key)
        return SGLangClient(self.url, **kwargs)

    def start(self) -> SGLangClient:
        """Launch, wait until /health_generate answers 200, return a client.

        A port this launcher picked (no ``port`` configured) can be taken by another socket between
        the pick and the server's bind (``free_port`` is a guess): a server that exits with "address
        already in use" is relaunched on a newly picked port, twice at most."""
        for attempt in range(3):
            try:
                return self._start_once()
            except SGLangLaunchError as e:
                if self.cfg.port or attempt == 2 or "address already in use" not in str(e).lower():
                    raise
                self.proc = None
                logger.warning("port %d was taken before the server bound it: picking another", self.port)
                self.port = free_port(self.cfg.host)
        raise AssertionError("unreachable")

    def _start_once(self) -> SGLangClient:
        if self.proc is not None:
            raise SGLangLaunchError(f"server {self.url} already started (pid {self.pid})")
        if self.cfg.module.startswith("sglang."):
            version = installed_sglang_version(self.cfg.python)
            if version is None:
                check_sglang_version(None)  # raises: not installed
            check_sglang_version(version)
        cmd = build_command(self.cfg, self.port)
        self._launch(cmd, self.log_path, env={**server_environ(), **self.cfg.env(), **(self.env or {})})
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self) -> SGLangClient:
        """Poll /health_generate until 200, the process exits, or the startup deadline passes.

        Each probe's timeout doubles from 2 s to 30 s (a loaded server's first generation can take
        seconds): between probes the process is checked. A socket of another program on the port
        (it took the port before the server bound it) accepts the probe and never answers: with one
        30 s probe, the server's "address already in use" exit was seen only after it (32 s in
        tests/integration/test_sglang_e2e.py's taken-port test)."""
        client = self.client(timeout_s=30.0, retries=0)
        t0 = time.monotonic()
        deadline = t0 + self.startup_timeout_s
        probe_s = 2.0
        while True:
            code = self.proc.poll() if self.proc is not None else None
            if code is not None:
                raise SGLangLaunchError(
                    f"server {self.url} (pid {self.pid}) exited with code {code} "
                    f"before becoming healthy; log {self.log_path}:\n"
                    f"{_log_tail(self.log_path)}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SGLangLaunchError(
                    f"server {self.url} (pid {self.pid}) not healthy after "
                    f"{self.startup_timeout_s:.0f} s; log {self.log_path}:\n"
                    f"{_log_tail(self.log_path)}"
                )
            try:
                if client.health_generate(timeout_s=min(probe_s, max(remaining, 0.1))):
                    logger.info("server %s healthy after %.1f s", self.url, time.monotonic() - t0)
                    return self.client()
            except (SGLangUnavailable, SGLangHTTPError):
                pass
            probe_s = min(2 * probe_s, 30.0)
            time.sleep(self.poll_s)

    def __enter__(self) -> SGLangLauncher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def attach(url: str, *, timeout_s: float = 60.0, poll_s: float = 1.0, **client_kwargs: Any) -> SGLangClient:
    """Use a server someone else started: wait until /health_generate answers, return a client."""
    probe = SGLangClient(url, timeout_s=min(30.0, timeout_s), retries=0, api_key=client_kwargs.get("api_key"))
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if probe.health_generate():
                return SGLangClient(url, **client_kwargs)
        except (SGLangUnavailable, SGLangHTTPError) as e:
            last = e
        time.sleep(poll_s)
    raise SGLangUnavailable(f"no healthy SGLang server at {url} after {timeout_s:.0f} s: {last}")
