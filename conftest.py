import os
import warnings

import pytest
import torch

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
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath) or item.get_closest_marker("gpu"):
            item.add_marker(skip)
