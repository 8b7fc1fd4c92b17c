"""What every test shares: the environment, the world-of-one parallel state, the tiny policy and
runs (``tiny_policy``, ``tiny_run``), CUDA skips, and the fast tier's rule.

Tiers by cost: ``make test-fast`` is ``pytest -m "not integration" tests/unit tests/badinput``,
``make test-integration`` is ``pytest -m "integration and not nightly" tests``, ``make test-nightly``
the ``nightly`` marker's exhaustive loops; each on pytest-xdist workers (the Makefile's ``JOBS``). Every test under
:data:`INTEGRATION` carries the ``integration`` marker (added here); a test of a fast folder that
must start a child process carries it by hand (``@pytest.mark.integration``). A fast test starts no
child process: one that runs a moe-rl command, a fresh interpreter, torchrun or a server fails,
naming the marker and tests/integration. What the library starts for itself (megatron-core's
checkpoint writer queue, multiprocessing's helpers) and ``git``, ``mount`` and ``umount`` are not
children it counts.
"""

import os
import subprocess
import warnings
from pathlib import Path

import pytest

XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if XDIST_WORKER:
    # a worker of `pytest -n N` (the Makefile's tiers): N workers share N cores, so each runs its
    # in-process models, and the children it starts, on one intra-op thread. Two threads per worker
    # oversubscribe the cores and OpenMP's waiting threads spin: the integration tests of signals,
    # RL end to end and the device boundary took 273 CPU-seconds so, 156 on one thread.
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402 (after the thread count it reads)

import moe_rl.megatron  # noqa: E402,F401 (before megatron-core: its import-time compile deferred)

if XDIST_WORKER:
    torch.set_num_threads(1)  # in case torch was imported before this file
os.environ.setdefault("PYTHONWARNINGS", "ignore")
if not torch.cuda.is_available():
    # Triton reads this once, at its first import (megatron-core imports triton too): on CPU the
    # kernels run in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", module="megatron")


@pytest.fixture(scope="session")
def parallel_info():
    """A world-of-one megatron-core parallel state shared by in-process tests."""
    from megatron.core import parallel_state as ps

    from moe_rl.config import ParallelConfig
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.parallel import parallel_info as current

    if ps.model_parallel_is_initialized():
        return current()
    return init_parallel(ParallelConfig(), seed=1)


@pytest.fixture
def tiny_model_cfg():
    from tests.tiny import tiny_model_config

    return tiny_model_config()


@pytest.fixture
def tiny_policy(parallel_info, tiny_model_cfg):
    """A fresh tiny policy (tests/tiny.py: hidden 64, 2 layers, 4 experts top-2) in the world of one."""
    from moe_rl.config import ParallelConfig
    from moe_rl.megatron.policy import build_policy

    return build_policy(tiny_model_cfg, ParallelConfig(), parallel_info)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after): the tiny policy's ops are too small to
    share, and on a loaded 2-core machine two threads per op mostly wait for each other (the ragged
    batches' tests: 98 CPU-seconds with two, 10.6 with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_run(tmp_path, parallel_info):
    """Trainer Runs of the tiny recipe, ready for one stage's steps and closed when the test ends:
    ``tiny_run(name="run", base=TINY_E2E, stage="rl", **sections)`` (``tests.tiny.ready_run``)."""
    from tests.tiny import ready_run

    made = []

    def make(name: str = "run", **kw):
        made.append(ready_run(tmp_path / name, **kw))
        return made[-1]

    yield make
    for run in reversed(made):
        run.close()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(Path(item.path).resolve().is_relative_to(ROOT / d) for d in INTEGRATION):
            item.add_marker(pytest.mark.integration)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath) or item.get_closest_marker("gpu"):
            item.add_marker(skip)


ROOT = Path(__file__).resolve().parent
FAST_TIER = ("tests/unit", "tests/badinput")
"The fast tier's folders (``make test-fast``): no child processes (module docstring)."
INTEGRATION = ("tests/integration", "tests/dist")
"Folders whose every test is an integration test (``make test-integration``)."
ALLOWED_CHILDREN = {"git", "mount", "umount", "uname"}
"Programs a fast test may run: a commit name, a tmpfs to fail on, the machine name (platform.processor())."


def in_fast_tier(path) -> bool:
    rel = Path(path).resolve()
    return any(rel.is_relative_to(ROOT / tier) for tier in FAST_TIER)


def child_refused(args) -> str | None:
    """Why a fast test may not start ``args`` (None: it may)."""
    argv = args.split() if isinstance(args, (str, bytes)) else list(args)
    program = os.path.basename(os.fsdecode(argv[0])) if argv else ""
    if program in ALLOWED_CHILDREN:
        return None
    shown = " ".join(os.fsdecode(a) for a in argv[:4])
    return (
        f"a fast-tier test started a child process ({shown} ...): the fast tier ({', '.join(FAST_TIER)}) "
        "runs in process; mark the test @pytest.mark.integration or move it to tests/integration (conftest.py)"
    )


def pytest_configure(config):
    """``platform.processor()`` runs ``uname -p`` once and caches it; MLflow and W&B ask at import.
    Asked here, before any test, it is no test's child process."""
    import platform

    platform.processor()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Fast-tier items run with :class:`subprocess.Popen` refusing children (setup, call, teardown)."""
    if not in_fast_tier(item.path) or item.get_closest_marker("integration"):
        yield
        return
    original = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        why = child_refused(args)
        if why:
            pytest.fail(why, pytrace=False)
        original(self, args, *a, **kw)

    subprocess.Popen.__init__ = guarded
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original
