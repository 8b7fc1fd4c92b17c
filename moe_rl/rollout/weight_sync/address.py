"""The address SGLang servers use to reach the trainer's weight-update rendezvous (TCPStore).

Never loopback when a server is on another host: the recipe's ``rollout.sglang.trainer_address``
wins, then ``$MOE_RL_TRAINER_ADDR`` (set by a launcher), then the local address of the route to
the server (what the kernel would use to reach it), then the Slurm node's address
(``$SLURMD_NODENAME``). Servers all on loopback rendezvous on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Iterator, Mapping

from moe_rl.rollout.sglang_client import SGLangError

logger = logging.getLogger(__name__)


class RendezvousAddressError(SGLangError):
    """No address a remote server can reach the trainer at."""


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (names are resolved)."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def route_address(server_host: str, port: int = 9) -> str | None:
    """The local address the kernel would use to reach ``server_host`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((server_host, port))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The network interface holding ``address`` (None when no local interface has it)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


@contextlib.contextmanager
def bound_to(local_address: str | None, backend: str) -> Iterator[None]:
    """Make gloo (``GLOO_SOCKET_IFNAME``) or NCCL (``NCCL_SOCKET_IFNAME``) use the interface of
    ``local_address`` while a group is created, unless the user already chose one.

    Without it gloo picks the interface its hostname resolves to, often 127.0.0.1, and a peer on
    another host is told to connect there.
    """
    var = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}.get(backend)
    ifname = None if not local_address or is_loopback(local_address) else interface_of(local_address)
    if var is None or ifname is None or os.environ.get(var):
        yield
        return
    os.environ[var] = ifname
    try:
        yield
    finally:
        os.environ.pop(var, None)


def trainer_address(
    server_hosts: list[str], *, configured: str | None = None, env: Mapping[str, str] | None = None
) -> str:
    """Where every server in ``server_hosts`` can reach this process (see the module docstring)."""
    env = os.environ if env is None else env
    remote = [h for h in server_hosts if not is_loopback(h)]
    candidates = [
        ("rollout.sglang.trainer_address", configured),
        ("$MOE_RL_TRAINER_ADDR", env.get("MOE_RL_TRAINER_ADDR")),
    ]
    if remote:
        candidates.append((f"the route to {remote[0]}", route_address(remote[0])))
        node = env.get("SLURMD_NODENAME")
        if node:
            try:
                candidates.append((f"Slurm node {node}", socket.gethostbyname(node)))
            except OSError:
                pass
    else:
        candidates.append(("loopback (every server is local)", "127.0.0.1"))
    for source, addr in candidates:
        if not addr:
            continue
        if remote and is_loopback(addr):
            raise RendezvousAddressError(
                f"{source} gives the loopback address {addr!r} but the SGLang server at {remote[0]} is on "
                f"another host and could never join the weight-update group: set "
                f"rollout.sglang.trainer_address (or $MOE_RL_TRAINER_ADDR) to this node's routable address"
            )
        logger.info("weight-update rendezvous address %s (from %s)", addr, source)
        return addr
    raise RendezvousAddressError(
        f"no routable address of this node reaches {remote}: set rollout.sglang.trainer_address"
    )
