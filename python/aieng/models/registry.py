"""Architecture name (config.json `architectures[0]`) -> model class, by the family
`aieng.architectures` names for it."""

from torch import nn

from aieng.architectures import ARCHITECTURE_FAMILIES, check_supported
from aieng.models.gemma import GemmaForCausalLM
from aieng.models.llama import LlamaForCausalLM

FAMILY_CLASSES: dict[str, type[nn.Module]] = {
    "gemma": GemmaForCausalLM,
    "llama": LlamaForCausalLM,
}
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    architecture: FAMILY_CLASSES[family] for architecture, family in ARCHITECTURE_FAMILIES.items()
}


def model_class(architecture: str, source: str = "config.json") -> type[nn.Module]:
    return FAMILY_CLASSES[check_supported(architecture, source)]
