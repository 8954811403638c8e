"""The architectures aieng serves (config.json `architectures[0]`) and the model family — the
module of `aieng.models` — that implements each. The one list: `ModelConfig` refuses a name not
in it before reading any other field, and `aieng.models.registry` maps each family to its class."""

from __future__ import annotations

ARCHITECTURE_FAMILIES: dict[str, str] = {
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "GraniteForCausalLM": "llama",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Olmo2ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "SmolLM3ForCausalLM": "llama",
}


def check_supported(architecture: str, source: str = "config.json") -> str:
    """The family of `architecture`; ValueError naming the supported ones otherwise."""
    try:
        return ARCHITECTURE_FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"{source}: architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURE_FAMILIES))})"
        ) from None
