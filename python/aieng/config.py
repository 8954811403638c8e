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

from aieng.quantization.config import QuantizationConfig, parse_quantization_config

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# Architectures whose `attention_bias` also puts a bias on o_proj, as in their HF modeling code
# (Qwen2 has q/k/v bias only, Mistral none); `mlp_bias` is read where HF reads it.
O_PROJ_BIAS_ARCHITECTURES = (
    "GraniteForCausalLM",
    "LlamaForCausalLM",
    "Olmo2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
)
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
    # longrope only: per-frequency divisors (head_dim / 2 each); `use_long_factor` says which
    # set rotates every position (long when max_position_embeddings > original)
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
        from aieng.models.registry import model_class

        model_class(architecture, source)
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
        is_qwen3 = architecture == "Qwen3ForCausalLM"
        is_mistral = architecture == "MistralForCausalLM"
        if is_qwen3:
            # Qwen3 sets head_dim independently of hidden_size / num_heads (HF default 128).
            head_dim = fields.positive_int("head_dim", default=128)
        else:
            head_dim = fields.positive_int("head_dim", default=hidden_size // num_heads)
        if fields.get("use_sliding_window", bool, default=False):
            raise ValueError(f"{source}: field 'use_sliding_window' = true is not supported")
        sliding_window = None
        if architecture == "MistralForCausalLM":
            sliding_window = fields.optional_positive_int("sliding_window")
        hidden_act = fields.get("hidden_act", str, default="silu")
        if hidden_act != "silu":
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
        attention_bias = not is_mistral and fields.get("attention_bias", bool, default=False)
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
            qk_norm=is_qwen3,
            qk_norm_across_heads=is_olmo2,
            post_norms=is_olmo2,
            norm_weight_in_float32=is_olmo2,
            no_rope_layers=_no_rope_layers(fields, architecture, num_layers),
            **_granite_multipliers(fields, architecture),
            sliding_window=sliding_window,
            rope=_rope_config(raw, source, max_positions, head_dim),
            dtype=dtype.removeprefix("torch."),
            bos_token_id=_optional_int(raw, "bos_token_id", source),
            eos_token_ids=_eos_token_ids(raw, generation, source, generation_source),
            generation_defaults=_generation_defaults(generation),
            quantization=quantization,
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


def _rope_config(raw: dict[str, Any], source: str, max_positions: int, head_dim: int) -> RopeConfig:
    """RoPE as transformers' rope utilities compute it (`_compute_*_parameters`), per type."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    name = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise ValueError(f"{source}: field '{name}' must be an object, got {params!r}")
    fields = _Fields(params, f"{source} ({name})")
    rope_type = params.get("rope_type") or params.get("type") or "default"
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
