"""Sampling a step whose rows may carry draft tokens, exactly as plain decoding would.

A sampling request of the plan has 1 + d logits rows (d drafts: `sample_request_rows`
repeats its row): position j gives the distribution p_j of its next output token after its
own tokens and drafts 0..j-1. Position by position, over the requests still going:

- p_j is processed as a plain step would process it — the request's temperature, top-k/p,
  min-p, penalties (counting the tokens taken at positions < j), logit_bias, bad words and
  the core's min_tokens bans — and one token x_j is drawn from it (the argmax when greedy;
  a seeded request draws with noise keyed by (seed, output index), as plain steps do);
- x_j is emitted; when j < d and x_j equals draft j, the draft is accepted and position j + 1
  follows, otherwise the request stops here (x_j is the correction, or after every draft
  was accepted the bonus token).

When no row of the step has a penalty, bad words or its own seed — nothing that depends on
the tokens taken before a position — every position is drawn in one sampler pass and the
walk along the drafts runs on the host: the same draws, one pass instead of 1 + k.

A draft model's drafts come with the distributions q they were drawn from (`proposals`): on
those rows the sampler keeps the draft with probability min(1, p/q) and on rejection draws
from norm(max(0, p - q)) (`aieng.worker.sampler.rejection_sample`); the walk along the drafts is the
same, since a rejected draft is never the token drawn (max(0, p - q) is 0 there).

Without q, this is Leviathan et al.'s / Chen et al.'s rejection sampling with a point-mass proposal
q = δ(draft): the draft is accepted with probability min(1, p(draft) / q(draft)) = p(draft),
and on rejection the token comes from norm(max(0, p - q)) = p without the draft — the same
as drawing x ~ p and comparing. Every emitted token is therefore distributed exactly as in
plain decoding, and each takes one draw, so a seeded request gives the same tokens with or
without speculation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from aieng.worker.isolated_sampling import RowRules, ToHost, sample_rows
from aieng.worker.runner_io import SampledLogprobs
from aieng.worker.sampler import Sampler, SamplerOutput, SamplingTable, greedy_tokens


def sampling_groups(sample_request_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The plan's sampling requests: the first logits row of each (G,) and its number of
    logits rows, 1 + its drafts (G,)."""
    rows = np.asarray(sample_request_rows)
    n = len(rows)
    if n < 2 or bool((rows[1:] != rows[:-1]).all()):  # no drafts (or no rows)
        return np.arange(n, dtype=np.int64), np.ones(n, np.int64)
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    sizes = np.diff(np.r_[starts, len(rows)])
    return starts.astype(np.int64), sizes.astype(np.int64)


def draft_tokens(plan, groups: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """(S,) the draft each logits row's sample is checked against: the token the plan runs
    after it (-1 on each request's last logits row, which has none)."""
    starts, sizes = groups
    indices = np.asarray(plan.logits_indices, np.int64)
    if len(starts) == len(indices):  # one row per request: no drafts
        return np.full(len(indices), -1, np.int64)
    last = np.zeros(len(indices), bool)
    last[starts + sizes - 1] = True
    following = np.minimum(indices + 1, len(plan.input_ids) - 1)
    return np.where(last, -1, np.asarray(plan.input_ids, np.int64)[following])


def verify_and_sample(
    sampler: Sampler,
    table: SamplingTable,
    logits: torch.Tensor,
    slots: np.ndarray,
    drafts: np.ndarray,
    groups: tuple[np.ndarray, np.ndarray],
    rules: RowRules,
    to_host: ToHost,
    proposals: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, SampledLogprobs, dict[int, str]]:
    """logits (S, V) of the plan's logits rows; slots (S,) the slot of each; drafts (S,) the
    draft each row's sample is compared with (-1 on a request's last row); groups from
    `sampling_groups`; proposals: (rows, q (P, V)), the distributions the drafts of those
    rows were drawn from (sampled, unseeded rows of a draft model). Returns the emitted
    tokens (flat, request after request; -1 on a failed request's last), the count of each
    request (G,), their logprobs (rows index the flat tokens) and {slot: cause} of failed
    requests. Records the taken tokens in `table`."""
    starts, sizes = groups
    if _plain_greedy_step(table, slots, sizes, rules, proposals):
        return _greedy_step(table, logits, slots, to_host)
    if proposals is not None and len(proposals[0]):
        rows = np.asarray(proposals[0], np.int64)
        rules = dataclasses.replace(
            rules, draft_ids=(rows, drafts[rows]), draft_q=(rows, proposals[1])
        )
    if int(sizes.max(initial=1)) > 1 and not _depends_on_history(table, slots):
        return _verify_in_one_pass(sampler, table, logits, slots, drafts, groups, rules, to_host)
    num_groups = len(starts)
    going = np.arange(num_groups)
    failed: dict[int, str] = {}
    pieces: list[tuple[np.ndarray, np.ndarray, SampledLogprobs]] = []  # (groups, j, lp)
    taken: list[tuple[np.ndarray, np.ndarray]] = []  # (groups, tokens) per position
    j = 0
    while len(going):  # at most k + 1 passes, whatever the batch size
        rows = starts[going] + j
        index = torch.from_numpy(rows).to(logits.device)
        tokens, logprobs, row_failed = sample_rows(
            sampler, table, logits[index], slots[rows], rules.of_rows(rows), to_host
        )
        failed.update(row_failed)
        ok = tokens >= 0
        table.append_tokens(slots[rows][ok], tokens[ok])
        if len(logprobs.rows):
            pieces.append((going[logprobs.rows], np.full(len(logprobs.rows), j), logprobs))
        taken.append((going, tokens))
        accepted = ok & (tokens == drafts[rows])
        going = going[accepted & (j + 1 < sizes[going])]
        j += 1
    owners = np.concatenate([g for g, _ in taken])
    # Request after request, each in position order (positions were appended in order).
    order = np.argsort(owners, kind="stable")
    flat = np.concatenate([t for _, t in taken]).astype(np.int64)[order]
    counts = np.bincount(owners, minlength=num_groups).astype(np.int32)
    return flat, counts, _flat_logprobs(pieces, counts), failed


def _plain_greedy_step(
    table: SamplingTable,
    slots: np.ndarray,
    sizes: np.ndarray,
    rules: RowRules,
    proposals: tuple[np.ndarray, np.ndarray] | None,
) -> bool:
    """Whether each request has one logits row (no drafts), no core rule (grammar mask,
    min_tokens ban) and takes the argmax of its raw logits: the common decode step."""
    return (
        proposals is None
        and rules.grammar is None
        and rules.banned is None
        and rules.draft_ids is None
        and int(sizes.max(initial=1)) == 1
        and table.plain_greedy(slots)
    )


def _greedy_step(
    table: SamplingTable, logits: torch.Tensor, slots: np.ndarray, to_host: ToHost
) -> tuple[np.ndarray, np.ndarray, SampledLogprobs, dict[int, str]]:
    """verify_and_sample of a plain greedy step: each row's argmax in one pass, without
    building a sampling batch (the same tokens as the sampler's)."""
    tokens, _ = to_host(SamplerOutput(greedy_tokens(logits.float()), None))
    tokens = tokens.astype(np.int64, copy=False)
    ok = tokens >= 0
    table.append_tokens(slots[ok], tokens[ok])
    return tokens, np.ones(len(tokens), np.int32), SampledLogprobs.empty(), {}


def _depends_on_history(table: SamplingTable, slots: np.ndarray) -> bool:
    """Whether a row's processing at a position depends on the tokens taken before it:
    penalties, bad words, a seed (its noise is keyed by the output index) on a sampled row."""
    seeded = table.has_seed[slots] & ~table.greedy[slots]
    bad_words = bool(table.bad_words) and any(int(s) in table.bad_words for s in set(slots))
    return bool(table.has_penalty[slots].any() or seeded.any() or bad_words)


def _verify_in_one_pass(
    sampler: Sampler,
    table: SamplingTable,
    logits: torch.Tensor,
    slots: np.ndarray,
    drafts: np.ndarray,
    groups: tuple[np.ndarray, np.ndarray],
    rules: RowRules,
    to_host: ToHost,
) -> tuple[np.ndarray, np.ndarray, SampledLogprobs, dict[int, str]]:
    """verify_and_sample when no position depends on the ones before it: one pass draws
    every position, then each request keeps its tokens up to its first rejected draft."""
    starts, sizes = groups
    drawn, logprobs, failed = sample_rows(sampler, table, logits, slots, rules, to_host)
    # A position is kept when every draft before it in its request was accepted.
    ok = (drawn >= 0) & (drawn == drafts)
    group_of = np.repeat(np.arange(len(starts)), sizes)
    misses_before = np.cumsum(~ok) - (~ok)  # over the whole step, this position excluded
    keep = misses_before == misses_before[starts][group_of]  # none earlier in its request
    counts = np.bincount(group_of[keep], minlength=len(starts)).astype(np.int32)
    tokens = drawn[keep]
    accepted = tokens >= 0
    table.append_tokens(slots[keep][accepted], tokens[accepted])
    flat_index = np.full(len(drawn), -1, np.int64)
    flat_index[keep] = np.arange(int(keep.sum()))
    if len(logprobs.rows):
        kept = flat_index[logprobs.rows] >= 0
        logprobs = SampledLogprobs(
            rows=flat_index[logprobs.rows][kept],
            chosen=logprobs.chosen[kept],
            top_ids=logprobs.top_ids[kept],
            top_logprobs=logprobs.top_logprobs[kept],
            num_top=logprobs.num_top[kept],
        )
    return tokens, counts, logprobs, failed


def _flat_logprobs(
    pieces: list[tuple[np.ndarray, np.ndarray, SampledLogprobs]], counts: np.ndarray
) -> SampledLogprobs:
    """The per-position logprobs, their rows renumbered to flat token indices."""
    if not pieces:
        return SampledLogprobs.empty()
    if len(pieces) == 1 and np.array_equal(pieces[0][0], np.arange(len(counts))):
        return pieces[0][2]  # one position of every request: flat index = request index
    offsets = np.r_[0, np.cumsum(counts)[:-1]]
    width = max(p[2].top_ids.shape[1] for p in pieces)

    def padded(a: np.ndarray, fill) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)

    return SampledLogprobs(
        rows=np.concatenate([offsets[g] + j for g, j, _ in pieces]).astype(np.int64),
        chosen=np.concatenate([lp.chosen for _, _, lp in pieces]),
        top_ids=np.concatenate([padded(lp.top_ids, 0) for _, _, lp in pieces]),
        top_logprobs=np.concatenate([padded(lp.top_logprobs, 0.0) for _, _, lp in pieces]),
        num_top=np.concatenate([lp.num_top for _, _, lp in pieces]),
    )
