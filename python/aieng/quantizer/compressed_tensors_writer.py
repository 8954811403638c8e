"""Writing a compressed-tensors `pack-quantized` checkpoint (what llm-compressor writes and vLLM
and transformers load), byte for byte as the `compressed-tensors` library lays it out.

Each quantized linear `X` (weight (out, in), b bits, `groups` scales per row) becomes:
- `X.weight_packed`: int32 (out, ceil(in * b / 32)), the b-bit integers q + 2**(b-1) packed
  along the input dimension, element i of a word at bits [b*i, b*(i+1));
- `X.weight_scale`: (out, groups) in the model's dtype;
- `X.weight_shape`: int64 [out, in];
- asymmetric only, `X.weight_zero_point`: int32 (ceil(out * b / 32), groups), the zero points
  + 2**(b-1) packed along the output dimension.
A weight dequantizes as (q - zero_point) * scale, each scale covering `group_size` consecutive
input columns of its row (one group per row for the channel strategy). Every other tensor is
written as it is, and `config.json` gains the `quantization_config` that
`compressed_tensors.ModelCompressor.update_config` writes. This module needs only torch and
safetensors; the `compressed-tensors` package is a test dependency (the tests hold the two
together).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aieng.quantization.packing import pack_int32

SUPPORTED_BITS = (4, 8)
# Files of a checkpoint folder copied unchanged (config.json is rewritten).
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class QuantScheme:
    """Weight-only integer quantization of every linear layer not ignored."""

    bits: int = 4
    group_size: int | None = 128  # None: the channel strategy (one group per output row)
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"--bits {self.bits} is not supported (4 or 8)")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(
                f"--group-size {self.group_size} is not supported (a positive number of input "
                "columns, or -1 for one group per row)"
            )

    @property
    def strategy(self) -> str:
        return "channel" if self.group_size is None else "group"

    @property
    def q_min(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def q_max(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def describe(self) -> str:
        groups = "per channel" if self.group_size is None else f"group size {self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"INT{self.bits} {kind}, {groups}"


@dataclass
class QuantizedWeight:
    """One linear layer's quantized weight: w ≈ (q - zero_point) * scale, group by group."""

    q: torch.Tensor  # (out, in) int8, in [q_min, q_max]
    scale: torch.Tensor  # (out, groups), the model's dtype
    zero_point: torch.Tensor | None  # (out, groups) int8 (asymmetric), else None

    def dequantize(self) -> torch.Tensor:
        """-> (out, in) in the scale's dtype, computed as compressed-tensors' `dequantize`."""
        out, columns = self.q.shape
        groups = self.scale.shape[1]
        values = self.q.reshape(out, groups, columns // groups).to(self.scale.dtype)
        if self.zero_point is not None:
            values = values - self.zero_point.to(self.scale.dtype)[:, :, None]
        return (values * self.scale[:, :, None]).reshape(out, columns)


def compress(weight: QuantizedWeight, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """One quantized weight -> its checkpoint tensors, keyed by suffix (`weight_packed`, ...)."""
    offset = 1 << (scheme.bits - 1)
    out, columns = weight.q.shape
    tensors = {
        "weight_packed": pack_int32(weight.q.to(torch.int32) + offset, scheme.bits, dim=1),
        "weight_scale": weight.scale.contiguous(),
        "weight_shape": torch.tensor([out, columns], dtype=torch.int64),
    }
    if not scheme.symmetric:
        if weight.zero_point is None:
            raise ValueError("asymmetric quantization needs zero points")
        zero_point = weight.zero_point.to(torch.int32) + offset
        tensors["weight_zero_point"] = pack_int32(zero_point, scheme.bits, dim=0)
    return tensors


def quantization_config(scheme: QuantScheme, ignore: list[str]) -> dict[str, Any]:
    """The `quantization_config` entry of config.json, as compressed-tensors writes it."""
    weights = {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "group_size": scheme.group_size,
        "strategy": scheme.strategy,
        "dynamic": False,
        "observer": "minmax",
    }
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
    }


def write_checkpoint(
    out: str | Path,
    source: str | Path,
    tensors: dict[str, torch.Tensor],
    quantized: dict[str, QuantizedWeight],
    scheme: QuantScheme,
    ignore: list[str],
    untie_lm_head: bool = False,
) -> Path:
    """Write `out`/model.safetensors and config.json, and copy the tokenizer files and
    generation_config.json from `source`. `tensors`: the float tensors written as they are
    (checkpoint names); `quantized`: layer name (e.g. `model.layers.0.mlp.down_proj`) -> its
    quantized weight, written as the compressed tensors of that layer. `untie_lm_head`: the
    source ties its head to the embeddings and `quantized` holds a copy of it as `lm_head`: the
    written config says the two are separate (tie_word_embeddings false)."""
    from safetensors.torch import save_file

    out, source = Path(out), Path(source)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        state[name] = tensor.detach().contiguous()
    for layer, weight in quantized.items():
        if f"{layer}.weight" in state:
            raise ValueError(f"{layer}.weight is both quantized and written as it is")
        for suffix, tensor in compress(weight, scheme).items():
            state[f"{layer}.{suffix}"] = tensor
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = quantization_config(scheme, ignore)
    if untie_lm_head:
        config["tie_word_embeddings"] = False
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    for name in COPIED_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out
