"""aieng's CUDA INT4 weight layout, its repack and references, and the launches of the fused
dequantize-matmul kernels (`cuda/int4_gemv.cu`, `cuda/int4_gemm.cu`).

Layout (`Int4Weights`), for a weight w (N, K) = (q - z) * s group by group:
- `qweight` (N, K / 2) uint8: byte j of row n holds q[n, 2j] in its low nibble and q[n, 2j + 1]
  in its high one — the byte order `QuantizedLinearMethod` already keeps, so a 16-byte load is
  32 consecutive weights of one row and a warp reads 512 contiguous bytes;
- `scale_zero` (N, K / group_size, 2) float16: each group's (scale, zero), one 32-bit load.
K must be a multiple of 32 and the group size a power of two >= 32 or K itself (one group per
row): a 16-byte chunk never straddles two groups, and the kernels find a group by shift. Scales
are held in float16: a scale float16 cannot hold within 1e-3 refuses the layout; zero points are
integers with |z| <= 128.

Paths: `gemv` (M <= 16 in one pass over the weights, any M in passes of 16 rows: tensor cores
for float16 and bfloat16, CUDA cores for float32) and `gemm` (tensor cores, 64 x 64 tiles; float16
and bfloat16). `reference_matmul` is the math all compute, in float32; `staged_weights` is the
weight the 16-bit GEMV multiplies for groups under 128 ((q - z) * s rounded to x's dtype;
larger groups multiply q - z exactly and scale in float32) and `gemv_reference` the
float32 GEMV's own algebra (weights read as 1 + q/16, scale and zero applied once per 32-weight
chunk), both checked against it on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aieng.kernels.errors import KernelError

CHUNK = 32  # weights per 16-byte load of one row
GEMV_MAX_M = 16  # the decode path: every weight byte read once for up to this many rows
# Rows of x per GEMV launch tile (compiled variants), by activation dtype: tensor cores for the
# 16-bit types (an m16n8k16 tile's rows 0-7, or all 16), CUDA cores for float32.
GEMV_TILES = {
    torch.float16: (8, 16),
    torch.bfloat16: (8, 16),
    torch.float32: (1, 2, 4, 8, 16),
}
GEMV_ROWS = {1: 4, 2: 2, 4: 2, 8: 1, 16: 1}  # float32 kernel: output rows per thread, by tile
GEMV_THREADS = 128  # the float32 kernel's block
MMA_THREADS = 256  # the tensor-core GEMV's block: 8 warps splitting K
MMA_ROWS = 16  # rows of W per tensor-core CTA step (two n8 tiles)
MMA_CTAS_PER_SM = 2  # resident tensor-core GEMV CTAs per SM (their __launch_bounds__)
SCALE_AFTER_GROUP = 128  # groups this large (or one per row) are scaled after the MMA: "_g128"
DEFAULT_SMS = 132  # an H100 / H200 SXM, for plans made without a device
MAX_ZERO = 128  # |zero point| the tensor-core dequantization holds exactly (bfloat16: 128 + z)
GEMM_TILE = 64  # rows of x and of W per GEMM block
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
GEMM_DTYPES = (torch.float16, torch.bfloat16)
SCALE_TOLERANCE = 1e-3  # largest relative change of a scale stored in float16


@dataclass
class Int4Weights:
    """One layer's weight in aieng's CUDA INT4 layout."""

    qweight: torch.Tensor  # (N, K / 2) uint8
    scale_zero: torch.Tensor  # (N, G, 2) float16: (scale, zero) per group
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return 2 * self.qweight.shape[1]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) integers in [0, 16), K even -> (N, K / 2) uint8, even k in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def from_packed(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Int4Weights:
    """qweight (N, K / 2) uint8 packed as `pack_nibbles` does (kept, not copied), scales and
    zeros (N, G) -> the layout. KernelError when the shape or the scales do not fit it."""
    n, half_k = qweight.shape
    k, groups = 2 * half_k, scales.shape[1]
    if qweight.dtype != torch.uint8 or scales.shape != zeros.shape or scales.shape[0] != n:
        raise KernelError(
            f"INT4 layout: qweight {tuple(qweight.shape)} {qweight.dtype}, scales "
            f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not describe one weight"
        )
    group = k // groups if groups and not k % groups else 0
    if k % CHUNK or group < CHUNK or (group & (group - 1) and groups != 1):
        raise KernelError(
            f"INT4 layout: K = {k} in {groups} groups; K must be a multiple of {CHUNK} and "
            f"the group size K or a power of two >= {CHUNK}"
        )
    half = scales.to(torch.float16)
    change = (half.float() - scales.float()).abs() / scales.float().abs().clamp_min(1e-30)
    if not bool(torch.isfinite(half).all()) or float(change.max()) > SCALE_TOLERANCE:
        raise KernelError(
            f"INT4 layout: scales out of float16's range (largest relative change "
            f"{float(change.max()):.2e} > {SCALE_TOLERANCE})"
        )
    if bool((zeros != zeros.round()).any()) or bool((zeros.abs() > MAX_ZERO).any()):
        raise KernelError(f"INT4 layout: zero points must be integers in [-{MAX_ZERO}, {MAX_ZERO}]")
    scale_zero = torch.stack([half, zeros.to(torch.float16)], dim=-1).contiguous()
    return Int4Weights(qweight.contiguous(), scale_zero, k // groups)


def repack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Int4Weights:
    """(q (N, K) in [0, 16), scales (N, G), zeros (N, G)), the weight being (q - z) * s group by
    group -> aieng's CUDA INT4 layout. Pure torch, any device."""
    if bool((q < 0).any()) or bool((q > 15).any()):
        raise KernelError("INT4 layout: q must lie in [0, 16)")
    if q.shape[1] % 2:
        raise KernelError(f"INT4 layout: K = {q.shape[1]} is odd")
    return from_packed(pack_nibbles(q), scales, zeros)


def unpack(weights: Int4Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout -> (q (N, K) int32, scales (N, G) float32, zeros (N, G) float32)."""
    packed = weights.qweight
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    scale_zero = weights.scale_zero.float()
    return q.to(torch.int32), scale_zero[..., 0].contiguous(), scale_zero[..., 1].contiguous()


def dequantize_weights(weights: Int4Weights) -> torch.Tensor:
    """(N, K) float32: (q - z) * s with the layout's float16 scales and zeros."""
    q, scales, zeros = unpack(weights)
    n, k = q.shape
    grouped = q.float().view(n, -1, weights.group_size)
    return ((grouped - zeros[:, :, None]) * scales[:, :, None]).reshape(n, k)


def reference_matmul(x: torch.Tensor, weights: Int4Weights) -> torch.Tensor:
    """What both kernels compute: x (..., K) @ W^T in float32, returned in x's dtype."""
    y = x.float() @ dequantize_weights(weights).t()
    return y.to(x.dtype)


def scales_after_mma(group_size: int, k: int) -> bool:
    """Whether the tensor-core GEMV applies the scales to a 128-k block's sums (groups of 128 or
    more, or one per row: the block lies in one group) rather than to each weight."""
    return group_size >= SCALE_AFTER_GROUP or group_size == k


def staged_weights(weights: Int4Weights, dtype: torch.dtype) -> torch.Tensor:
    """(N, K) float32: the weight the tensor-core GEMV multiplies — (q - z) * s exactly when it
    scales after the MMA, else rounded once to x's dtype with the scale first rounded to it
    (exact for float16), as dequant8 does."""
    if scales_after_mma(weights.group_size, weights.in_features):
        return dequantize_weights(weights)
    q, scales, zeros = unpack(weights)
    n, k = q.shape
    grouped = q.float().view(n, -1, weights.group_size) - zeros[:, :, None]
    scale = scales.to(dtype).float()[:, :, None]
    return (grouped * scale).to(dtype).float().reshape(n, k)


def gemv_reference(x: torch.Tensor, weights: Int4Weights) -> torch.Tensor:
    """int4_gemv.cu's algebra in float32, (M, K) -> (M, N): each weight read as the float
    1 + q/16 (its nibble in the top of a mantissa under 1.0's exponent), and per 32-weight chunk
    sum((q - z) s x) = s * (16 * sum((1 + q/16) x) - (16 + z) * sum(x))."""
    q, scales, zeros = unpack(weights)
    n, k = q.shape
    encoded = (1 + q.float() / 16).view(n, k // CHUNK, CHUNK)  # (N, C, 32)
    xf = x.float().view(x.shape[0], k // CHUNK, CHUNK)  # (M, C, 32)
    dot = torch.einsum("mci,nci->mnc", xf, encoded)  # (M, N, C)
    xsum = xf.sum(-1)[:, None, :]  # (M, 1, C)
    per_chunk = weights.group_size // CHUNK
    s = scales.repeat_interleave(per_chunk, dim=1)[None]  # (1, N, C)
    z = zeros.repeat_interleave(per_chunk, dim=1)[None]
    return (s * (16 * dot - (16 + z) * xsum)).sum(-1)


# ------------------------------------------------------------------ launch parameters


@dataclass(frozen=True)
class Launch:
    kernel: str
    source: str
    grid: tuple[int, int]
    block: tuple[int, int]


def choose_path(m: int, dtype: torch.dtype, gemv: bool = True, gemm: bool = True) -> str | None:
    """Which kernel multiplies M rows of `dtype` ("gemv", "gemm"), given the paths that passed
    their check; None: neither can (the caller falls back to the reference)."""
    if dtype not in DTYPE_NAMES:
        return None
    tensor_cores = gemm and dtype in GEMM_DTYPES
    if gemv and (m <= GEMV_MAX_M or not tensor_cores):
        return "gemv"
    return "gemm" if tensor_cores else None


def gemv_tile(m: int, dtype: torch.dtype) -> int:
    """The compiled row tile a GEMV of M rows runs with: the smallest that holds M (M > 16:
    tiles of 16, the weights read once per tile)."""
    tiles = GEMV_TILES[dtype]
    return next((t for t in tiles if t >= m), tiles[-1])


def gemv_launch(
    m: int, n: int, k: int, dtype: torch.dtype, group_size: int, num_sms: int = DEFAULT_SMS
) -> Launch:
    """The GEMV kernel and its grid for (M, K) x (N, K)^T with groups of `group_size`.

    16-bit x (tensor cores): 256 threads, whose 8 warps split K; the CTAs walk the blocks of
    MMA_ROWS rows in a grid-stride loop, at most MMA_CTAS_PER_SM per SM, so a large N runs in one
    wave of resident CTAs instead of a fraction of one more; and the grid is the fewest CTAs
    that take the same number of blocks each, so no CTA walks one more block than the others
    while they idle (896 blocks on 264 slots: 224 CTAs of 4, not 264 of 3 or 4). Groups of 128
    or more (or one per row) take the `_g128` variant: a warp's 128-k block lies in one group,
    so the scale is applied to the block's sums in float32 instead of to every weight.
    float32 x (CUDA cores): blockDim.x threads walk K in 16-byte chunks — the largest of 128, 64,
    32 not above the chunk count — and the block's other dimension takes row groups of
    GEMV_ROWS[tile] rows."""
    tile = gemv_tile(m, dtype)
    name = f"int4_gemv_{DTYPE_NAMES[dtype]}_m{tile}"
    passes = -(-m // tile)
    if dtype in GEMM_DTYPES:
        if scales_after_mma(group_size, k):
            name += "_g128"
        row_blocks = -(-n // MMA_ROWS)
        per_cta = -(-row_blocks // (max(1, num_sms) * MMA_CTAS_PER_SM))
        grid = (
            -(-row_blocks // per_cta),
            passes,
        )  # every CTA walks per_cta blocks (the last fewer)
        return Launch(name, "int4_gemv", grid, (MMA_THREADS, 1))
    chunks = k // CHUNK
    threads_x = next((t for t in (128, 64) if t <= chunks), 32)
    threads_y = GEMV_THREADS // threads_x
    rows_per_block = GEMV_ROWS[tile] * threads_y
    return Launch(name, "int4_gemv", (-(-n // rows_per_block), passes), (threads_x, threads_y))


def gemm_launch(m: int, n: int, dtype: torch.dtype) -> Launch:
    grid = (-(-n // GEMM_TILE), -(-m // GEMM_TILE))
    return Launch(f"int4_gemm_{DTYPE_NAMES[dtype]}", "int4_gemm", grid, (128, 1))


def launch_for(
    path: str, m: int, weights: Int4Weights, dtype: torch.dtype, num_sms: int = DEFAULT_SMS
) -> Launch:
    """The one dispatch: the kernel, grid and block that multiply M rows with `path`."""
    n, k = weights.out_features, weights.in_features
    if path == "gemv":
        return gemv_launch(m, n, k, dtype, weights.group_size, num_sms)
    return gemm_launch(m, n, dtype)


ONE_GROUP_SHIFT = 30  # k >> 30 == 0 for every K a kernel takes: one group per row


def group_shift(weights: Int4Weights) -> int:
    """What the kernels shift k by to find its group: log2 of the group size (a power of two,
    as `from_packed` checked), or ONE_GROUP_SHIFT for one group per row (any K)."""
    if weights.group_size == weights.in_features:
        return ONE_GROUP_SHIFT
    return weights.group_size.bit_length() - 1


def kernel_args(x: torch.Tensor, weights: Int4Weights, y: torch.Tensor) -> list:
    """Every INT4 kernel's arguments, in order: x (M, K), qweight, scale_zero, y (M, N), M, N, K
    and the group shift."""
    m, n, k = x.shape[0], weights.out_features, weights.in_features
    return [x, weights.qweight, weights.scale_zero, y, m, n, k, group_shift(weights)]


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


_SM_COUNTS: dict[int, int] = {}


# ------------------------------------------------------------------ the GPU entry point


def int4_matmul(
    x: torch.Tensor, weights: Int4Weights, path: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) on a CUDA device @ W^T with `path`'s kernel ("gemv" or "gemm") -> (..., N) in
    x's dtype, on torch's current stream; into `out` ((M, N) contiguous) when given."""
    from aieng.kernels.launch import load_module

    k, n = weights.in_features, weights.out_features
    if x.shape[-1] != k:
        raise KernelError(f"int4_matmul: x has {x.shape[-1]} features, the weight {k}")
    flat = x.reshape(-1, k)
    if not flat.is_contiguous() or flat.data_ptr() % 16:  # the kernels load 16 bytes at once
        flat = flat.clone(memory_format=torch.contiguous_format)
    m = flat.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if y.shape != (m, n) or y.dtype != x.dtype or not y.is_contiguous():
        raise KernelError(f"int4_matmul: out must be a contiguous ({m}, {n}) {x.dtype} tensor")
    if m:
        launch = launch_for(path, m, weights, x.dtype, sm_count(x.device))
        args = kernel_args(flat, weights, y)
        load_module(launch.source).launch(launch.kernel, launch.grid, launch.block, args)
    return y.view(*x.shape[:-1], n)
