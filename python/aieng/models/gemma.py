"""Gemma 2 (Gemma Team, 2024, "Gemma 2: Improving Open Language Models at a Practical Size") and
Gemma 3 (Gemma Team, 2025, "Gemma 3 Technical Report"), text only — one definition.

Decoder layers with grouped-query attention, RoPE and a GeGLU MLP (GELU, tanh approximation), each
normed four times: `input_layernorm` before attention, `post_attention_layernorm` on its output,
`pre_feedforward_layernorm` before the MLP, `post_feedforward_layernorm` on its output. Every
RMSNorm multiplies by (1 + w) in float32. The embeddings are scaled by √hidden_size (rounded to
the model's dtype, as Hugging Face does) and tied to the LM head by default. The softmax scale
is `query_pre_attn_scalar` ** -0.5. Layers alternate local (sliding-window) and global attention:
Gemma 2 one to one, soft-capping the attention scores (cap * tanh(s / cap)) and the final logits;
Gemma 3 five local to one global, with per-head q/k RMSNorm, its own RoPE base for the local
layers (`rope_local`) and the scaled long-context RoPE on the global ones.

Tensors are flat over the step's tokens (T). Parameter names follow Hugging Face's, with q/k/v
fused into `qkv_proj` and gate/up into `gate_up_proj` (`packed_modules`), as in models/llama.py;
each linear layer's storage is its `LinearMethod`, attention is the `ForwardContext`'s backend.
Under tensor parallelism each rank builds its share (`aieng.layers.parallel`); the soft-cap
applies to the gathered logits.
"""

from typing import ClassVar

import torch
from torch import nn

from aieng.attention.backend import ForwardContext
from aieng.config.model_config import ModelConfig
from aieng.layers.activation import gelu_tanh_and_mul
from aieng.layers.attention_block import AttentionOptions, DecoderSelfAttention
from aieng.layers.blocks import GatedMLP, causal_lm_logits
from aieng.layers.linear import LinearMethodChooser, dense_everywhere
from aieng.layers.norm import RMSNorm
from aieng.layers.rotary import RotaryEmbedding
from aieng.layers.vocab_parallel import (
    VocabParallelEmbedding,
    vocab_parallel_lm_head,
)


def _norm(config: ModelConfig, size: int, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, dtype, unit_offset=True)


def _attention_options(
    config: ModelConfig, dtype: torch.dtype, layer_index: int
) -> AttentionOptions:
    """Gemma's attention in the shared block: the biases of q/k/v on o_proj too, the layer's
    window, Gemma 2's score soft-capping, Gemma 3's per-head q/k norm."""

    def qk_norm(size: int, part: tuple[int, int]) -> nn.Module:
        return _norm(config, size, dtype)

    return AttentionOptions(
        o_proj_bias=config.attention_bias,
        sliding_window=config.layer_sliding_windows[layer_index],
        logit_softcap=config.attn_logit_softcapping,
        qk_norm=qk_norm if config.qk_norm else None,
    )


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        methods: LinearMethodChooser,
        layer_index: int,
    ):
        super().__init__()
        prefix = f"model.layers.{layer_index}"
        size = config.hidden_size
        self.self_attn = DecoderSelfAttention(
            config,
            rotary,
            dtype,
            methods,
            layer_index,
            f"{prefix}.self_attn",
            _attention_options(config, dtype, layer_index),
        )
        self.mlp = GatedMLP(config, dtype, methods, f"{prefix}.mlp", gelu_tanh_and_mul)
        self.input_layernorm = _norm(config, size, dtype)
        self.post_attention_layernorm = _norm(config, size, dtype)
        self.pre_feedforward_layernorm = _norm(config, size, dtype)
        self.post_feedforward_layernorm = _norm(config, size, dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(x), ctx)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, methods: LinearMethodChooser):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        rotary_global = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope
        )
        # Gemma 3's sliding layers rotate with their own base; Gemma 2 has one RoPE.
        rotary_local = rotary_global
        if config.rope_local is not None:
            rotary_local = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope_local
            )
        windows = config.layer_sliding_windows
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                config, rotary_global if windows[i] is None else rotary_local, dtype, methods, i
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = _norm(config, config.hidden_size, dtype)
        self.normalizer = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> (T, hidden): the embeddings times √hidden_size in their own dtype, as
        HF multiplies (√3072 = 55.43 becomes 55.5 in bfloat16)."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.normalizer, dtype=x.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return self.norm(x)


class GemmaForCausalLM(nn.Module):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text): the config says which."""

    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        linear_methods: LinearMethodChooser = dense_everywhere,
    ):
        super().__init__()
        if len(config.layer_sliding_windows) != config.num_hidden_layers:
            raise ValueError(
                f"{config.architecture}: the config gives {len(config.layer_sliding_windows)} "
                f"layer windows for {config.num_hidden_layers} layers (not read as a Gemma config?)"
            )
        self.config = config
        self.model = GemmaModel(config, dtype, linear_methods)
        self.tie_word_embeddings = config.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = vocab_parallel_lm_head(
                config.hidden_size, config.vocab_size, dtype, linear_methods
            )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden)."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (S, hidden) -> logits (S, vocab), soft-capped where the config says (gathered
        from the tensor-parallel ranks: every rank must call it)."""
        lm_head = None if self.tie_word_embeddings else self.lm_head
        return causal_lm_logits(self.config, hidden, self.model.embed_tokens, lm_head)
