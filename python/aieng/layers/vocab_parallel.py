"""The vocabulary split over tensor-parallel ranks: the token embedding and the logits.

Each rank holds ceil(V / N) rows of the embedding table (and of an untied LM head, a
column-parallel `Linear` over `vocab_parallel`), the last share padded with zero rows. An
embedding lookup reads the ids in this rank's share, writes zeros for the others and all-reduces:
exactly one rank contributes each token's row, so the sum is the row, bit for bit. The LM head (or
the tied embedding) gives each rank the logits of its share; `gather_logits` concatenates them in
rank order and cuts the padding, so every rank holds the full (S, V) logits — sampling and
soft-capping stay as they were. With one rank the table is whole and nothing is communicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aieng.distributed.parallel_state import get_tp_world_size, tp_all_gather, tp_all_reduce
from aieng.kernels.cpu_dense import DENSE_MAX_M, dense_gemv
from aieng.kernels.cpu_int8 import int8_matmul
from aieng.layers.linear import (
    Linear,
    LinearMethodChooser,
    WeightLoadError,
    copy_into,
    set_weight_attrs,
)
from aieng.layers.parallel import vocab_parallel, vocab_share


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_size = get_tp_world_size()  # the group this table was cut for
        self.start, self.rows = vocab_share(num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim, dtype=dtype))
        set_weight_attrs(self.weight, weight_loader=self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        """This rank's rows of the full (V, dim) table; padding rows zero."""
        expected = [self.num_embeddings, param.shape[1]]
        if list(loaded.shape) != expected:
            raise WeightLoadError(f"has shape {list(loaded.shape)}, expected {expected}")
        held = max(0, min(self.rows, self.num_embeddings - self.start))
        copy_into(param.data[:held], loaded[self.start : self.start + held], convert=True)
        with torch.no_grad():
            param.data[held:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) -> (T, dim)."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(x.masked_fill_(outside[:, None], 0.0), self.tp_size)


def gather_logits(local: torch.Tensor, vocab_size: int, world_size: int) -> torch.Tensor:
    """This rank's vocabulary share of the logits (S, ceil(V / N)) -> the full (S, V) on every
    rank (a collective: every rank must call it; `world_size`: the model's group size)."""
    if world_size == 1:
        return local
    logits = tp_all_gather(local, world_size, dim=-1)
    return logits if logits.shape[-1] == vocab_size else logits[:, :vocab_size].contiguous()


def vocab_parallel_lm_head(
    hidden_size: int, vocab_size: int, dtype: torch.dtype | None, methods: LinearMethodChooser
) -> Linear:
    """An untied LM head: this rank's vocabulary share of the output rows."""
    shard = vocab_parallel(hidden_size, vocab_size)
    return Linear(hidden_size, vocab_size, False, dtype, methods, "lm_head", shard)


def lm_logits(
    hidden: torch.Tensor,
    embedding: VocabParallelEmbedding,
    lm_head: Linear | None,
    vocab_size: int,
) -> torch.Tensor:
    """hidden (S, hidden) -> the full (S, V) logits on every rank, through the untied `lm_head`
    or (None) the tied embedding table (a collective: every rank must call it). A head prepared
    by `aieng.layers.cpu_lm_head` runs its CPU kernel."""
    head = embedding if lm_head is None else lm_head
    packed = getattr(head, "int8_head", None)
    if packed is not None:
        local = int8_matmul(hidden, packed, split=True)
    elif lm_head is not None:
        local = lm_head(hidden)
    elif getattr(embedding, "gemv", False) and hidden.numel() <= DENSE_MAX_M * hidden.shape[-1]:
        local = dense_gemv(hidden, embedding.weight)
    else:
        local = F.linear(hidden, embedding.weight)
    return gather_logits(local, vocab_size, embedding.tp_size)
