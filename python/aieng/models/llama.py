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
from aieng.attention.layer import Attention
from aieng.config import ModelConfig
from aieng.distributed.parallel_state import get_tp_world_size, heads_per_rank, kv_heads_per_rank
from aieng.layers.activation import silu_and_mul
from aieng.layers.blocks import GatedMLP, causal_lm_logits
from aieng.layers.linear import Linear, LinearMethodChooser, dense_everywhere
from aieng.layers.moe import MIXTRAL_EXPERT_NAMES, ExpertNames, SparseMoE
from aieng.layers.norm import RMSNorm, SplitRMSNorm
from aieng.layers.parallel import qkv_parallel, row_parallel
from aieng.layers.rotary import RotaryEmbedding
from aieng.layers.vocab_parallel import (
    VocabParallelEmbedding,
    vocab_parallel_lm_head,
)


def _norm(config: ModelConfig, size: int, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, dtype, config.norm_weight_in_float32)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        methods: LinearMethodChooser,
        layer_index: int,
        prefix: str,
    ):
        super().__init__()
        # This tensor-parallel rank's heads (all of them with one rank).
        self.num_heads = heads_per_rank(config.num_attention_heads)
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads)
        self.head_dim = config.head_dim
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        hidden = config.hidden_size
        self.qkv_proj = Linear(
            hidden,
            [q_size, kv_size, kv_size],
            config.attention_bias,
            dtype,
            methods,
            f"{prefix}.qkv_proj",
            qkv_parallel(
                hidden, config.num_attention_heads, config.num_key_value_heads, self.head_dim
            ),
        )
        self.o_proj = Linear(
            q_size,
            hidden,
            config.o_proj_bias,
            dtype,
            methods,
            f"{prefix}.o_proj",
            row_parallel(q_size, [hidden], "num_attention_heads"),
        )
        if config.qk_norm:  # Qwen3: per head
            self.q_norm = _norm(config, self.head_dim, dtype)
            self.k_norm = _norm(config, self.head_dim, dtype)
        elif config.qk_norm_across_heads:  # OLMo 2: over the whole projection
            q_part, k_part, _ = self.qkv_proj.shard.output_slices
            self.q_norm = _norm_across_heads(config, q_size, q_part, dtype)
            self.k_norm = _norm_across_heads(config, kv_size, k_part, dtype)
        self.norm_per_head = config.qk_norm
        self.rotary = None if layer_index in config.no_rope_layers else rotary
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            layer_index,
            scale=config.attention_scale,
            sliding_window=config.sliding_window,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        if hasattr(self, "q_norm") and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm") and self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, ctx)  # (T, H, D)
        return self.o_proj(out.flatten(1))


def _norm_across_heads(
    config: ModelConfig, size: int, part: tuple[int, int], dtype: torch.dtype
) -> nn.Module:
    """OLMo 2's q or k norm over all heads: with several ranks, over the heads of all of them."""
    if get_tp_world_size() == 1:
        return _norm(config, size, dtype)
    eps, in_float32 = config.rms_norm_eps, config.norm_weight_in_float32
    return SplitRMSNorm(size, part, eps, dtype, in_float32)


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
        self.self_attn = LlamaAttention(
            config, rotary, dtype, methods, layer_index, f"{prefix}.self_attn"
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
