"""The architecture registry: every family's `ArchitectureSpec`s, by architecture name. A new
family adds its module here; `ModelConfig` and the model registry read nothing else."""

from __future__ import annotations

from aieng.config.architectures import ArchitectureSpec
from aieng.config.model_configs import bert_family, gemma_family, llama_family

ARCHITECTURES: dict[str, ArchitectureSpec] = {
    **llama_family.SPECS,
    **gemma_family.SPECS,
    **bert_family.SPECS,
}


def spec_of(architecture: str, source: str = "config.json") -> ArchitectureSpec:
    """The spec of `architecture`; ValueError naming the supported ones otherwise."""
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"{source}: architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        ) from None
