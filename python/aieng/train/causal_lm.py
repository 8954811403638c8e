"""The serving model as the one `aieng train` trains: `aieng.models.llama.LlamaForCausalLM` with
fresh weights, run over dense (B, L) batches through the causal attention backend (no KV cache,
differentiable), so that what is trained is exactly what is served.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from aieng.attention.backend import ForwardContext
from aieng.attention.causal import CausalAttention, DenseBatch
from aieng.config.model_config import ModelConfig
from aieng.layers.linear import Linear
from aieng.layers.norm import RMSNorm
from aieng.layers.vocab_parallel import VocabParallelEmbedding
from aieng.models.llama import LlamaForCausalLM


def new_model(config: ModelConfig, init_std: float) -> LlamaForCausalLM:
    """A float32 model with fresh weights (see `init_weights`)."""
    model = LlamaForCausalLM(config, torch.float32)
    init_weights(model, init_std)
    return model


@torch.no_grad()
def init_weights(model: LlamaForCausalLM, std: float) -> None:
    """Normal(0, std) embeddings and linear weights, zero biases, unit norms; the residual output
    projections (o_proj, down_proj) scaled down by sqrt(2 * layers) (GPT-2's scheme) so that the
    residual stream starts at unit scale. The model's layers are created uninitialised."""
    residual_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, VocabParallelEmbedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, Linear):
            residual = name.endswith((".o_proj", ".down_proj"))
            module.weight.normal_(0.0, residual_std if residual else std)
            if module.bias is not None:
                module.bias.zero_()


def batch_logits(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids (B, L) -> logits (B, L, vocab): every row from position 0, causally."""
    b, length = input_ids.shape
    if length > model.config.max_position_embeddings:
        raise ValueError(
            f"sequence of {length} tokens exceeds max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    backend = CausalAttention()
    ctx = ForwardContext(backend, backend.build_metadata(DenseBatch(b, length)), kv_caches=None)
    positions = torch.arange(length, device=input_ids.device).repeat(b)  # (B * L,)
    hidden = model(input_ids.flatten(), positions, ctx)  # (B * L, hidden)
    return model.compute_logits(hidden).view(b, length, -1)


def batch_loss(
    model: LlamaForCausalLM, input_ids: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy; input_ids and targets (B, L)."""
    logits = batch_logits(model, input_ids)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def num_parameters(model: LlamaForCausalLM) -> int:
    return sum(p.numel() for p in model.parameters())
