"""Building blocks every decoder family shares, written once: the gated MLP (gate and up fused,
an activation, down) and the LM head's logits (tied or untied, gathered over the ranks, scaled
and soft-capped as the config says)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aieng.config.model_config import ModelConfig
from aieng.layers.linear import Linear, LinearMethodChooser
from aieng.layers.parallel import column_parallel, row_parallel
from aieng.layers.vocab_parallel import VocabParallelEmbedding, lm_logits


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one column-parallel matmul (`gate_up_proj`),
    down row-parallel: Llama's SwiGLU, Gemma's GeGLU."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        methods: LinearMethodChooser,
        prefix: str,
        act_and_mul: Callable[[torch.Tensor], torch.Tensor],
        bias: bool = False,
    ):
        super().__init__()
        size, hidden = config.intermediate_size, config.hidden_size
        self.act_and_mul = act_and_mul
        self.gate_up_proj = Linear(
            hidden,
            [size, size],
            bias,
            dtype,
            methods,
            f"{prefix}.gate_up_proj",
            column_parallel(hidden, [size, size], "intermediate_size"),
        )
        self.down_proj = Linear(
            size,
            hidden,
            bias,
            dtype,
            methods,
            f"{prefix}.down_proj",
            row_parallel(size, [hidden], "intermediate_size"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's soft-capping); x itself without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


def causal_lm_logits(
    config: ModelConfig,
    hidden: torch.Tensor,
    embedding: VocabParallelEmbedding,
    lm_head: Linear | None,
) -> torch.Tensor:
    """hidden (S, hidden) -> logits (S, vocab) through the untied head or (None) the tied
    embedding, gathered from the tensor-parallel ranks (every rank must call it), divided by
    Granite's `logits_scaling` and soft-capped by Gemma's `final_logit_softcapping`."""
    logits = lm_logits(hidden, embedding, lm_head, config.vocab_size)
    if config.logits_scaling != 1.0:
        logits = logits / config.logits_scaling
    return softcap(logits, config.final_logit_softcapping)
