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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath) or item.get_closest_marker("gpu"):
            item.add_marker(skip)
