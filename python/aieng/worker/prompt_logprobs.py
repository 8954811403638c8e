"""Prompt logprobs in the prefill's own forward (`SamplingParams.prompt_logprobs`).

The runner keeps, for each slot whose request asked, its prompt and its k. After a step's
forward, every scheduled prompt position p < len(prompt) - 1 of such a slot has a hidden state
whose logits predict prompt token p + 1: those rows go through the LM head (in bounded pieces, so
a long chunk never materialises a (chunk, vocab) float32 block at once), and the actual token's
log-probability and the top k are read back. Chunked prefill needs nothing more: each chunk
scores its own positions. A slot leaves once its last prompt position is scored, so its decode
steps cost nothing here. The engine makes such requests skip the prefix cache (a cached block
has no logits stored), so every position is computed once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from aieng.worker.runner_io import PromptLogprobs

LOGITS_PIECE_ROWS = 512  # rows of logits computed at once


class PromptScorer:
    def __init__(self, device: torch.device):
        self.device = device
        self._wanted: dict[int, tuple[int, np.ndarray]] = {}  # slot -> (k, prompt ids)

    def __bool__(self) -> bool:
        return bool(self._wanted)

    def __contains__(self, slot: int) -> bool:
        return slot in self._wanted

    def add(self, slot: int, k: int, prompt_token_ids: list[int]) -> None:
        self._wanted[slot] = (k, np.asarray(prompt_token_ids, np.int64))

    def remove(self, slot: int) -> None:
        self._wanted.pop(slot, None)

    def score(
        self,
        plan,
        hidden: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> PromptLogprobs | None:
        """The step's prompt logprobs from its hidden states (T, hidden), or None."""
        rows, targets, slots, positions, ks = [], [], [], [], []
        plan_slots = np.asarray(plan.slots)
        query_start = np.asarray(plan.query_start_loc, np.int64)
        computed = np.asarray(plan.num_computed_tokens, np.int64)
        for r in np.flatnonzero(np.isin(plan_slots, list(self._wanted))).tolist():
            slot = int(plan_slots[r])
            k, prompt = self._wanted[slot]
            start = int(computed[r])
            count = min(int(query_start[r + 1] - query_start[r]), len(prompt) - 1 - start)
            if start + count >= len(prompt) - 1:  # its last prompt position: scored in full
                del self._wanted[slot]
            if count <= 0:
                continue
            rows.append(np.arange(query_start[r], query_start[r] + count))
            targets.append(prompt[start + 1 : start + 1 + count])
            slots.append(np.full(count, slot, np.int64))
            positions.append(np.arange(start, start + count, dtype=np.int64))
            ks.append(np.full(count, k, np.int32))
        if not rows:
            return None
        row_index = torch.from_numpy(np.concatenate(rows)).to(self.device)
        target = torch.from_numpy(np.concatenate(targets)).to(self.device)
        num_top = np.concatenate(ks)
        k_max = int(num_top.max())
        chosen, top_ids, top_values = [], [], []
        for begin in range(0, len(row_index), LOGITS_PIECE_ROWS):
            piece = slice(begin, begin + LOGITS_PIECE_ROWS)
            logprobs = torch.log_softmax(compute_logits(hidden[row_index[piece]]).float(), dim=-1)
            chosen.append(logprobs.gather(1, target[piece, None])[:, 0])
            values, ids = logprobs.topk(min(k_max, logprobs.shape[-1]), dim=-1)
            top_ids.append(ids)
            top_values.append(values)
        return PromptLogprobs(
            slots=np.concatenate(slots),
            positions=np.concatenate(positions),
            chosen=torch.cat(chosen).cpu().numpy(),
            top_ids=torch.cat(top_ids).cpu().numpy(),
            top_logprobs=torch.cat(top_values).cpu().numpy(),
            num_top=num_top,
        )
