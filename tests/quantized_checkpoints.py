"""Quantized checkpoints for tests, written independently of aieng's loaders.

compressed-tensors checkpoints are written by the `compressed-tensors` library itself (its
`PackedQuantizationCompressor`); AutoAWQ `gemm` and GPTQ checkpoints byte by byte from their
specifications, with plain Python loops over words (not aieng's packing code). Each writer also
saves a float32 checkpoint of the dequantized weights, so transformers can be the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # word nibble i holds column AWQ_ORDER[i] of its 8


def min_max_quantize(w: torch.Tensor, bits: int, group: int | None, symmetric: bool):
    """w (N, K) -> (q (N, K) ints in [0, 2^b), s (N, G) float32, z (N, G) ints): w ~ (q - z) s.
    Symmetric: z = 2^(b-1)."""
    n, k = w.shape
    group = group or k
    wg = w.reshape(n, k // group, group)
    top = (1 << bits) - 1
    if symmetric:
        half = 1 << (bits - 1)
        s = wg.abs().amax(-1) / (half - 1)
        s = torch.where(s == 0, torch.ones_like(s), s)
        z = torch.full_like(s, half, dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = (hi - lo) / top
        s = torch.where(s == 0, torch.ones_like(s), s)
        z = torch.round(-lo / s).to(torch.int64).clamp(0, top)
    q = torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, top).to(torch.int64)
    return q.reshape(n, k), s.float(), z


def dequantize(q, s, z, group: int | None):
    n, k = q.shape
    group = group or k
    w = (q.reshape(n, k // group, group) - z[..., None]).float() * s[..., None]
    return w.reshape(n, k)


def _to_int32(words: list[int]) -> list[int]:
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def pack_rows(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """values (R, C) in [0, 2^b) -> int32 (R, C*b/32), each word's elements at bits b*i."""
    per_word = 32 // bits
    order = order or list(range(per_word))
    rows = []
    for row in values.tolist():
        words = []
        for start in range(0, len(row), per_word):
            word = 0
            for i in range(per_word):
                word |= row[start + order[i]] << (bits * i)
            words.append(word)
        rows.append(_to_int32(words))
    return torch.tensor(rows, dtype=torch.int32)


LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized_layers(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(
        name[: -len(".weight")]
        for name in tensors
        if name.endswith(".weight") and name.split(".")[-2] in LINEAR_SUFFIXES
    )


def _copy_folder(source: Path, out: Path, quantization_config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _save_reference(source: Path, out: Path, tensors: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, out / path.name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def awq_layer(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One AutoAWQ gemm layer: w (N, K) -> (its checkpoint tensors, its dequantized weight)."""
    q, s, z = min_max_quantize(w, 4, group, symmetric=False)
    s16 = s.to(torch.float16)
    packed = {
        "qweight": pack_rows(q.t(), 4, AWQ_ORDER),
        "qzeros": pack_rows(z.t(), 4, AWQ_ORDER),
        "scales": s16.t().contiguous(),
    }
    return packed, dequantize(q, s16.float(), z, group)


def gptq_layer(
    w: torch.Tensor, bits: int, group: int | None, sym: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One GPTQ layer: w (N, K) -> (its checkpoint tensors, its dequantized weight)."""
    q, s, z = min_max_quantize(w, bits, group, symmetric=sym)
    s16 = s.to(torch.float16)
    k = w.shape[1]
    packed = {
        "qweight": pack_rows(q, bits).t().contiguous(),
        "qzeros": pack_rows((z - 1).t(), bits),
        "scales": s16.t().contiguous(),
        "g_idx": torch.arange(k, dtype=torch.int32) // (group or k),
    }
    return packed, dequantize(q, s16.float(), z, group)


def write_awq(source: Path, out: Path, reference: Path, group: int = 32) -> None:
    """AutoAWQ gemm: qweight (K, N/8) and qzeros (G, N/8) int32 with the interleaved nibble
    order, scales (G, N) float16; w = (q - z) * s."""
    tensors = load_file(source / "model.safetensors")
    stored, dense = {}, dict(tensors)
    for layer in quantized_layers(tensors):
        packed, dense[f"{layer}.weight"] = awq_layer(tensors.pop(f"{layer}.weight"), group)
        stored.update({f"{layer}.{name}": value for name, value in packed.items()})
    stored.update(tensors)
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    _copy_folder(source, out, config)
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    _save_reference(source, reference, dense)


def write_gptq(
    source: Path, out: Path, reference: Path, bits: int = 4, group: int = 32, sym: bool = True
) -> None:
    """GPTQ (AutoGPTQ 'gptq' checkpoint format): qweight (K*b/32, N) packed down the input
    dimension, qzeros (G, N*b/32) holding zero - 1, scales (G, N) float16, g_idx (K,)."""
    tensors = load_file(source / "model.safetensors")
    stored, dense = {}, dict(tensors)
    for layer in quantized_layers(tensors):
        w = tensors.pop(f"{layer}.weight")
        packed, dense[f"{layer}.weight"] = gptq_layer(w, bits, group, sym)
        stored.update({f"{layer}.{name}": value for name, value in packed.items()})
    stored.update(tensors)
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group or -1,
        "desc_act": False,
        "sym": sym,
        "checkpoint_format": "gptq",
    }
    _copy_folder(source, out, config)
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    _save_reference(source, reference, dense)


def write_compressed_tensors(
    source: Path,
    out: Path,
    reference: Path,
    bits: int = 4,
    group: int | None = 32,
    symmetric: bool = False,
    ignore: tuple[str, ...] = ("lm_head",),
) -> None:
    """pack-quantized, written by the compressed-tensors library's own compressor from our
    scales and zero points; the reference is the library's own decompression."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "group" if group else "channel"
    args = QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = load_file(source / "model.safetensors")
    stored, dense = {}, dict(tensors)
    half = 1 << (bits - 1)
    for layer in quantized_layers(tensors):
        if any(layer.endswith(name) for name in ignore):
            continue
        w = tensors.pop(f"{layer}.weight")
        q, s, z = min_max_quantize(w, bits, group, symmetric)
        state = {"weight": dequantize(q, s, z, group), "weight_scale": s}
        if not symmetric:
            state["weight_zero_point"] = (z - half).to(torch.int8)
        compressed = PackedQuantizationCompressor.compress(state, scheme)
        for name, value in compressed.items():
            stored[f"{layer}.{name}"] = value
        decompressed = PackedQuantizationCompressor.decompress(dict(compressed), scheme)
        dense[f"{layer}.weight"] = decompressed["weight"].float()
    stored.update(tensors)
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": args.model_dump(mode="json"),
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }
    _copy_folder(source, out, config)
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    _save_reference(source, reference, dense)
