"""The studies' tests share the library tests' fixtures (a world-of-one parallel state, the tiny
model's config) and their environment (Triton's interpreter on CPU)."""

from tests.conftest import parallel_info, pytest_collection_modifyitems, tiny_model_cfg  # noqa: F401
