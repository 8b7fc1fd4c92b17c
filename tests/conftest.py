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
    from moe_rl.config import ModelConfig

    return ModelConfig(
        vocab_size=64,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        moe_ffn_hidden_size=64,
        num_experts=4,
        moe_router_topk=2,
        max_seq_len=64,
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath) or item.get_closest_marker("gpu"):
            item.add_marker(skip)
