"""What an architecture (config.json `architectures[0]`) is to aieng: an `ArchitectureSpec` each
model family declares for its architectures (`aieng.config.model_configs`), read by `ModelConfig`'s
generic parser instead of testing architecture names, and by the model registry for the class."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParseContext:
    """What a family's own parser gets besides the fields: the values already read."""

    architecture: str
    source: str
    num_layers: int
    max_positions: int
    head_dim: int


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one architecture's config.json reads, as its HF modeling code reads it."""

    family: str  # the module of aieng.models that implements it
    # config.json fields it may leave out, with transformers' defaults for them
    defaults: Mapping[str, Any] = field(default_factory=dict)
    qkv_bias: str = "config"  # "config": `attention_bias`; "always" (Qwen2); "never"
    o_proj_bias: bool = False  # `attention_bias` also puts a bias on o_proj
    mlp_bias: bool = False  # reads `mlp_bias`
    sliding_window: bool = False  # reads `sliding_window` (one window on every layer)
    head_dim_default: int | None = None  # head_dim when absent (None: hidden / heads)
    silu_only: bool = True  # `hidden_act` must be silu (False: the family checks its own)
    qk_norm: bool = False
    qk_norm_across_heads: bool = False
    post_norms: bool = False
    norm_weight_in_float32: bool = False
    rope_type_aliases: Mapping[str, str] = field(default_factory=dict)
    # The global layers' RoPE parameters out of raw (Gemma 3 keys them by layer type).
    rope_source: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    # The family's own fields (MoE, multipliers, windows per layer...): -> ModelConfig fields.
    extra_fields: tuple[Callable[[Any, ParseContext], dict[str, Any]], ...] = ()
