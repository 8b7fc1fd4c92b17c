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

from moe_rl.dist import host_port
from moe_rl.rollout.sglang_protocol import SGLangError

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


WILDCARD_HOSTS = ("0.0.0.0", "::")
"Bind addresses that mean every interface of the node."


def is_wildcard(host: str) -> bool:
    """True for 0.0.0.0 and :: (every interface)."""
    return host.strip("[]") in WILDCARD_HOSTS


def local_dial(host: str) -> str:
    """Where a client on the same node dials a server bound to ``host``: loopback for a
    wildcard bind (0.0.0.0 -> 127.0.0.1, :: -> ::1), else ``host``."""
    host = host.strip("[]")
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def tcp_url(host: str, port: int) -> str:
    """A ``tcp://`` init method (IPv6-safe: :func:`host_port`)."""
    return f"tcp://{host_port(host, port)}"


def route_address(server_host: str, port: int = 9) -> str | None:
    """The local address the kernel would use to reach ``server_host`` (IPv4 or IPv6; a UDP
    connect sends nothing)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(server_host.strip("[]"), port, type=socket.SOCK_DGRAM)[
            0
        ]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The network interface holding ``address``, IPv4 or IPv6 (None when no local interface has it)."""
    import psutil

    address = address.strip("[]").split("%")[0]
    for name, addrs in psutil.net_if_addrs().items():
        families = (socket.AF_INET, socket.AF_INET6)
        if any(a.family in families and a.address.split("%")[0] == address for a in addrs):
            return name
    return None


@contextlib.contextmanager
def bound_to(local_address: str | None, backend: str) -> Iterator[None]:
    """Make gloo use the interface of ``local_address`` (``GLOO_SOCKET_IFNAME``) while a group is
    created, unless the user already chose one; for NCCL, say when its interface is not that one.

    Without it gloo picks the interface its hostname resolves to, often 127.0.0.1, and a peer on
    another host is told to connect there. NCCL reads ``NCCL_SOCKET_IFNAME`` once per process, at
    its first communicator, so setting it here would do nothing: :func:`pin_nccl_interface` sets
    it at start, before the trainer's first NCCL call.
    """
    ifname = None if not local_address or is_loopback(local_address) else interface_of(local_address)
    if backend == "nccl" and ifname is not None:
        chosen = os.environ.get("NCCL_SOCKET_IFNAME", "")
        if chosen and not any(ifname.startswith(c.lstrip("^=")) for c in chosen.split(",")):
            logger.warning(
                "NCCL_SOCKET_IFNAME=%s does not include %s, the interface of %s that remote SGLang "
                "engines reach this process at: set it (before start) to include %s",
                chosen,
                ifname,
                local_address,
                ifname,
            )
    if backend != "gloo" or ifname is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def pin_nccl_interface(server_hosts: list[str], *, configured: str | None = None) -> str | None:
    """Set ``NCCL_SOCKET_IFNAME`` to the interface remote ``server_hosts`` reach this process at
    (:func:`trainer_address`), unless it is set or every host is local; call it before the first
    NCCL communicator of the process (NCCL reads it once). Returns the interface it set."""
    if os.environ.get("NCCL_SOCKET_IFNAME") or all(is_loopback(h) for h in server_hosts):
        return None
    ifname = interface_of(trainer_address(server_hosts, configured=configured))
    if ifname is not None:
        os.environ["NCCL_SOCKET_IFNAME"] = ifname
        logger.info(
            "NCCL_SOCKET_IFNAME=%s: the interface remote SGLang engines reach this process at", ifname
        )
    return ifname


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
