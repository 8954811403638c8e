"""A bare Llama-family decoder as embedding checkpoints save it (Qwen3-Embedding's `Qwen3Model`,
`Qwen2Model`, `LlamaModel`): the same definition as `aieng.models.llama`, its tensors named
without the `model.` prefix and no LM head. It embeds only (the engine refuses generation)."""

from __future__ import annotations

import dataclasses

import torch

from aieng.config.model_config import ModelConfig
from aieng.layers.linear import LinearMethodChooser, dense_everywhere
from aieng.models.llama import LlamaForCausalLM


class LlamaForEmbedding(LlamaForCausalLM):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        linear_methods: LinearMethodChooser = dense_everywhere,
    ):
        # No head of its own: compute_logits (the core's one unseen token) reads the embeddings.
        super().__init__(
            dataclasses.replace(config, tie_word_embeddings=True), dtype, linear_methods
        )

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        if name.startswith("lm_head."):
            return None
        return name if name.startswith("model.") else f"model.{name}"
