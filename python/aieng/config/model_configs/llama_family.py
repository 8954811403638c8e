"""The architectures `aieng.models.llama` implements, and how each one's config.json reads:
Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, Granite, OLMo 2, SmolLM3."""

from __future__ import annotations

import dataclasses
from typing import Any

from aieng.config.architectures import ArchitectureSpec, ParseContext
from aieng.config.fields import Fields


def mixtral_experts(fields: Fields, ctx: ParseContext) -> dict[str, Any]:
    """Mixtral: `num_local_experts` experts of `intermediate_size` on every layer, the chosen
    experts' weights always renormalised; checkpoint names `block_sparse_moe.experts.*.w1..w3`."""
    num_experts, top_k = _experts(fields)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields.positive_int("intermediate_size"),
        norm_topk_prob=True,
        moe_layers=tuple(range(ctx.num_layers)),
        moe_checkpoint_names="mixtral",
    )


def qwen3_moe_experts(fields: Fields, ctx: ParseContext) -> dict[str, Any]:
    """Qwen3-MoE: `num_experts` of `moe_intermediate_size` on every `decoder_sparse_step`-th
    layer not in `mlp_only_layers`; `norm_topk_prob` as given."""
    num_experts, top_k = _experts(fields)
    step = fields.positive_int("decoder_sparse_step", default=1)
    dense = fields.raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise ValueError(
            f"{fields.source}: field 'mlp_only_layers' must be a list of layer indices, "
            f"got {dense!r}"
        )
    layers = range(ctx.num_layers)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields.positive_int("moe_intermediate_size"),
        norm_topk_prob=fields.get("norm_topk_prob", bool, default=False),
        moe_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
    )


def _experts(fields: Fields) -> tuple[int, int]:
    # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`; read either.
    key = "num_experts" if fields.raw.get("num_experts") is not None else "num_local_experts"
    num_experts = fields.positive_int(key)
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(
            f"{fields.source}: field 'num_experts_per_tok' ({top_k}) exceeds '{key}' "
            f"({num_experts})"
        )
    return num_experts, top_k


def smollm3_no_rope_layers(fields: Fields, ctx: ParseContext) -> dict[str, Any]:
    """SmolLM3's `no_rope_layers` is a 0/1 list per layer, 1 where the layer *uses* RoPE (as HF
    reads it); without it every `no_rope_layer_interval`-th layer (1-based) goes without."""
    num_layers = ctx.num_layers
    flags = fields.raw.get("no_rope_layers")
    if flags is None:
        interval = fields.positive_int("no_rope_layer_interval", default=4)
        return dict(no_rope_layers=tuple(i for i in range(num_layers) if (i + 1) % interval == 0))
    if (
        not isinstance(flags, list)
        or len(flags) != num_layers
        or any(f not in (0, 1) or isinstance(f, float) for f in flags)
    ):
        raise ValueError(
            f"{fields.source}: field 'no_rope_layers' must be {num_layers} entries of 0 or 1 "
            f"(one per layer), got {flags!r}"
        )
    return dict(no_rope_layers=tuple(i for i, uses_rope in enumerate(flags) if not uses_rope))


def granite_multipliers(fields: Fields, ctx: ParseContext) -> dict[str, Any]:
    return dict(
        embedding_multiplier=fields.get("embedding_multiplier", float, default=1.0),
        residual_multiplier=fields.get("residual_multiplier", float, default=1.0),
        attention_scale=fields.positive_float("attention_multiplier", default=1.0),
        logits_scaling=fields.positive_float("logits_scaling", default=1.0),
    )


# HF Mistral, Mixtral and Phi-3 have no attention or MLP biases whatever the config says, and
# read one sliding window for every layer.
_WINDOWED = dict(qkv_bias="never", sliding_window=True)

SPECS: dict[str, ArchitectureSpec] = {
    "LlamaForCausalLM": ArchitectureSpec("llama", o_proj_bias=True, mlp_bias=True),
    "MistralForCausalLM": ArchitectureSpec("llama", **_WINDOWED),
    "MixtralForCausalLM": ArchitectureSpec("llama", **_WINDOWED, extra_fields=(mixtral_experts,)),
    "Phi3ForCausalLM": ArchitectureSpec(
        "llama",
        **_WINDOWED,
        # early Phi-3 configs' names for longrope, as transformers reads them
        rope_type_aliases={"su": "longrope", "yarn": "longrope"},
    ),
    "Qwen2ForCausalLM": ArchitectureSpec("llama", qkv_bias="always"),
    # Qwen3 sets head_dim independently of hidden_size / num_heads (HF default 128).
    "Qwen3ForCausalLM": ArchitectureSpec(
        "llama", o_proj_bias=True, qk_norm=True, head_dim_default=128
    ),
    "Qwen3MoeForCausalLM": ArchitectureSpec(
        "llama", o_proj_bias=True, qk_norm=True, extra_fields=(qwen3_moe_experts,)
    ),
    "GraniteForCausalLM": ArchitectureSpec(
        "llama", o_proj_bias=True, mlp_bias=True, extra_fields=(granite_multipliers,)
    ),
    # OLMo 2: RMSNorm over the whole q and k projections, the norms after the attention and
    # the MLP, weight * x in float32.
    "Olmo2ForCausalLM": ArchitectureSpec(
        "llama",
        o_proj_bias=True,
        qk_norm_across_heads=True,
        post_norms=True,
        norm_weight_in_float32=True,
    ),
    "SmolLM3ForCausalLM": ArchitectureSpec(
        "llama", o_proj_bias=True, mlp_bias=True, extra_fields=(smollm3_no_rope_layers,)
    ),
}


def _embeds_only(fields: Fields, ctx: ParseContext) -> dict[str, Any]:
    return dict(embeds_only=True)


# The bare decoders embedding checkpoints save (Qwen3-Embedding's Qwen3Model): tensors without
# the `model.` prefix, no LM head; they embed only (`aieng.models.llama_embedding`).
SPECS.update(
    {
        name.removesuffix("ForCausalLM") + "Model": dataclasses.replace(
            SPECS[name],
            family="llama_embedding",
            extra_fields=(*SPECS[name].extra_fields, _embeds_only),
        )
        for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    }
)
