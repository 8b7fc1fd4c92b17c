"""Fixtures the studies' tests share: one SFT-start cache for the session, a PNG check."""

import pytest


@pytest.fixture(scope="session")
def sft_cache(tmp_path_factory):
    """SFT starts of the smoke presets, trained once per session (``moe_rl.lab.starts`` caches by
    SFT signature, so studies with the same smoke start share it)."""
    return tmp_path_factory.mktemp("bench_cache")


@pytest.fixture
def png():
    """A check that ``path`` is a PNG file."""

    def check(path):
        assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    return check
