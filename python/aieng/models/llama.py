"""The Llama family: Llama 2/3 (Touvron et al., 2023; optional q/k/v/o and MLP biases), Mistral 7B
(Jiang et al., 2023), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm, explicit head_dim,
optional q/k/v/o bias), Granite (embedding, residual and logits multipliers, its own attention
scale), OLMo 2 (norms on the attention and MLP outputs, q/k RMSNorm across all heads) and
SmolLM3 (some layers without RoPE) — one definition, used for serving and for training.

Pre-norm decoder layers (post-norm for OLMo 2) with grouped-query attention (Ainslie et al., 2023),
RoPE and a SwiGLU MLP.
Tensors are flat over the step's tokens: T is the number of tokens in the step, across requests.
Parameter names follow Hugging Face's, with q/k/v fused into `qkv_proj` and gate/up into
`gate_up_proj`; `packed_modules` tells the loader where the checkpoint's separate tensors go.
How attention is computed (and where K/V are cached) is the `ForwardContext`'s backend; how each
linear layer stores its weights is its `LinearMethod`. Under tensor parallelism each rank builds
its share (`aieng.layers.parallel`): its heads, its slice of the MLP and of the vocabulary.
"""

from typing import ClassVar

import torch
from torch import nn

from aieng.attention.backend import ForwardContext
from aieng.config.model_config import ModelConfig
from aieng.distributed.parallel_state import get_tp_world_size
from aieng.layers.activation import silu_and_mul
from aieng.layers.attention_block import AttentionOptions, DecoderSelfAttention, NormFactory
from aieng.layers.blocks import GatedMLP, causal_lm_logits
from aieng.layers.linear import LinearMethodChooser, dense_everywhere
from aieng.layers.moe import MIXTRAL_EXPERT_NAMES, ExpertNames, SparseMoE
from aieng.layers.norm import RMSNorm, SplitRMSNorm
from aieng.layers.rotary import RotaryEmbedding
from aieng.layers.vocab_parallel import (
    VocabParallelEmbedding,
    vocab_parallel_lm_head,
)


def _norm(config: ModelConfig, size: int, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, dtype, config.norm_weight_in_float32)


def _attention_options(config: ModelConfig, dtype: torch.dtype) -> AttentionOptions:
    """Llama's attention in the shared block: its own o_proj bias, Qwen3's per-head q/k norm or
    OLMo 2's across all heads (over every rank's heads under tensor parallelism)."""
    qk_norm: NormFactory | None = None
    if config.qk_norm:  # Qwen3: per head

        def qk_norm(size: int, part: tuple[int, int]) -> nn.Module:
            return _norm(config, size, dtype)

    elif config.qk_norm_across_heads:  # OLMo 2: over the whole projection

        def qk_norm(size: int, part: tuple[int, int]) -> nn.Module:
            if get_tp_world_size() == 1:
                return _norm(config, size, dtype)
            eps, in_float32 = config.rms_norm_eps, config.norm_weight_in_float32
            return SplitRMSNorm(size, part, eps, dtype, in_float32)

    return AttentionOptions(
        o_proj_bias=config.o_proj_bias,
        sliding_window=config.sliding_window,
        qk_norm=qk_norm,
        qk_norm_per_head=not config.qk_norm_across_heads,
    )


class LlamaDecoderLayer(nn.Module):
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
        self.post_norms = config.post_norms
        self.residual_multiplier = config.residual_multiplier
        self.self_attn = DecoderSelfAttention(
            config,
            None if layer_index in config.no_rope_layers else rotary,
            dtype,
            methods,
            layer_index,
            f"{prefix}.self_attn",
            _attention_options(config, dtype),
        )
        # A MoE layer keeps the checkpoint's module name (Mixtral's `block_sparse_moe`).
        self.mlp_name = "mlp"
        mlp: nn.Module
        if layer_index in config.moe_layers:
            mixtral = config.moe_checkpoint_names == "mixtral"
            self.mlp_name = "block_sparse_moe" if mixtral else "mlp"
            mlp = SparseMoE(
                size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                dtype,
                methods,
                f"{prefix}.{self.mlp_name}",
                names=MIXTRAL_EXPERT_NAMES if mixtral else ExpertNames(),
                weights_in_model_dtype=not mixtral,
            )
        else:
            mlp = GatedMLP(config, dtype, methods, f"{prefix}.mlp", silu_and_mul, config.mlp_bias)
        self.add_module(self.mlp_name, mlp)
        # HF's names: pre-norm layers norm the attention input with `input_layernorm` and the MLP
        # input with `post_attention_layernorm`; OLMo 2 norms the attention output with
        # `post_attention_layernorm` and the MLP output with `post_feedforward_layernorm`.
        if not self.post_norms:
            self.input_layernorm = _norm(config, size, dtype)
        self.post_attention_layernorm = _norm(config, size, dtype)
        if self.post_norms:
            self.post_feedforward_layernorm = _norm(config, size, dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        if self.post_norms:
            x = x + self.post_attention_layernorm(self.self_attn(positions, x, ctx))
            return x + self.post_feedforward_layernorm(self.mlp_module(x))
        attn = self._residual(self.self_attn(positions, self.input_layernorm(x), ctx))
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)  # x + attn, its norm
        return x + self._residual(self.mlp_module(h))

    @property
    def mlp_module(self) -> nn.Module:
        """The layer's MLP: dense, or a SparseMoE (under the checkpoint's module name)."""
        return self._modules[self.mlp_name]

    def _residual(self, branch: torch.Tensor) -> torch.Tensor:
        m = self.residual_multiplier  # Granite's; 1.0 elsewhere, skipped
        return branch if m == 1.0 else branch * m


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, methods: LinearMethodChooser):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, dtype, methods, i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = _norm(config, config.hidden_size, dtype)
        self.embedding_multiplier = config.embedding_multiplier

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "w1": ("w13", 0),  # Mixtral's experts: w1 (gate) and w3 (up)
        "w3": ("w13", 1),
    }

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        linear_methods: LinearMethodChooser = dense_everywhere,
    ):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, linear_methods)
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
        """hidden (S, hidden) -> logits (S, vocab) (gathered from the tensor-parallel ranks:
        every rank must call it)."""
        lm_head = None if self.tie_word_embeddings else self.lm_head
        return causal_lm_logits(self.config, hidden, self.model.embed_tokens, lm_head)
