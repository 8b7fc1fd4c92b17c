"""Cross-host weight sync: the server in one network namespace, the trainer in another.

Two namespaces made for this test, joined by a veth pair with private addresses only they use
(192.168.77.1 server, 192.168.77.2 trainer). ``moe-rl serve`` binds 192.168.77.1; the trainer
finds its rendezvous address from the route to the server (never loopback), forms the gloo
group across the namespaces, pushes weights, and the server reports the new version and
generates with them. Needs root and ``ip netns`` (CI runs as root); the namespaces are deleted
even when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.dist import free_port

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SERVER_IP, TRAINER_IP = "192.168.77.1", "192.168.77.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs .ci/run as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2; .ci/run installs it)"
    probe = f"mrl-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` is not permitted here: {getattr(e, 'stderr', e)}"
    _ip("netns", "del", probe)
    return None


def stop_group(proc: subprocess.Popen) -> None:
    """End a process this test started: its group (id = its PID, never a name), SIGTERM then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


IFNAME = "mrl0"
"Each namespace's interface (the node's NIC) on the bridge."


@contextlib.contextmanager
def bridged_namespaces(nodes: dict[str, str]):
    """One network namespace per ``nodes`` entry (name -> address in 192.168.77.0/24), each with
    interface ``IFNAME`` on one bridge held in a further namespace; yields name -> namespace.
    Skips without root or ``ip netns``; every namespace is deleted whatever happens."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 100000
    sw = f"mrl-sw-{tag}"
    spaces = {name: (f"mrl-{name[:6]}-{tag}", addr) for name, addr in nodes.items()}
    made: list[str] = []
    try:
        for ns in (sw, *(ns for ns, _ in spaces.values())):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(spaces.values()):  # made inside the switch: no host names
            _ip("-n", sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", IFNAME)
            _ip("-n", sw, "link", "set", IFNAME, "netns", ns)
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {name: ns for name, (ns, _) in spaces.items()}
    finally:
        for ns in made:  # deleting a namespace deletes its ends of the veth pairs, and the bridge
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture
def namespaces():
    with bridged_namespaces({"server": SERVER_IP, "trainer": TRAINER_IP}) as ns:
        yield ns["server"], ns["trainer"]


def test_weight_sync_across_network_namespaces(namespaces, tmp_path):
    srv, trn = namespaces
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "integration"), str(REPO)])}
    env.pop("MOE_RL_TRAINER_ADDR", None)
    port = free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        ["ip", "netns", "exec", srv, sys.executable, "-m", "moe_rl.serve.http", "--host", SERVER_IP,
         "--port", str(port), "--weight-version", "v0", "--enable-return-routed-experts",
         "--engine-factory", "test_sglang_e2e:make_engine"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        out = subprocess.run(
            ["ip", "netns", "exec", trn, sys.executable, str(HERE / "sglang_netns_trainer.py"),
             f"http://{SERVER_IP}:{port}"],
            capture_output=True, text=True, env={**env, "PYTHONPATH": env["PYTHONPATH"] + os.pathsep + str(HERE)},
            timeout=240,
        )  # fmt: skip
        assert out.returncode == 0, (
            out.stdout[-3000:] + out.stderr[-3000:] + (tmp_path / "server.log").read_text()
        )
        found = json.loads(out.stdout.strip().splitlines()[-1])
        assert found["master_address"] == TRAINER_IP  # routable, not loopback
        assert found["served"] == "v1" and found["max_err"] < 1e-4
    finally:
        stop_group(server)
        log.close()
