"""Triton kernels: per-token log-probs and entropy from hidden states, never materialising logits.

Shape legend: N = tokens, H = hidden size, V = local vocabulary shard, C = vocab chunk width
(backward), P = vocab splits of the forward grid.

Forward (``_fwd_kernel``): one program per (token block, vocab split) walks its split in
[BM, BV] tiles; each tile is ``h @ W_tile^T`` (fp32 accumulation over H in BK steps) times
1/T, folded into an online max / sum-exp, the picked target logit and, for entropy, the
online-rescaled sum of exp(z - m) z. It writes the [4, P, N] partials; PyTorch combines them
over P and over the TP group (``hidden_logprob_reference.combine_partials``).

Backward (``_grad_kernel``): recomputes each logits tile and writes the logit gradient
G = (g_logp (onehot - p) - g_ent p (z - E_p[z])) / T of one vocab chunk [N, C] in the input
dtype; cuBLAS then adds ``G @ W_chunk`` into an fp32 dH and writes ``G^T @ h`` into that
chunk's rows of dW. Why not atomics: accumulating dH and dW tile by tile costs N*H*V/BV +
V*H*N/BM fp32 atomic adds (8e10 at N=8k, H=4096, V=151,936, BM=BV=128: ~320 GB of atomic
traffic, non-deterministic) against ~3*N*V*2 bytes (7.5 GB) to write and read G chunk by
chunk; a per-token-block dH pass would need a [BM, H] accumulator (2 MiB at H=4096).

Cost: forward 2*N*H*V flops; backward 6*N*H*V (recomputed logits + two GEMMs), so forward +
backward does 8*N*H*V where the logits-materialising path does 6*N*H*V: at most 75% of that
matmul floor. Memory: the [4, P, N] partials, one [N, C] G chunk, an fp32 dH and the grads.
Programs run GROUP_M token blocks at a time (the Triton matmul tutorial's order) so that the
ones resident together share hidden-state blocks and weight tiles in L2.

The PyTorch reference beside it is ``hidden_logprob_reference.py`` (same driver, torch tiles).
With ``TRITON_INTERPRET=1`` set before triton is imported, the kernels run on CPU tensors in
triton's interpreter (slow; for tests). The interpreter cannot multiply bfloat16 (it stores
it as uint16), so there bf16 tiles are upcast to fp32 before ``tl.dot``; on GPU they go to
the tensor cores as bf16.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moe_rl.kernels import hidden_logprob_reference as ref
from moe_rl.kernels.hidden_logprob_reference import (
    DEFAULT_CHUNK_ELEMENTS,
    VocabChunkedLogProb,
    check_inputs,
    vocab_chunk_width,
)

log = logging.getLogger(__name__)


@triton.jit
def _grouped(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a 1-D program id, GROUP_M row blocks at a time, so that the programs
    running together share a few hidden-state blocks and weight tiles in L2."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _logits_tile(
    h_row,
    w_row,
    row_ok,
    col_ok,
    H,
    BM: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 [BM, BV] tile h[rows] @ w[cols]^T from row pointers, accumulated over H in BK steps."""
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BV), dtype=tl.float32)
    for k0 in range(0, H, BK):
        ks = k0 + rk
        hb = tl.load(h_row + ks[None, :], mask=row_ok[:, None] & (ks < H)[None, :], other=0.0)
        wb = tl.load(w_row + ks[None, :], mask=col_ok[:, None] & (ks < H)[None, :], other=0.0)
        if UPCAST:
            hb, wb = hb.to(tl.float32), wb.to(tl.float32)
        acc = tl.dot(hb, tl.trans(wb), acc, input_precision=PRECISION)
    return acc


def _fwd_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    part_ptr,
    N,
    V,
    H,
    stride_h,
    stride_w,
    inv_t,
    num_splits,
    BM: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    ENTROPY: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_s = _grouped(tl.program_id(0), tl.cdiv(N, BM), num_splits, GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < N
    h_row = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    m = tl.full((BM,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BM,), dtype=tl.float32)
    t = tl.zeros((BM,), dtype=tl.float32)
    a = tl.zeros((BM,), dtype=tl.float32)
    per_split = tl.cdiv(tl.cdiv(V, BV), num_splits) * BV
    v_begin = pid_s * per_split
    v_end = tl.minimum(v_begin + per_split, V)
    for v0 in range(v_begin, v_end, BV):
        cols = v0 + tl.arange(0, BV)
        col_ok = cols < V
        w_row = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        acc = _logits_tile(h_row, w_row, row_ok, col_ok, H, BM, BV, BK, UPCAST, PRECISION)
        z = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        s = s * scale + tl.sum(e, axis=1)
        if ENTROPY:
            a = a * scale + tl.sum(e * tl.where(col_ok[None, :], z, 0.0), axis=1)
        hit = (cols[None, :] == tgt[:, None]) & col_ok[None, :]
        t += tl.sum(tl.where(hit, z, 0.0), axis=1)
        m = m_new
    out = part_ptr + pid_s * N + rows
    plane = num_splits * N
    tl.store(out, m, mask=row_ok)
    tl.store(out + plane, s, mask=row_ok)
    tl.store(out + 2 * plane, t, mask=row_ok)
    tl.store(out + 3 * plane, a, mask=row_ok)


def _grad_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    lse_ptr,
    ez_ptr,
    gl_ptr,
    ge_ptr,
    g_ptr,
    N,
    C,
    H,
    col0,
    stride_h,
    stride_w,
    stride_g,
    inv_t,
    BM: tl.constexpr,
    BV: tl.constexpr,
    BK: tl.constexpr,
    ENTROPY: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_v = _grouped(tl.program_id(0), tl.cdiv(N, BM), tl.cdiv(C, BV), GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_v * BV + tl.arange(0, BV)
    row_ok = rows < N
    col_ok = cols < C
    h_row = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_row = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = _logits_tile(h_row, w_row, row_ok, col_ok, H, BM, BV, BK, UPCAST, PRECISION)
    z = acc * inv_t
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    gl = tl.load(gl_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - col0
    p = tl.exp(z - lse[:, None])
    g = tl.where(cols[None, :] == tgt[:, None], gl[:, None], 0.0) - p * gl[:, None]
    if ENTROPY:
        ez = tl.load(ez_ptr + rows, mask=row_ok, other=0.0)
        ge = tl.load(ge_ptr + rows, mask=row_ok, other=0.0)
        g -= p * (z - ez[:, None]) * ge[:, None]
    g = g * inv_t
    ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    tl.store(ptrs, g.to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


KERNELS = {"fwd": triton.jit(_fwd_kernel), "grad": triton.jit(_grad_kernel)}
"The kernels as triton built them: compiled, or interpreted when TRITON_INTERPRET=1 was set."


def interpreting() -> bool:
    """True when the kernels run in triton's CPU interpreter.

    Triton fixes this per process: TRITON_INTERPRET=1 must be set before triton is first
    imported (it builds its own library functions, tl.sum and the like, then); setting it
    later leaves these kernels interpreted but the library compiled, which cannot run.
    """
    interp = isinstance(KERNELS["fwd"], InterpretedFunction)
    if interp != isinstance(tl.sum, InterpretedFunction):
        raise RuntimeError(
            "TRITON_INTERPRET changed after triton was imported: set it before the first import of triton "
            "(megatron.core imports triton), or import moe_rl.kernels.fused_logprob in a fresh process"
        )
    return interp


GPU_TILE = {"BM": 128, "BV": 128, "BK": 64, "num_warps": 8, "num_stages": 3}
"""Preferred tile of both kernels on CUDA (bf16 on sm_90: wgmma, 3-stage cp.async pipeline, no
register spills per ptxas), used where it fits the device's shared memory (:func:`device_tile`).
``benchmarks/kernels.py`` sweeps GPU_TILES."""
GPU_TILES = {
    "128x128x64-w8-s3": GPU_TILE,
    "128x256x64-w8-s3": {"BM": 128, "BV": 256, "BK": 64, "num_warps": 8, "num_stages": 3},
    "128x128x64-w4-s4": {"BM": 128, "BV": 128, "BK": 64, "num_warps": 4, "num_stages": 4},
    "64x128x64-w4-s4": {"BM": 64, "BV": 128, "BK": 64, "num_warps": 4, "num_stages": 4},
    "128x64x64-w4-s4": {"BM": 128, "BV": 64, "BK": 64, "num_warps": 4, "num_stages": 4},
    "128x128x32-w8-s3": {"BM": 128, "BV": 128, "BK": 32, "num_warps": 8, "num_stages": 3},
    "64x64x32-w4-s2": {"BM": 64, "BV": 64, "BK": 32, "num_warps": 4, "num_stages": 2},
}
"Named tiles the benchmark can sweep (``tile=`` of fused_logprobs)."
TILE_PREFERENCE = ("128x128x64-w8-s3", "128x128x32-w8-s3", "64x64x32-w4-s2")
"""GPU_TILES names :func:`choose_tile` tries in order: the default, then half its K step (half its
shared memory: fp32 on 99 KiB parts), then a small tile that fits any CUDA GPU's 48 KiB."""
HOPPER_BF16_TILE = "128x256x64-w8-s3"
"""Tried first for 16-bit inputs on sm_90 and up: the fastest of GPU_TILES on an H100 (triton 3.6,
V = 151,936, bf16; benchmarks/results/gpu_check-nvidia-h100-80gb-hbm3-987dd2f.json): forward
1.22x / 1.19x the default tile's speed at 8192x2048 / 16384x4096 (71-73% of the matmul floor, from
59-61%), forward + backward 1.09x. It spills a few registers (ptxas: 736 bytes in the forward,
184 in the gradient kernel) and is faster all the same: wider wgmma tiles, half the h reloads."""
MAX_SHARED_BY_CC = {
    (7, 0): 98_304,
    (7, 5): 65_536,
    (8, 0): 166_912,
    (8, 6): 101_376,
    (8, 7): 166_912,
    (8, 9): 101_376,
    (9, 0): 232_448,
    (10, 0): 232_448,
    (12, 0): 101_376,
}
"""Shared memory per block (opt-in maximum, bytes) by compute capability, from the CUDA programming
guide: V100, T4, A100, A10/A40/RTX 30, Jetson Orin, L4/L40/RTX 40, H100/H200, B200, RTX 50. Used
where torch does not report ``shared_memory_per_block_optin``; unknown parts get 48 KiB."""


def tile_shared_bytes(tile: dict, dtype: torch.dtype, cc: tuple[int, int] | None = None) -> int:
    """Shared memory one program of either kernel needs at ``tile`` for ``dtype`` inputs on a GPU
    of compute capability ``cc`` (None: unknown, counted at the most).

    Triton software-pipelines the H loop of ``_logits_tile``: each buffer holds one iteration's
    h [BM, BK] and w [BV, BK] blocks, and nothing else outlives them (the reductions' scratch
    reuses that memory). It keeps ``num_stages - 1`` buffers (cp.async in flight) for the fp32
    FMA dot and for 16-bit mma.sync before Hopper, and ``num_stages`` for 16-bit wgmma (sm_90 and
    up). This is what triton 3.9 compiles (``metadata.shared`` of both kernels at the alignment
    its JIT infers, sm_80 / sm_89 / sm_90, fp32 and bf16; ``benchmarks/kernels.py --codegen``):
    at GPU_TILE 131,072 bytes in fp32, 65,536 in bf16 before sm_90 and 98,304 on sm_90.
    """
    wgmma = dtype.itemsize == 2 and (cc is None or cc[0] >= 9)
    buffers = tile["num_stages"] if wgmma else max(tile["num_stages"] - 1, 1)
    return buffers * (tile["BM"] + tile["BV"]) * tile["BK"] * dtype.itemsize


def choose_tile(dtype: torch.dtype, max_shared: int, cc: tuple[int, int] | None = None) -> dict | None:
    """The first tile of TILE_PREFERENCE whose :func:`tile_shared_bytes` fits ``max_shared`` bytes
    (a GPU of compute capability ``cc``) in ``dtype``, :data:`HOPPER_BF16_TILE` first for 16-bit
    inputs on sm_90 and up; None if none does."""
    hopper = dtype.itemsize == 2 and cc is not None and cc[0] >= 9
    for name in ((HOPPER_BF16_TILE,) if hopper else ()) + TILE_PREFERENCE:
        if tile_shared_bytes(GPU_TILES[name], dtype, cc) <= max_shared:
            return GPU_TILES[name]
    return None


def max_shared_memory(device: torch.device) -> tuple[int, tuple[int, int]]:
    """(shared memory per block (opt-in maximum, bytes), compute capability) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    cc = (props.major, props.minor)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    return (int(optin) if optin else MAX_SHARED_BY_CC.get(cc, 48 * 1024)), cc


@functools.cache
def _device_tile(device_index: int, dtype: torch.dtype) -> dict | None:
    smem, cc = max_shared_memory(torch.device("cuda", device_index))
    tile = choose_tile(dtype, smem, cc)
    if tile is None:
        log.warning(
            "no Triton log-prob tile fits %d bytes of shared memory (sm_%d%d) in %s: using the torch path",
            smem,
            *cc,
            dtype,
        )
    return tile


def device_tile(device: torch.device, dtype: torch.dtype) -> dict | None:
    """:func:`choose_tile` for a CUDA ``device`` (cached per device and dtype); None if none fits."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_tile(index, dtype)


_INTERP_TILE = {"BM": 16, "BV": 32, "BK": 16}
"Small tile for the CPU interpreter: several blocks per axis at test sizes."


GROUP_M = 8
"Token blocks per program group (L2 reuse; the order of the Triton matmul tutorial)."
GPU_CHUNK_ELEMENTS = 1 << 26
"Backward chunk cap N * C on CUDA: 128 MiB of bf16 G, wide enough for efficient cuBLAS GEMMs."


def _setup(h: torch.Tensor, tile: dict | None) -> tuple[dict, dict, dict]:
    """(kernels, tile, flags) for h."""
    interp = interpreting()
    if not interp and not h.is_cuda:
        raise ValueError(
            f"the Triton log-prob kernel needs CUDA tensors, got {h.device}; on CPU set "
            "TRITON_INTERPRET=1 before triton is first imported, or use impl='torch'"
        )
    kernels = KERNELS
    if tile is None and not interp:
        tile = device_tile(h.device, h.dtype)
        if tile is None:
            raise ValueError(
                f"no Triton log-prob tile fits this GPU's shared memory ({max_shared_memory(h.device)[0]} "
                f"bytes) in {h.dtype}: use impl='torch'"
            )
    tile = dict(tile or _INTERP_TILE)
    flags = {
        "UPCAST": interp and h.dtype != torch.float32,
        # fp32 inputs are for testing: keep them exact instead of TF32
        "PRECISION": "ieee" if h.dtype == torch.float32 else "tf32",
    }
    return kernels, tile, flags


def default_splits(n: int, v: int, block_m: int, block_v: int, device: torch.device) -> int:
    """Vocab splits P minimising waves x tiles per program (one resident program per SM).

    Token blocks x P programs run in ceil(programs / SMs) waves of ceil(vocab tiles / P)
    tiles each; e.g. N = 8192, V = 151,936 on 132 SMs: P = 33, 0.1% above the ideal.
    """
    tiles = triton.cdiv(v, block_v)
    if device.type != "cuda":
        return min(3, tiles)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = triton.cdiv(n, block_m)
    return min(
        range(1, min(tiles, 64) + 1), key=lambda p: triton.cdiv(blocks * p, sms) * triton.cdiv(tiles, p)
    )


def fwd_partials(
    h_NH,
    w_VH,
    tgt_local_N,
    inv_t: float,
    with_entropy: bool,
    *,
    num_splits: int | None = None,
    tile: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[4, P, N] fp32 partials (m, s, t, a) of contiguous h_NH and w_VH; tgt_local_N int32."""
    kernels, tile, flags = _setup(h_NH, tile)
    n, hid = h_NH.shape
    v = w_VH.shape[0]
    p = num_splits or default_splits(n, v, tile["BM"], tile["BV"], h_NH.device)
    if out is None:
        out = ref._empty((4, p, n), torch.float32, h_NH.device)
    grid = (triton.cdiv(n, tile["BM"]) * p,)
    kernels["fwd"][grid](
        h_NH,
        w_VH,
        tgt_local_N,
        out,
        n,
        v,
        hid,
        h_NH.stride(0),
        w_VH.stride(0),
        inv_t,
        p,
        ENTROPY=with_entropy,
        GROUP_M=GROUP_M,
        **flags,
        **tile,
    )
    return out


def grad_chunk(
    h_NH,
    w_CH,
    tgt_local_N,
    col0: int,
    lse_N,
    ez_N,
    g_logp_N,
    g_ent_N,
    inv_t: float,
    with_entropy: bool,
    *,
    tile: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logit gradient [N, C] of vocab rows w_CH (local ids col0 .. col0 + C - 1), input dtype."""
    kernels, tile, flags = _setup(h_NH, tile)
    n, hid = h_NH.shape
    c = w_CH.shape[0]
    if out is None:
        out = ref._empty((n, c), h_NH.dtype, h_NH.device)
    grid = (triton.cdiv(n, tile["BM"]) * triton.cdiv(c, tile["BV"]),)
    kernels["grad"][grid](
        h_NH,
        w_CH,
        tgt_local_N,
        lse_N,
        ez_N,
        g_logp_N,
        g_ent_N,
        out,
        n,
        c,
        hid,
        col0,
        h_NH.stride(0),
        w_CH.stride(0),
        out.stride(0),
        inv_t,
        ENTROPY=with_entropy,
        GROUP_M=GROUP_M,
        **flags,
        **tile,
    )
    return out


def fused_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    target_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    group=None,
    vocab_start: int = 0,
    with_entropy: bool = False,
    vocab_chunk: int | None = None,
    num_splits: int | None = None,
    tile: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-prob of ``target_N`` and entropy (zeros unless asked) per token, [N] each.

    Same semantics as ``logprob_reference.logprobs_entropy(hidden_NH @ weight_VH.T, ...)``:
    hidden_NH [N, H] and weight_VH [V, H] (this rank's vocab rows from global id
    ``vocab_start``) share a dtype (bf16 on GPU); target_N [N] global ids; max, sum-exp,
    target logit and E[z] reduced over ``group``. The gradient of hidden_NH is this shard's
    contribution (the caller all-reduces it under TP). ``vocab_chunk``: backward chunk
    width C (default N * C <= 2**26 on CUDA, 2**24 elsewhere); ``num_splits``: forward
    vocab splits P (default fills the GPU); ``tile``: kernel tile (default: the first of
    ``TILE_PREFERENCE`` that fits the GPU's shared memory in the inputs' dtype, :func:`device_tile`).
    """
    check_inputs(hidden_NH, weight_VH, target_N, temperature)
    n, v = hidden_NH.shape[0], weight_VH.shape[0]
    budget = GPU_CHUNK_ELEMENTS if hidden_NH.is_cuda else DEFAULT_CHUNK_ELEMENTS
    chunk = vocab_chunk or vocab_chunk_width(n, v, budget)

    def partials(h, w, tgt, inv_t, with_ent):
        return fwd_partials(h, w, tgt, inv_t, with_ent, num_splits=num_splits, tile=tile)

    def grad(*args):
        return grad_chunk(*args, tile=tile)

    return VocabChunkedLogProb.apply(
        hidden_NH,
        weight_VH,
        target_N,
        float(temperature),
        group,
        int(vocab_start),
        bool(with_entropy),
        partials,
        grad,
        chunk,
    )
