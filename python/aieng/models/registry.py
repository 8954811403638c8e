"""Architecture name (config.json `architectures[0]`) -> model class."""

from torch import nn

from aieng.models.gemma import GemmaForCausalLM
from aieng.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str, source: str = "config.json") -> type[nn.Module]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"{source}: architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(MODEL_CLASSES))})"
        ) from None
