"""The architectures `aieng.models.gemma` implements — Gemma 2 and Gemma 3 (text) — and how
their config.json reads (transformers' Gemma2Config / Gemma3TextConfig)."""

from __future__ import annotations

from typing import Any

from aieng.config.architectures import ArchitectureSpec, ParseContext
from aieng.config.fields import Fields, rope_config

# Gemma 2 and Gemma 3 (text): transformers' Gemma2Config / Gemma3TextConfig defaults, which a
# config.json that leaves a field out gets.
_GEMMA_COMMON = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)


GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": dict(
        _GEMMA_COMMON,
        vocab_size=256000,
        max_position_embeddings=8192,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "Gemma3ForCausalLM": dict(_GEMMA_COMMON, vocab_size=262208, max_position_embeddings=131072),
}


GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_fields(fields: Fields, ctx: ParseContext) -> dict[str, Any]:
    """Gemma 2 and 3 as transformers reads them: GELU-tanh only, the scale
    `query_pre_attn_scalar` ** -0.5, `sliding_window` on the sliding_attention layers
    (`layer_types`, else every `sliding_window_pattern`-th layer global: 2 for Gemma 2, default 6
    for Gemma 3), Gemma 3's local RoPE, the soft-caps (HF's Gemma 3 attention never applies
    `attn_logit_softcapping`, so neither does aieng)."""
    architecture, num_layers = ctx.architecture, ctx.num_layers
    max_positions, head_dim = ctx.max_positions, ctx.head_dim
    source = fields.source
    activation = fields.get("hidden_activation", str)
    if activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"{source}: field 'hidden_activation' = {activation!r} is not supported "
            "(only 'gelu_pytorch_tanh' is)"
        )
    if fields.raw.get("use_bidirectional_attention"):
        raise ValueError(
            f"{source}: field 'use_bidirectional_attention' = true is not supported "
            "(causal attention only)"
        )
    is_gemma3 = architecture == "Gemma3ForCausalLM"
    types = fields.raw.get("layer_types")
    if types is None:
        pattern = fields.positive_int("sliding_window_pattern", default=6) if is_gemma3 else 2
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    elif (
        not isinstance(types, list)
        or len(types) != num_layers
        or any(t not in GEMMA_LAYER_TYPES for t in types)
    ):
        raise ValueError(
            f"{source}: field 'layer_types' must be {num_layers} entries (one per layer) of "
            f"{' or '.join(map(repr, GEMMA_LAYER_TYPES))}, got {types!r}"
        )
    window = fields.positive_int("sliding_window")  # null refused: the sliding layers need one
    caps = {
        name: None if fields.raw.get(name) is None else fields.positive_float(name)
        for name in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    if is_gemma3:
        caps["attn_logit_softcapping"] = None
    local = _gemma3_rope(fields.raw, source, "sliding_attention") if is_gemma3 else None
    return dict(
        layer_sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        attention_scale=fields.positive_float("query_pre_attn_scalar") ** -0.5,
        rope_local=rope_config(local, source, max_positions, head_dim) if local else None,
        **caps,
    )


def gemma3_global_rope(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The global (full_attention) layers' RoPE parameters of a Gemma 3 config."""
    return _gemma3_rope(raw, source, "full_attention")


def _gemma3_rope(raw: dict[str, Any], source: str, layer_type: str) -> dict[str, Any]:
    """Gemma 3 keys its RoPE by layer type: `rope_parameters.full_attention` and
    `.sliding_attention`, or in older configs `rope_theta` + `rope_scaling` for the global layers
    and `rope_local_base_freq` for the sliding ones (defaults 1e6 and 1e4, as Gemma3TextConfig)
    -> `raw` with `layer_type`'s parameters as a flat `rope_parameters`, which `rope_config`
    reads."""
    nested = raw.get("rope_parameters") or {}
    if not isinstance(nested, dict) or not set(nested) <= set(GEMMA_LAYER_TYPES):
        raise ValueError(
            f"{source}: field 'rope_parameters' must be keyed by layer type "
            f"({', '.join(GEMMA_LAYER_TYPES)}), got {nested!r}"
        )
    params = nested.get(layer_type) or {"rope_type": "default"}
    scaling = raw.get("rope_scaling")
    if not isinstance(params, dict) or not isinstance(scaling, dict | None):
        bad = f"rope_parameters.{layer_type}" if not isinstance(params, dict) else "rope_scaling"
        raise ValueError(f"{source}: field '{bad}' must be an object")
    params = dict(params)
    if layer_type == "full_attention":
        params.update(scaling or {})
        params.setdefault("rope_theta", raw.get("rope_theta") or 1_000_000.0)
    else:
        params.setdefault("rope_theta", raw.get("rope_local_base_freq") or 10_000.0)
    return {**raw, "rope_parameters": params}


# Gemma: pre- and post-norms, GELU-tanh (checked by gemma_fields, not hidden_act), biases as
# `attention_bias` says (o_proj too).
_GEMMA = dict(o_proj_bias=True, silu_only=False, post_norms=True, extra_fields=(gemma_fields,))

SPECS: dict[str, ArchitectureSpec] = {
    "Gemma2ForCausalLM": ArchitectureSpec(
        "gemma", defaults=GEMMA_DEFAULTS["Gemma2ForCausalLM"], **_GEMMA
    ),
    "Gemma3ForCausalLM": ArchitectureSpec(
        "gemma",
        defaults=GEMMA_DEFAULTS["Gemma3ForCausalLM"],
        qk_norm=True,
        rope_source=gemma3_global_rope,
        **_GEMMA,
    ),
}
