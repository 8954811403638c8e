"""Reading a Hugging Face `config.json`: typed fields with errors that name the file and the
field, and RoPE as transformers computes it. Shared by the generic part of `ModelConfig`
(`aieng.config.model_config`) and the architecture families' own parsers
(`aieng.config.model_configs`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3 scaling only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # llama3, yarn and longrope: the context the model was pretrained with
    original_max_position_embeddings: int = 8192
    # yarn and longrope: cos and sin are multiplied by this (resolved from mscale etc. at load)
    attention_factor: float = 1.0
    # yarn only: the rotation counts that bound the interpolation ramp
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # longrope only: per-frequency divisors (head_dim / 2 each); `use_long_factor`: positions
    # from the original context on rotate with the long factors (max_position_embeddings >
    # original), the others always with the short ones
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    use_long_factor: bool = False
    # dynamic only: the context the base is rescaled against (max_position_embeddings)
    max_position_embeddings: int = 2048


class Fields:
    """Typed access to config.json fields with errors that name the file and the field."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def get(self, name: str, kind: type, default: Any = None) -> Any:
        value = self.raw.get(name)
        if value is None:
            if default is None:
                raise ValueError(f"{self.source}: missing field '{name}'")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(
                f"{self.source}: field '{name}' must be {kind.__name__}, got {value!r}"
            )
        return value

    def positive_int(self, name: str, default: int | None = None) -> int:
        value = self.get(name, int, default)
        if value <= 0:
            raise ValueError(f"{self.source}: field '{name}' must be positive, got {value}")
        return value

    def optional_positive_int(self, name: str) -> int | None:
        return None if self.raw.get(name) is None else self.positive_int(name)

    def positive_float(self, name: str, default: float | None = None) -> float:
        value = self.get(name, float, default)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{self.source}: field '{name}' must be positive, got {value}")
        return value


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def rope_config(
    raw: dict[str, Any],
    source: str,
    max_positions: int,
    head_dim: int,
    type_aliases: Mapping[str, str] | None = None,
) -> RopeConfig:
    """RoPE as transformers' rope utilities compute it (`_compute_*_parameters`), per type."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    name = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise ValueError(f"{source}: field '{name}' must be an object, got {params!r}")
    fields = Fields(params, f"{source} ({name})")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = (type_aliases or {}).get(rope_type, rope_type)  # a family's own names
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{source}: field '{name}.rope_type' = {rope_type!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise ValueError(
            f"{source}: field 'partial_rotary_factor' = {partial!r} is not supported "
            "(RoPE over the whole head only)"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    theta = Fields({"rope_theta": theta}, source).positive_float("rope_theta")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=fields.positive_float("factor"))
    if rope_type == "dynamic":
        return RopeConfig(
            theta=theta,
            type="dynamic",
            factor=fields.positive_float("factor"),
            max_position_embeddings=max_positions,
        )
    # As in transformers, a top-level `original_max_position_embeddings` (Phi-3) takes priority.
    original = raw.get("original_max_position_embeddings")
    if original is not None:
        original = Fields(raw, source).positive_int("original_max_position_embeddings")
    else:
        original = fields.positive_int("original_max_position_embeddings", default=max_positions)
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta,
            type="llama3",
            factor=fields.positive_float("factor"),
            low_freq_factor=fields.positive_float("low_freq_factor"),
            high_freq_factor=fields.positive_float("high_freq_factor"),
            original_max_position_embeddings=original,
        )
    # yarn and longrope: without `factor`, the ratio of the contexts (as transformers does).
    factor = (
        fields.positive_float("factor")
        if params.get("factor") is not None
        else max_positions / original
    )
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = fields.positive_float("attention_factor")
    if rope_type == "yarn":
        if attention_factor is None:
            mscale = params.get("mscale") and fields.positive_float("mscale")
            mscale_all_dim = params.get("mscale_all_dim") and fields.positive_float(
                "mscale_all_dim"
            )
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(
                    factor, mscale_all_dim
                )
            else:
                attention_factor = _yarn_mscale(factor, 1.0)
        truncate = fields.get("truncate", bool, default=True)
        return RopeConfig(
            theta=theta,
            type="yarn",
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=float(attention_factor),
            # transformers treats 0 / absent as the paper's defaults (32 and 1)
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=truncate,
        )
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = fields.get(key, list)
        if len(value) != head_dim // 2 or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value
        ):
            raise ValueError(
                f"{source} ({name}): field '{key}' must be {head_dim // 2} positive numbers "
                f"(head_dim / 2), got {value!r}"
            )
        factors[key] = tuple(float(v) for v in value)
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeConfig(
        theta=theta,
        type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        use_long_factor=max_positions > original,
        **factors,
    )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
