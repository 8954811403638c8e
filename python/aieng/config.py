"""Model configuration read from a Hugging Face checkpoint folder.

`config.json` gives the architecture and shapes; `generation_config.json` (optional) gives the
end-of-sequence ids and the sampling defaults the model was published with. Both the old rope
form (`rope_theta` + `rope_scaling`) and the transformers-5 form (`rope_parameters`) are read.
A special token id (bos, eos) outside the vocabulary refuses the checkpoint at load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aieng.architectures import check_supported
from aieng.quantization.config import QuantizationConfig, parse_quantization_config

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# Architectures whose `attention_bias` also puts a bias on o_proj, as in their HF modeling code
# (Qwen2 has q/k/v bias only, Mistral none); `mlp_bias` is read where HF reads it.
O_PROJ_BIAS_ARCHITECTURES = (
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GraniteForCausalLM",
    "LlamaForCausalLM",
    "Olmo2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM",
)
# Architectures whose HF modeling code has no attention or MLP bias whatever the config says.
NO_BIAS_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
MLP_BIAS_ARCHITECTURES = ("GraniteForCausalLM", "LlamaForCausalLM", "SmolLM3ForCausalLM")
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
    # Gemma 2 and 3 (`_gemma_fields`; the √hidden embedding scale, (1 + w) norms and GeGLU are the
    # Gemma definition's own, `query_pre_attn_scalar` ** -0.5 is `attention_scale`): each layer's
    # sliding window (None on full_attention layers; empty: `sliding_window` on every layer),
    # Gemma 3's RoPE of the sliding layers (None: `rope` on every layer), and the soft-caps
    # cap * tanh(x / cap) of the attention scores and of the final logits (None: not capped).
    layer_sliding_windows: tuple[int | None, ...] = ()
    rope_local: RopeConfig | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{config_file}: not found (is {folder} a Hugging Face checkpoint?)")
        raw = _read_json(config_file)
        generation_file = folder / "generation_config.json"
        generation = _read_json(generation_file) if generation_file.is_file() else {}
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
        fields = _Fields(raw, source)
        architectures = fields.get("architectures", list)
        if not architectures or not isinstance(architectures[0], str):
            raise ValueError(f"{source}: field 'architectures' must name the model class")
        architecture = architectures[0]
        # The architecture first: an unsupported model is named as such, not by a missing field.
        check_supported(architecture, source)
        if architecture in GEMMA_DEFAULTS:  # absent fields take transformers' Gemma defaults
            raw = {**GEMMA_DEFAULTS[architecture], **raw}
            fields = _Fields(raw, source)
        quantization = parse_quantization_config(raw.get("quantization_config"), source)
        hidden_size = fields.positive_int("hidden_size")
        num_heads = fields.positive_int("num_attention_heads")
        num_kv_heads = fields.positive_int("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{source}: field 'num_key_value_heads' ({num_kv_heads}) must divide "
                f"'num_attention_heads' ({num_heads})"
            )
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        is_qwen3 = architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        if architecture == "Qwen3ForCausalLM":
            # Qwen3 sets head_dim independently of hidden_size / num_heads (HF default 128).
            head_dim = fields.positive_int("head_dim", default=128)
        else:
            head_dim = fields.positive_int("head_dim", default=hidden_size // num_heads)
        if fields.get("use_sliding_window", bool, default=False):
            raise ValueError(f"{source}: field 'use_sliding_window' = true is not supported")
        sliding_window = None
        if architecture in SLIDING_WINDOW_ARCHITECTURES:
            sliding_window = fields.optional_positive_int("sliding_window")
        hidden_act = fields.get("hidden_act", str, default="silu")
        # Gemma's activation is `hidden_activation` (`_gemma_fields`); HF ignores its hidden_act.
        if hidden_act != "silu" and architecture not in GEMMA_DEFAULTS:
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
        # HF Mistral has no attention/MLP biases whatever the config says; Qwen2 always has q/k/v.
        attention_bias = architecture not in NO_BIAS_ARCHITECTURES and fields.get(
            "attention_bias", bool, default=False
        )
        has_o_bias = attention_bias and architecture in O_PROJ_BIAS_ARCHITECTURES
        mlp_bias = architecture in MLP_BIAS_ARCHITECTURES and fields.get(
            "mlp_bias", bool, default=False
        )
        is_olmo2 = architecture == "Olmo2ForCausalLM"
        num_layers = fields.positive_int("num_hidden_layers")
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
            max_position_embeddings=max_positions,
            tie_word_embeddings=fields.get("tie_word_embeddings", bool, default=False),
            attention_bias=is_qwen2 or attention_bias,
            o_proj_bias=has_o_bias,
            mlp_bias=mlp_bias,
            qk_norm=is_qwen3 or architecture == "Gemma3ForCausalLM",
            qk_norm_across_heads=is_olmo2,
            post_norms=is_olmo2 or architecture in GEMMA_DEFAULTS,  # Gemma: pre- and post-norms
            norm_weight_in_float32=is_olmo2,
            no_rope_layers=_no_rope_layers(fields, architecture, num_layers),
            **_granite_multipliers(fields, architecture),
            **_gemma_fields(fields, architecture, num_layers, max_positions, head_dim),
            sliding_window=sliding_window,
            rope=_rope_config(
                _gemma3_rope(raw, source, architecture, "full_attention"),
                source,
                max_positions,
                head_dim,
                architecture,
            ),
            dtype=dtype.removeprefix("torch."),
            bos_token_id=_optional_int(raw, "bos_token_id", source),
            eos_token_ids=_eos_token_ids(raw, generation, source, generation_source),
            generation_defaults=_generation_defaults(generation),
            quantization=quantization,
            **_moe_fields(fields, architecture, num_layers),
        )


def _moe_fields(fields: _Fields, architecture: str, num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE (`num_experts`, `decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`) and
    Mixtral (`num_local_experts`, every layer sparse, weights always renormalised)."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`; read either.
    key = "num_experts" if fields.raw.get("num_experts") is not None else "num_local_experts"
    num_experts = fields.positive_int(key)
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(
            f"{fields.source}: field 'num_experts_per_tok' ({top_k}) exceeds '{key}' "
            f"({num_experts})"
        )
    if architecture == "MixtralForCausalLM":
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=fields.positive_int("intermediate_size"),
            norm_topk_prob=True,
            moe_layers=tuple(range(num_layers)),
        )
    step = fields.positive_int("decoder_sparse_step", default=1)
    dense = fields.raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense
    ):
        raise ValueError(
            f"{fields.source}: field 'mlp_only_layers' must be a list of layer indices, "
            f"got {dense!r}"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields.positive_int("moe_intermediate_size"),
        norm_topk_prob=fields.get("norm_topk_prob", bool, default=False),
        moe_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
    )


def _no_rope_layers(fields: _Fields, architecture: str, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's `no_rope_layers` is a 0/1 list per layer, 1 where the layer *uses* RoPE (as HF
    reads it); without it every `no_rope_layer_interval`-th layer (1-based) goes without."""
    if architecture != "SmolLM3ForCausalLM":
        return ()
    flags = fields.raw.get("no_rope_layers")
    if flags is None:
        interval = fields.positive_int("no_rope_layer_interval", default=4)
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if (
        not isinstance(flags, list)
        or len(flags) != num_layers
        or any(f not in (0, 1) or isinstance(f, float) for f in flags)
    ):
        raise ValueError(
            f"{fields.source}: field 'no_rope_layers' must be {num_layers} entries of 0 or 1 "
            f"(one per layer), got {flags!r}"
        )
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def _granite_multipliers(fields: _Fields, architecture: str) -> dict[str, Any]:
    if architecture != "GraniteForCausalLM":
        return {}
    return dict(
        embedding_multiplier=fields.get("embedding_multiplier", float, default=1.0),
        residual_multiplier=fields.get("residual_multiplier", float, default=1.0),
        attention_scale=fields.positive_float("attention_multiplier", default=1.0),
        logits_scaling=fields.positive_float("logits_scaling", default=1.0),
    )


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


def _gemma_fields(
    fields: _Fields, architecture: str, num_layers: int, max_positions: int, head_dim: int
) -> dict[str, Any]:
    """Gemma 2 and 3 as transformers reads them: GELU-tanh only, the scale
    `query_pre_attn_scalar` ** -0.5, `sliding_window` on the sliding_attention layers
    (`layer_types`, else every `sliding_window_pattern`-th layer global: 2 for Gemma 2, default 6
    for Gemma 3), Gemma 3's local RoPE, the soft-caps (HF's Gemma 3 attention never applies
    `attn_logit_softcapping`, so neither does aieng)."""
    if architecture not in GEMMA_DEFAULTS:
        return {}
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
    local = _gemma3_rope(fields.raw, source, architecture, "sliding_attention")
    return dict(
        layer_sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        attention_scale=fields.positive_float("query_pre_attn_scalar") ** -0.5,
        rope_local=_rope_config(local, source, max_positions, head_dim) if is_gemma3 else None,
        **caps,
    )


def _gemma3_rope(
    raw: dict[str, Any], source: str, architecture: str, layer_type: str
) -> dict[str, Any]:
    """Gemma 3 keys its RoPE by layer type: `rope_parameters.full_attention` and
    `.sliding_attention`, or in older configs `rope_theta` + `rope_scaling` for the global layers
    and `rope_local_base_freq` for the sliding ones (defaults 1e6 and 1e4, as Gemma3TextConfig)
    -> `raw` with `layer_type`'s parameters as a flat `rope_parameters`, which `_rope_config`
    reads. Other architectures' `raw` comes back unchanged."""
    if architecture != "Gemma3ForCausalLM":
        return raw
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


class _Fields:
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _rope_config(
    raw: dict[str, Any], source: str, max_positions: int, head_dim: int, architecture: str = ""
) -> RopeConfig:
    """RoPE as transformers' rope utilities compute it (`_compute_*_parameters`), per type."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    name = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise ValueError(f"{source}: field '{name}' must be an object, got {params!r}")
    fields = _Fields(params, f"{source} ({name})")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if architecture == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # early Phi-3 configs' names for it, as transformers reads them
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
    theta = _Fields({"rope_theta": theta}, source).positive_float("rope_theta")
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
        original = _Fields(raw, source).positive_int("original_max_position_embeddings")
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
