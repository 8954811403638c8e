"""Sampling a step so that one request's failure ends that request only.

The step's rows are sampled in one batch. When that raises, each row is tried alone to find the
rows at fault; the others are sampled again in one batch (their results are the batch's, row
for row), and the failed rows get token -1 and a cause. A device failure is not a row's: it
is raised, and the engine stops. So a value that breaks the sampler —
whatever slipped past validation — fails one request, never its neighbours in the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from aieng.errors import is_fatal
from aieng.worker.runner_io import SampledLogprobs
from aieng.worker.sampler import Sampler, SamplerOutput, SamplingTable

Bitmask = tuple[np.ndarray, np.ndarray] | None
ToHost = Callable[[SamplerOutput], tuple[np.ndarray, SampledLogprobs]]


@dataclass(frozen=True)
class RowRules:
    """What the core decided for a step's sampling rows: the grammar masks (rows, bitmask) and
    the token bans (rows, ids) of min_tokens; row numbers index the step's sampled rows."""

    grammar: Bitmask = None
    banned: Bitmask = None
    # Draft tokens (rows, ids) drawn from the distributions (rows, q (P, V) float32): those
    # rows are sampled by rejection against q (speculative decoding with a draft model).
    draft_ids: Bitmask = None
    draft_q: Bitmask = None

    def of_rows(self, keep: np.ndarray) -> RowRules:
        """The rules of rows `keep` only, renumbered 0..len(keep)-1."""
        return RowRules(
            _rows_of(self.grammar, keep),
            _rows_of(self.banned, keep),
            _rows_of(self.draft_ids, keep),
            _rows_of(self.draft_q, keep),
        )


def sample_rows(
    sampler: Sampler,
    table: SamplingTable,
    logits: torch.Tensor,
    slots: np.ndarray,
    rules: RowRules,
    to_host: ToHost,
) -> tuple[np.ndarray, SampledLogprobs, dict[int, str]]:
    """logits (S, V), slots (S,) -> tokens (S,) with -1 on failed rows, their logprobs, and
    {slot: cause} of the rows whose sampling raised."""
    try:
        return (*_sample(sampler, table, logits, slots, rules, to_host), {})
    except Exception as error:
        if is_fatal(error):
            raise
        if len(slots) == 1:
            return _all_failed(slots, error)
    failed: dict[int, str] = {}
    for row in range(len(slots)):
        keep = np.array([row])
        try:
            _sample(sampler, table, logits[keep], slots[keep], rules.of_rows(keep), to_host)
        except Exception as error:
            failed[int(slots[row])] = _cause(error)
    ok = np.array([r for r in range(len(slots)) if int(slots[r]) not in failed], np.int64)
    tokens = np.full(len(slots), -1, np.int64)
    if not len(ok):
        return tokens, SampledLogprobs.empty(), failed
    try:
        ok_tokens, logprobs = _sample(
            sampler, table, logits[torch.from_numpy(ok)], slots[ok], rules.of_rows(ok), to_host
        )
    except Exception as error:  # only together do the rows fail: the step's requests end
        return _all_failed(slots, error)
    tokens[ok] = ok_tokens
    logprobs.rows = ok[logprobs.rows]
    return tokens, logprobs, failed


def _sample(
    sampler: Sampler,
    table: SamplingTable,
    logits: torch.Tensor,
    slots: np.ndarray,
    rules: RowRules,
    to_host: ToHost,
) -> tuple[np.ndarray, SampledLogprobs]:
    batch = table.batch(slots, rules.banned)
    batch.grammar_bitmask = rules.grammar
    if rules.draft_ids is not None and rules.draft_q is not None:
        device = logits.device
        rows, ids = (torch.from_numpy(np.asarray(a, np.int64)).to(device) for a in rules.draft_ids)
        batch.proposals = (rows, ids, torch.from_numpy(rules.draft_q[1]).to(device))
    return to_host(sampler(logits, batch))


def _rows_of(bitmask: Bitmask, keep: np.ndarray) -> Bitmask:
    """(rows, values) of rows `keep` only, renumbered 0..len(keep)-1."""
    if bitmask is None:
        return None
    rows, words = bitmask
    renumbered = np.full(max(int(rows.max(initial=-1)), int(keep.max())) + 1, -1, np.int64)
    renumbered[keep] = np.arange(len(keep))
    new_rows = renumbered[np.asarray(rows, np.int64)]
    kept = new_rows >= 0
    return (new_rows[kept], words[kept]) if kept.any() else None


def _all_failed(
    slots: np.ndarray, error: Exception
) -> tuple[np.ndarray, SampledLogprobs, dict[int, str]]:
    cause = _cause(error)
    return (
        np.full(len(slots), -1, np.int64),
        SampledLogprobs.empty(),
        {int(s): cause for s in slots},
    )


def _cause(error: Exception) -> str:
    return f"sampling failed: {type(error).__name__}: {error}"
