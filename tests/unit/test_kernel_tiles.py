"""The Triton log-prob kernel's tile is chosen to fit the GPU's shared memory (CPU checks).

The shared-memory counts below are what triton 3.9 compiles (``metadata.shared`` of both
kernels, at the alignment its JIT infers; the same for fwd and grad): the h and w blocks of
``num_stages - 1`` pipelined H-loop iterations for fp32 (FMA dot, any arch) and for bf16 before
Hopper, ``num_stages`` of them for bf16 on sm_90 (wgmma). The fixed 128x128x64 3-stage tile needs
131,072 bytes in fp32: within an A100's or an H100's limit, above an L40's (and any other 99 KiB
part's), where triton refuses to launch it.
"""

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from moe_rl.kernels import fused_logprob as F  # noqa: E402
from moe_rl.kernels import resolve_logprob_impl  # noqa: E402

H100 = H200 = 232_448  # sm_90, shared memory per block (opt-in), bytes
A100 = 166_912  # sm_80
L40 = 101_376  # sm_89 (and sm_86: A10, A40, RTX 30)
T4 = 65_536  # sm_75

SM80, SM89, SM90 = (8, 0), (8, 9), (9, 0)
FP32, BF16 = torch.float32, torch.bfloat16
# triton 3.9 metadata.shared of the fwd and grad kernels (equal), bytes
COMPILED = {
    **{(name, FP32, cc): b for cc in (SM80, SM89, SM90) for name, b in [
        ("128x128x64-w8-s3", 131_072), ("128x128x32-w8-s3", 65_536), ("64x64x32-w4-s2", 16_384),
        ("128x64x64-w4-s4", 147_456)]},
    **{(name, BF16, cc): b for cc in (SM80, SM89) for name, b in [
        ("128x128x64-w8-s3", 65_536), ("128x128x32-w8-s3", 32_768), ("64x64x32-w4-s2", 8_192),
        ("128x64x64-w4-s4", 73_728)]},
    **{(name, BF16, SM90): b for name, b in [
        ("128x128x64-w8-s3", 98_304), ("128x128x32-w8-s3", 49_152), ("64x64x32-w4-s2", 16_384),
        ("128x64x64-w4-s4", 98_304)]},
}  # fmt: skip


def test_shared_memory_formula_by_hand():
    # default tile, fp32: 2 buffers in flight x (h block 128 x 64 + w block 128 x 64) x 4 bytes
    assert F.tile_shared_bytes(F.GPU_TILE, FP32, SM80) == 2 * (128 * 64 + 128 * 64) * 4 == 131_072
    assert F.tile_shared_bytes(F.GPU_TILE, BF16, SM80) == 2 * (128 * 64 + 128 * 64) * 2
    assert F.tile_shared_bytes(F.GPU_TILE, BF16, SM90) == 3 * (128 * 64 + 128 * 64) * 2  # wgmma: 3
    assert F.tile_shared_bytes(F.GPU_TILES["64x64x32-w4-s2"], FP32, SM90) == 1 * (64 * 32 + 64 * 32) * 4
    for (name, dtype, cc), compiled in COMPILED.items():
        assert F.tile_shared_bytes(F.GPU_TILES[name], dtype, cc) == compiled, (name, dtype, cc)
    # unknown GPU: counted at the most
    assert F.tile_shared_bytes(F.GPU_TILE, BF16) == 98_304


@pytest.mark.parametrize(
    "smem, cc, dtype, want",
    [
        (H100, SM90, FP32, "128x128x64-w8-s3"),
        (H200, SM90, BF16, "128x256x64-w8-s3"),  # measured fastest on an H100 (HOPPER_BF16_TILE)
        (120_000, SM90, BF16, "128x128x64-w8-s3"),  # its 147,456 bytes do not fit: the default
        (H100, None, BF16, "128x128x64-w8-s3"),  # unknown architecture: the default
        (A100, SM80, FP32, "128x128x64-w8-s3"),  # 131,072 <= 166,912
        (A100, SM80, BF16, "128x128x64-w8-s3"),
        (L40, SM89, FP32, "128x128x32-w8-s3"),  # the fixed tile's 131,072 > 101,376
        (L40, SM89, BF16, "128x128x64-w8-s3"),
        (T4, (7, 5), FP32, "128x128x32-w8-s3"),
        (48 * 1024, None, FP32, "64x64x32-w4-s2"),
        (8 * 1024, None, FP32, None),
    ],
)
def test_choose_tile(smem, cc, dtype, want):
    got = F.choose_tile(dtype, smem, cc)
    assert got is (F.GPU_TILES[want] if want else None)
    if got is not None:
        assert F.tile_shared_bytes(got, dtype, cc) <= smem


def test_the_fixed_tile_does_not_fit_a_99_kib_gpu_in_fp32():
    assert F.tile_shared_bytes(F.GPU_TILE, FP32, SM89) > L40
    assert F.choose_tile(FP32, L40, SM89) is not F.GPU_TILE
    assert all(name in F.GPU_TILES for name in F.TILE_PREFERENCE)
    assert F.GPU_TILES[F.TILE_PREFERENCE[0]] is F.GPU_TILE


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda.get_device_properties of a pretend GPU; the per-device tile cache cleared."""
    props = SimpleNamespace(major=9, minor=0, shared_memory_per_block_optin=H100)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    F._device_tile.cache_clear()
    yield props
    F._device_tile.cache_clear()


def test_max_shared_memory_from_torch_or_the_table(fake_gpu):
    cuda0 = torch.device("cuda", 0)
    assert F.max_shared_memory(cuda0) == (H100, SM90)
    del fake_gpu.shared_memory_per_block_optin
    for cc, smem in [(SM80, A100), (SM89, L40), (SM90, H200), ((5, 2), 48 * 1024)]:
        fake_gpu.major, fake_gpu.minor = cc
        assert F.max_shared_memory(cuda0) == (smem, cc)


def test_auto_falls_back_to_torch_when_no_tile_fits(fake_gpu, monkeypatch, caplog):
    import moe_rl.kernels as K

    monkeypatch.setattr(K, "triton_available", lambda: True)
    cuda0 = torch.device("cuda", 0)
    assert resolve_logprob_impl("auto", cuda0, torch.float32) == "triton"
    assert F.device_tile(cuda0, torch.float32) is F.GPU_TILE
    fake_gpu.major, fake_gpu.minor, fake_gpu.shared_memory_per_block_optin = 8, 9, L40
    F._device_tile.cache_clear()
    assert F.device_tile(cuda0, torch.float32) is F.GPU_TILES["128x128x32-w8-s3"]
    fake_gpu.shared_memory_per_block_optin = 8 * 1024
    F._device_tile.cache_clear()
    with caplog.at_level(logging.WARNING, logger=F.__name__):
        assert resolve_logprob_impl("auto", cuda0, torch.float32) == "torch"
        assert resolve_logprob_impl("auto", cuda0, torch.float32) == "torch"
    lines = [r.getMessage() for r in caplog.records if r.name == F.__name__]
    assert len(lines) == 1 and "torch path" in lines[0], lines
    assert resolve_logprob_impl("auto", torch.device("cpu"), torch.float32) == "torch"
