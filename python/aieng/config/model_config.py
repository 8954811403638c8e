"""Model configuration read from a Hugging Face checkpoint folder.

`config.json` gives the architecture and shapes; `generation_config.json` (optional) gives the
end-of-sequence ids and the sampling defaults the model was published with. Both the old rope
form (`rope_theta` + `rope_scaling`) and the transformers-5 form (`rope_parameters`) are read.
A special token id (bos, eos) outside the vocabulary refuses the checkpoint at load.

This module reads what every architecture shares; what differs between architectures comes from
the spec each model family declares (`aieng.config.model_configs`): no architecture name is
tested here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aieng.config.architectures import ParseContext
from aieng.config.fields import Fields, RopeConfig, read_json, rope_config
from aieng.config.model_configs import spec_of
from aieng.config.quantization import QuantizationConfig, parse_quantization_config

__all__ = ["ModelConfig", "RopeConfig"]

# Defaults from generation_config.json that map onto SamplingParams fields (vLLM reads the same).
GENERATION_DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always has it)
    o_proj_bias: bool = False  # bias on o_proj (`attention_bias` but for Qwen2 and Mistral)
    mlp_bias: bool = False  # bias on gate/up/down (Llama, Granite, SmolLM3 `mlp_bias`)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # OLMo 2: RMSNorm over the whole q and k projections (all heads at once) before RoPE, and
    # the layer's norms applied to the attention and MLP outputs instead of their inputs.
    qk_norm_across_heads: bool = False
    post_norms: bool = False
    norm_weight_in_float32: bool = False  # OLMo 2's RMSNorm: weight * x in float32, then cast
    no_rope_layers: tuple[int, ...] = ()  # layers that attend without RoPE (SmolLM3)
    # Granite: the embeddings and each residual branch are multiplied, the attention softmax
    # scale replaces head_dim ** -0.5 (None keeps it), and the logits are divided.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    quantization: QuantizationConfig | None = None  # from `quantization_config`
    # Mixture-of-experts (Qwen3-MoE, Mixtral): the layers in `moe_layers` replace their MLP with
    # `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` chosen per token;
    # `norm_topk_prob` renormalises the chosen experts' weights to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    moe_checkpoint_names: str = ""  # "mixtral": block_sparse_moe.experts.*.w1/w2/w3
    # Gemma 2 and 3 (`_gemma_fields`; the √hidden embedding scale, (1 + w) norms and GeGLU are the
    # Gemma definition's own, `query_pre_attn_scalar` ** -0.5 is `attention_scale`): each layer's
    # sliding window (None on full_attention layers; empty: `sliding_window` on every layer),
    # Gemma 3's RoPE of the sliding layers (None: `rope` on every layer), and the soft-caps
    # cap * tanh(x / cap) of the attention scores and of the final logits (None: not capped).
    layer_sliding_windows: tuple[int | None, ...] = ()
    rope_local: RopeConfig | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Encoder-only models (the BERT family, `aieng.models.bert`): bidirectional attention, no KV
    # cache, they only embed. LayerNorm's epsilon, the token-type vocabulary, and the offset of
    # the first position (RoBERTa counts positions from pad_token_id + 1).
    is_encoder: bool = False
    # No LM head: an encoder, or a bare decoder saved for embeddings (Qwen3Model): embeds only.
    embeds_only: bool = False
    hidden_act: str = "silu"  # the encoder MLP's: "gelu" (erf) or "gelu_tanh"
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    position_offset: int = 0

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{config_file}: not found (is {folder} a Hugging Face checkpoint?)")
        raw = read_json(config_file)
        generation_file = folder / "generation_config.json"
        generation = read_json(generation_file) if generation_file.is_file() else {}
        return cls.from_dicts(
            raw, generation, source=str(config_file), generation_source=str(generation_file)
        )

    @classmethod
    def from_dicts(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any] | None = None,
        source: str = "config.json",
        generation_source: str = "generation_config.json",
    ) -> ModelConfig:
        fields = Fields(raw, source)
        architectures = fields.get("architectures", list)
        if not architectures or not isinstance(architectures[0], str):
            raise ValueError(f"{source}: field 'architectures' must name the model class")
        architecture = architectures[0]
        # The architecture first: an unsupported model is named as such, not by a missing field.
        spec = spec_of(architecture, source)
        if spec.defaults:  # absent fields take transformers' defaults for the architecture
            raw = {**spec.defaults, **raw}
            fields = Fields(raw, source)
        quantization = parse_quantization_config(raw.get("quantization_config"), source)
        hidden_size = fields.positive_int("hidden_size")
        num_heads = fields.positive_int("num_attention_heads")
        num_kv_heads = fields.positive_int("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{source}: field 'num_key_value_heads' ({num_kv_heads}) must divide "
                f"'num_attention_heads' ({num_heads})"
            )
        head_dim = fields.positive_int(
            "head_dim", default=spec.head_dim_default or hidden_size // num_heads
        )
        if fields.get("use_sliding_window", bool, default=False):
            raise ValueError(f"{source}: field 'use_sliding_window' = true is not supported")
        sliding_window = None
        if spec.sliding_window:
            sliding_window = fields.optional_positive_int("sliding_window")
        hidden_act = fields.get("hidden_act", str, default="silu")
        if hidden_act != "silu" and spec.silu_only:
            raise ValueError(
                f"{source}: field 'hidden_act' = {hidden_act!r} is not supported (only 'silu' is)"
            )
        max_positions = fields.positive_int("max_position_embeddings", default=2048)
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if not isinstance(dtype, str):
            raise ValueError(f"{source}: field 'torch_dtype' must be a string, got {dtype!r}")
        generation = generation or {}
        vocab_size = fields.positive_int("vocab_size")
        for where, data in ((source, raw), (generation_source, generation)):
            _check_special_ids(data, where, vocab_size)
        # Biases as the architecture's HF code has them: `attention_bias` (q/k/v, and o_proj
        # where the code puts one there too), always (Qwen2's q/k/v) or never (Mistral).
        config_bias = spec.qkv_bias != "never" and fields.get("attention_bias", bool, default=False)
        mlp_bias = spec.mlp_bias and fields.get("mlp_bias", bool, default=False)
        num_layers = fields.positive_int("num_hidden_layers")
        context = ParseContext(architecture, source, num_layers, max_positions, head_dim)
        family_fields: dict[str, Any] = {}
        for parse in spec.extra_fields:
            family_fields.update(parse(fields, context))
        global_rope = spec.rope_source(raw, source) if spec.rope_source else raw
        return cls(
            architecture=architecture,
            model_type=fields.get("model_type", str, default=""),
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=fields.positive_int("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.positive_float("rms_norm_eps", default=1e-6),
            max_position_embeddings=family_fields.pop("max_position_embeddings", max_positions),
            tie_word_embeddings=fields.get("tie_word_embeddings", bool, default=False),
            attention_bias=spec.qkv_bias == "always" or config_bias,
            o_proj_bias=config_bias and spec.o_proj_bias,
            mlp_bias=mlp_bias,
            qk_norm=spec.qk_norm,
            qk_norm_across_heads=spec.qk_norm_across_heads,
            post_norms=spec.post_norms,
            norm_weight_in_float32=spec.norm_weight_in_float32,
            sliding_window=sliding_window,
            rope=rope_config(global_rope, source, max_positions, head_dim, spec.rope_type_aliases),
            dtype=dtype.removeprefix("torch."),
            bos_token_id=_optional_int(raw, "bos_token_id", source),
            eos_token_ids=_eos_token_ids(raw, generation, source, generation_source),
            generation_defaults=_generation_defaults(generation),
            quantization=quantization,
            **family_fields,
        )


def _optional_int(raw: dict[str, Any], name: str, source: str) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source}: field '{name}' must be an integer, got {value!r}")
    return value


def _check_special_ids(data: dict[str, Any], where: str, vocab_size: int) -> None:
    """A special token id outside the vocabulary would index past the model's logits."""
    for name in ("bos_token_id", "eos_token_id"):
        value = data.get(name)
        ids = value if isinstance(value, list) else [value]
        bad = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= vocab_size]
        if bad:
            raise ValueError(
                f"{where}: field '{name}' = {value!r}: token id {bad[0]} is outside the "
                f"model's vocabulary (vocab_size {vocab_size})"
            )


def _eos_token_ids(
    raw: dict[str, Any], generation: dict[str, Any], source: str, generation_source: str
) -> tuple[int, ...]:
    # generation_config.json takes precedence, as in transformers.
    for where, data in ((generation_source, generation), (source, raw)):
        value = data.get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(
                f"{where}: field 'eos_token_id' must be an int or a list of ints, got {value!r}"
            )
        return tuple(ids)
    return ()


def _generation_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    return {
        ours: generation[theirs]
        for theirs, ours in GENERATION_DEFAULT_FIELDS.items()
        if generation.get(theirs) is not None
    }
