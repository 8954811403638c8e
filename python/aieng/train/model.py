"""The Llama architecture for training: dense (batch, seq) tensors, causal SDPA, Hugging Face
parameter names, so that `state_dict()` is a checkpoint transformers and aieng load unchanged.

The inference model (`aieng.models.llama`) works on flat paged batches and cannot backpropagate
through its KV cache writes; this one is its training twin, checked against HF in the tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from aieng.train.model_shape import ModelShape


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D) in the rotate-half layout; cos, sin (S, D / 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        d, hd = shape.hidden_size, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            shape.num_attention_heads,
            shape.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(d, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            repeat = self.heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        d, f = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class TrainableLlama(nn.Module):
    """Causal LM over (batch, seq) token ids; `state_dict()` keys are Hugging Face's."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        shape.validate()
        self.shape = shape
        self.model = Backbone(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        exponents = torch.arange(0, shape.head_dim, 2).float() / shape.head_dim
        inv_freq = 1.0 / (shape.rope_theta**exponents)
        freqs = torch.arange(shape.max_position_embeddings).float()[:, None] * inv_freq[None]
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) weights; residual output projections scaled down by
        sqrt(2 * layers) (GPT-2's scheme) so the residual stream starts at unit scale."""
        std = self.shape.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.shape.num_hidden_layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, S) -> logits (B, S, vocab)."""
        s = input_ids.shape[1]
        if s > self.shape.max_position_embeddings:
            raise ValueError(
                f"sequence of {s} tokens exceeds max_position_embeddings "
                f"{self.shape.max_position_embeddings}"
            )
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(input_ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Contiguous tensors under HF names; a tied lm_head is left out as HF saves it."""
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.shape.tie_word_embeddings:
            state.pop("lm_head.weight")
        return state

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
