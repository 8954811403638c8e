"""The contrastive objective of `aieng train --objective contrastive`: a bi-encoder trained with
in-batch negatives InfoNCE (van den Oord et al., 2018; the symmetric form of CLIP and of
sentence-transformers' MultipleNegativesSymmetricRankingLoss) on (query, passage) pairs drawn
from the corpus (`aieng.train.pairs`).

The encoder is the serving Llama itself: a padded (B, L) batch through the causal attention
backend (right padding never reaches a real position under causal attention, so each row's
hidden states are exactly those of the row alone), pooled over the real positions (mean or last
token) and scaled to unit length, as `LLM.embed` pools them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aieng.attention.backend import ForwardContext
from aieng.attention.causal import CausalAttention, DenseBatch
from aieng.models.llama import LlamaForCausalLM
from aieng.train.config import TrainConfig
from aieng.train.pairs import PairBatch, PairSampler


def embed_ids(
    model: LlamaForCausalLM, rows: list[list[int]], pooling: str, pad_id: int
) -> torch.Tensor:
    """Token-id rows -> (len(rows), hidden) unit-length embeddings, differentiable."""
    lengths = torch.tensor([len(r) for r in rows])
    if lengths.min() < 1:
        raise ValueError("cannot embed an empty text")
    b, length = len(rows), int(lengths.max())
    if length > model.config.max_position_embeddings:
        raise ValueError(
            f"a text of {length} tokens exceeds max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    ids = torch.full((b, length), pad_id, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    backend = CausalAttention()
    ctx = ForwardContext(backend, backend.build_metadata(DenseBatch(b, length)), kv_caches=None)
    positions = torch.arange(length).repeat(b)  # (B * L,)
    hidden = model(ids.flatten(), positions, ctx).view(b, length, -1)  # (B, L, hidden)
    if pooling == "mean":
        mask = (torch.arange(length)[None, :] < lengths[:, None]).to(hidden.dtype)  # (B, L)
        pooled = (hidden * mask[..., None]).sum(1) / lengths[:, None].to(hidden.dtype)
    elif pooling == "last":
        pooled = hidden[torch.arange(b), lengths - 1]
    else:
        raise ValueError(f"pooling must be mean or last, got {pooling!r}")
    return F.normalize(pooled, dim=-1)


def info_nce(
    queries: torch.Tensor,
    passages: torch.Tensor,
    negatives: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Symmetric in-batch InfoNCE over unit rows (B, H): each query against every passage
    (and every hard negative), each passage against every query; the i-th of each is the
    pair."""
    candidates = passages if negatives is None else torch.cat([passages, negatives])
    labels = torch.arange(len(queries))
    to_passages = F.cross_entropy(queries @ candidates.T / temperature, labels)
    to_queries = F.cross_entropy(passages @ queries.T / temperature, labels)
    return (to_passages + to_queries) / 2


class ContrastiveObjective:
    """Pairs from the training documents, a fixed set from the held-out ones, and the loss."""

    unit = "pairs"

    def __init__(
        self,
        cfg: TrainConfig,
        tokenizer,
        pad_id: int,
        train_docs: list[str],
        held_docs: list[str],
    ):
        self.cfg, self.tokenizer, self.pad_id = cfg, tokenizer, pad_id
        self.pairs = PairSampler(train_docs, cfg.pair_window, cfg.query_drop)
        self.units_per_step = cfg.batch_size
        self.heldout: list[PairBatch] | None = None
        if held_docs:
            held = PairSampler(held_docs, cfg.pair_window, cfg.query_drop)
            fixed = torch.Generator().manual_seed(cfg.seed + 1)
            count = max(1, cfg.eval_windows // cfg.batch_size)
            self.heldout = [
                held.sample(cfg.batch_size, fixed, cfg.hard_negatives) for _ in range(count)
            ]

    @property
    def has_heldout(self) -> bool:
        return self.heldout is not None

    def describe(self) -> str:
        held = "" if self.heldout is None else f", {len(self.heldout)} held-out batches"
        return f"{len(self.pairs):,} training verses{held}"

    def loss(self, model: LlamaForCausalLM, sampler: torch.Generator) -> torch.Tensor:
        return self.batch_loss(
            model, self.pairs.sample(self.cfg.batch_size, sampler, self.cfg.hard_negatives)
        )

    def batch_loss(self, model: LlamaForCausalLM, batch: PairBatch) -> torch.Tensor:
        q = self._embed(model, batch.queries)
        p = self._embed(model, batch.passages)
        n = None if batch.negatives is None else self._embed(model, batch.negatives)
        return info_nce(q, p, n, self.cfg.temperature)

    @torch.no_grad()
    def heldout_loss(self, model: LlamaForCausalLM) -> float:
        assert self.heldout is not None
        model.eval()
        losses = [self.batch_loss(model, batch).item() for batch in self.heldout]
        model.train()
        return sum(losses) / len(losses)

    def _embed(self, model: LlamaForCausalLM, texts: list[str]) -> torch.Tensor:
        limit = min(self.cfg.seq_len, model.config.max_position_embeddings)
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        rows = [e.ids[:limit] or [self.pad_id] for e in encodings]
        return embed_ids(model, rows, self.cfg.pooling, self.pad_id)
