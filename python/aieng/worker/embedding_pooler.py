"""Embeddings in the prefill's own forward (`aieng.pooling.PoolingParams`).

The runner keeps, for each slot whose request embeds, its prompt length and its pooling. After a
step's forward, the hidden states of every scheduled prompt position of such a slot are folded
into its running state (the first position's, a float32 sum, or the last position's), so chunked
prefill needs nothing more; the step that computes a slot's last prompt position finishes it: the
pooled vector (L2-normalised where asked) goes back to the engine and the slot leaves. A prefill
that starts again at position 0 (preemption by recompute) starts its state again. The engine
makes such requests skip the prefix cache, so every prompt position is computed here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aieng.pooling import PoolingParams
from aieng.worker.runner_io import PooledEmbeddings


@dataclass
class _State:
    params: PoolingParams
    prompt: np.ndarray  # (prompt_len,) int64: the prompt's token ids
    pooled: torch.Tensor | None = None  # float32 (hidden,): first, sum or last


class EmbeddingPooler:
    def __init__(self) -> None:
        self._wanted: dict[int, _State] = {}

    def __bool__(self) -> bool:
        return bool(self._wanted)

    def __contains__(self, slot: int) -> bool:
        return slot in self._wanted

    def add(self, slot: int, params: PoolingParams, prompt_token_ids: list[int]) -> None:
        self._wanted[slot] = _State(params, np.asarray(prompt_token_ids, np.int64))

    def prompt_of(self, slot: int) -> np.ndarray:
        return self._wanted[slot].prompt

    def remove(self, slot: int) -> None:
        self._wanted.pop(slot, None)

    def completing_rows(self, plan) -> list[int]:
        """The plan's rows whose pooling slot computes its last prompt position this step."""
        query_start = np.asarray(plan.query_start_loc, np.int64)
        computed = np.asarray(plan.num_computed_tokens, np.int64)
        rows = []
        for r, slot in enumerate(np.asarray(plan.slots).tolist()):
            state = self._wanted.get(slot)
            end = int(computed[r] + query_start[r + 1] - query_start[r])
            if state is not None and end >= len(state.prompt):
                rows.append(r)
        return rows

    def pool(self, plan, hidden: torch.Tensor) -> PooledEmbeddings | None:
        """Folds the step's hidden states (T, hidden) into the pooling slots' states; returns the
        embeddings of the slots whose prompt is complete, or None."""
        query_start = np.asarray(plan.query_start_loc, np.int64)
        computed = np.asarray(plan.num_computed_tokens, np.int64)
        done_slots: list[int] = []
        vectors: list[torch.Tensor] = []
        for r, slot in enumerate(np.asarray(plan.slots).tolist()):
            state = self._wanted.get(slot)
            if state is None:
                continue
            start = int(computed[r])
            count = min(int(query_start[r + 1] - query_start[r]), len(state.prompt) - start)
            if count <= 0:
                continue
            rows = hidden[int(query_start[r]) : int(query_start[r]) + count]
            _fold(state, rows, start)
            if start + count >= len(state.prompt):
                del self._wanted[slot]
                assert state.pooled is not None
                vector = state.pooled
                if state.params.method == "mean":
                    vector = vector / len(state.prompt)
                if state.params.normalize:
                    vector = torch.nn.functional.normalize(vector, dim=0)
                done_slots.append(slot)
                vectors.append(vector)
        if not done_slots:
            return None
        return PooledEmbeddings(
            slots=np.asarray(done_slots, np.int64),
            vectors=torch.stack(vectors).cpu().numpy(),
        )


def _fold(state: _State, rows: torch.Tensor, start: int) -> None:
    """rows: the hidden states of prompt positions [start, start + len(rows))."""
    method = state.params.method
    if start == 0:
        state.pooled = None  # a fresh prefill (or one recomputed after preemption)
    if method == "cls":
        if start == 0:
            state.pooled = rows[0].float()
    elif method == "mean":
        total = rows.float().sum(0)
        state.pooled = total if state.pooled is None else state.pooled + total
    elif start + len(rows) >= len(state.prompt):  # last: the prompt's final position
        state.pooled = rows[-1].float()


def encoder_step(model, pooler: EmbeddingPooler, plan, device: torch.device):
    """One step of an encoder-only model (no KV cache; bidirectional attention needs a whole
    prompt): every pooling row whose prompt completes this step runs over all of its prompt
    at once, its earlier chunks included. -> the embeddings finished, or None."""
    rows = pooler.completing_rows(plan)
    if not rows:
        return None
    slots = np.asarray(plan.slots)
    token_rows = [pooler.prompt_of(int(slots[r])) for r in rows]
    lengths = np.array([len(t) for t in token_rows], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    input_ids = torch.from_numpy(np.concatenate(token_rows)).to(device)
    positions = torch.from_numpy(
        np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    ).to(device)
    hidden = model(input_ids, positions, starts)
    whole = _WholePrompts(
        slots=slots[rows],
        query_start_loc=starts,
        num_computed_tokens=np.zeros(len(rows), np.int64),
    )
    return pooler.pool(whole, hidden)


@dataclass
class _WholePrompts:
    """The rows of an encoder step as if each prompt were scheduled whole."""

    slots: np.ndarray
    query_start_loc: np.ndarray
    num_computed_tokens: np.ndarray
