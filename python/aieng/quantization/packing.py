"""Bit packing of quantized integers into int32 words, as the checkpoint formats store them.

Every format here stores b-bit integers (b = 4 or 8) in int32 words, 32 // b per word, element i
of a word at bits [b*i, b*(i+1)) — little end first. They differ in which dimension is packed and
in the order of the elements inside a word:
- compressed-tensors `pack-quantized` and GPTQ: sequential (word element i is tensor element i);
- AutoAWQ `gemm`: interleaved, word element i holds column `AWQ_PACK_ORDER[i]` of its 8.
Values are unsigned in the words; compressed-tensors adds an offset of 2**(b-1) to its signed
values before packing. The functions work on int32 tensors holding values in [0, 2**b).
"""

from __future__ import annotations

import torch

# AutoAWQ gemm: word element i (bits 4i..4i+3) holds column AWQ_PACK_ORDER[i] of its group of 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_factor(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit packing is not supported (4 or 8)")
    return 32 // bits


def pack_int32(
    values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """values (int, in [0, 2**bits)) -> int32 words packed along `dim`, padded with zeros to a
    whole word. `order[i]`: which of a word's elements goes to bits i*bits."""
    factor = pack_factor(bits)
    values = values.to(torch.int64).movedim(dim, -1)
    if values.shape[-1] % factor:
        values = torch.nn.functional.pad(values, (0, factor - values.shape[-1] % factor))
    if bool((values < 0).any()) or bool((values >= 1 << bits).any()):
        raise ValueError(f"values to pack must lie in [0, {1 << bits})")
    grouped = values.reshape(*values.shape[:-1], -1, factor)
    if order is not None:
        grouped = grouped[..., list(order)]
    shifts = torch.arange(factor, dtype=torch.int64) * bits
    words = (grouped << shifts).sum(-1)
    # Reinterpret the unsigned 32-bit words as int32 (two's complement), as the formats store.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(
    words: torch.Tensor,
    bits: int,
    dim: int,
    order: tuple[int, ...] | None = None,
    size: int | None = None,
) -> torch.Tensor:
    """int32 words packed along `dim` -> int32 values in [0, 2**bits), `dim` 32 // bits times
    longer (or cut to `size`); the inverse of `pack_int32` with the same `order`."""
    factor = pack_factor(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    moved = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(factor, dtype=torch.int64) * bits
    elements = (moved[..., None] >> shifts) & ((1 << bits) - 1)  # (..., words, factor)
    if order is not None:
        inverse = [0] * factor
        for position, column in enumerate(order):
            inverse[column] = position
        elements = elements[..., inverse]
    values = elements.reshape(*moved.shape[:-1], -1).to(torch.int32)
    if size is not None:
        values = values[..., :size]
    return values.movedim(-1, dim).contiguous()
