"""Architecture name (config.json `architectures[0]`) -> model class, by the family its spec
names (`aieng.config.model_configs`)."""

from torch import nn

from aieng.config.model_configs import ARCHITECTURES, spec_of
from aieng.models.bert import BertModel
from aieng.models.gemma import GemmaForCausalLM
from aieng.models.llama import LlamaForCausalLM
from aieng.models.llama_embedding import LlamaForEmbedding

FAMILY_CLASSES: dict[str, type[nn.Module]] = {
    "bert": BertModel,
    "gemma": GemmaForCausalLM,
    "llama": LlamaForCausalLM,
    "llama_embedding": LlamaForEmbedding,
}
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    architecture: FAMILY_CLASSES[spec.family] for architecture, spec in ARCHITECTURES.items()
}


def model_class(architecture: str, source: str = "config.json") -> type[nn.Module]:
    return FAMILY_CLASSES[spec_of(architecture, source).family]
