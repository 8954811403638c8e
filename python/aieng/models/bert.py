"""The BERT family of encoders: BERT (Devlin et al., 2019), RoBERTa and XLM-RoBERTa (learned
absolute positions from pad_token_id + 1) — the models behind BGE, e5 and multilingual-e5.

Post-LayerNorm layers (the residual is added before each norm), bidirectional multi-head
attention over each prompt, a GELU MLP; the embeddings are the sum of the token's, its
position's and token type 0's, normalised. Encoder-only: no KV cache, no LM head; the runner
calls it on whole prompts (`aieng.worker.embedding_pooler.encoder_step`) and pools its final hidden
states. Tensors are flat over the step's tokens (T), rows laid out one after another; only the
attention pads them into a (rows, longest) batch. Parameter names follow Hugging Face's, with
query/key/value fused into `qkv`; checkpoint prefixes (`bert.`, `roberta.`) are dropped and the
pooler and task heads, which embeddings do not use, are skipped.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from aieng.config.model_config import ModelConfig
from aieng.layers.linear import Linear, LinearMethodChooser, dense_everywhere

# Tensors a checkpoint may hold that an embedding never reads.
UNUSED_PREFIXES = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids")
MODEL_PREFIXES = ("bert.", "roberta.", "model.")


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        positions = config.max_position_embeddings + config.position_offset
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings = nn.Embedding(positions, hidden, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)
        self.position_offset = config.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        x = x + self.token_type_embeddings.weight[0]  # one segment: token type 0
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, methods: LinearMethodChooser, prefix: str
    ):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = Linear(hidden, [hidden] * 3, True, dtype, methods, f"{prefix}.qkv")

    def forward(self, x: torch.Tensor, batch: _PaddedBatch) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # (T, H, D)
        out = F.scaled_dot_product_attention(
            batch.pad(q), batch.pad(k), batch.pad(v), attn_mask=batch.key_mask
        )  # (R, H, L, D)
        return batch.unpad(out)  # (T, H * D)


class BertLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, methods: LinearMethodChooser, index: int
    ):
        super().__init__()
        prefix = f"encoder.layer.{index}"
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(config, dtype, methods, f"{prefix}.attention.self")
        self.attention.output = _DenseNorm(
            hidden, hidden, eps, dtype, methods, f"{prefix}.attention.output"
        )
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(
            hidden, config.intermediate_size, True, dtype, methods, f"{prefix}.intermediate.dense"
        )
        self.output = _DenseNorm(
            config.intermediate_size, hidden, eps, dtype, methods, f"{prefix}.output"
        )
        self.approximate = "tanh" if config.hidden_act == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor, batch: _PaddedBatch) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, batch), x)
        h = F.gelu(self.intermediate.dense(x), approximate=self.approximate)
        return self.output(h, x)


class _DenseNorm(nn.Module):
    """LayerNorm(dense(x) + residual): the end of a post-norm sub-layer."""

    def __init__(
        self,
        size_in: int,
        size_out: int,
        eps: float,
        dtype: torch.dtype,
        methods: LinearMethodChooser,
        prefix: str,
    ):
        super().__init__()
        self.dense = Linear(size_in, size_out, True, dtype, methods, f"{prefix}.dense")
        self.LayerNorm = nn.LayerNorm(size_out, eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _PaddedBatch:
    """Where each of the T flat tokens sits in a (rows, longest) batch, for the attention."""

    def __init__(self, query_start_loc: np.ndarray, device: torch.device):
        starts = np.asarray(query_start_loc, np.int64)
        lengths = np.diff(starts)
        self.rows, self.longest = len(lengths), int(lengths.max())
        self.whole = self.rows == 1  # one prompt: nothing to pad
        row_of = np.repeat(np.arange(self.rows), lengths)
        offset = np.arange(starts[-1]) - starts[:-1][row_of]
        self.index = torch.from_numpy(row_of * self.longest + offset).to(device)
        lengths_t = torch.from_numpy(lengths).to(device)
        keys = torch.arange(self.longest, device=device)
        self.key_mask = None if self.whole else (keys[None, :] < lengths_t[:, None])[:, None, None]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H, D) -> (R, H, L, D), zeros past each row's end."""
        if self.whole:
            return x.transpose(0, 1)[None]
        padded = x.new_zeros(self.rows * self.longest, *x.shape[1:])
        padded[self.index] = x
        return padded.view(self.rows, self.longest, *x.shape[1:]).transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """(R, H, L, D) -> (T, H * D)."""
        flat = x.transpose(1, 2).reshape(self.rows * self.longest, -1)
        return flat if self.whole else flat[self.index]


class BertModel(nn.Module):
    """input_ids, positions (T,) and each prompt's start (R + 1,) -> final hidden states."""

    is_encoder = True
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "query": ("qkv", 0),
        "key": ("qkv", 1),
        "value": ("qkv", 2),
    }

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        linear_methods: LinearMethodChooser = dense_everywhere,
    ):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config, dtype)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(config, dtype, linear_methods, i) for i in range(config.num_hidden_layers)
        )

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor's name here, or None for one embeddings do not use."""
        for prefix in MODEL_PREFIXES:
            if name.startswith(prefix):
                name = name.removeprefix(prefix)
                break
        return None if name.startswith(UNUSED_PREFIXES) else name

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: np.ndarray
    ) -> torch.Tensor:
        batch = _PaddedBatch(query_start_loc, input_ids.device)
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x
