"""The runner's sampler: per-request sampling state by slot, and one token per sampled row.

`SamplingTable` holds per-request sampling state in arrays indexed by the scheduler's persistent
slot ids, so building a step's `SamplingBatch` is a few array gathers, not a loop over requests.
The host arrays decide what the step needs (any sampled row? penalties? logprobs?) without
asking the device. `Sampler` then does only that work:
- greedy rows take the argmax; a step of greedy rows never builds probabilities;
- the full-vocabulary log-softmax runs only over rows that asked for logprobs;
- sampled rows use the exponential race (argmax p_i / E_i with E_i ~ Exp(1) is a draw from p).
  Seeded rows draw E from a counter-based hash of (seed, output index, token id), so a seed gives
  the same tokens whatever else is in the batch and whichever step produces the token — with no
  generator object per row; the other rows share the runner's generator.
Rows with a structured-output grammar have the tokens it forbids set to -inf first, so that
penalties, top-k/top-p, the draw and the reported logprobs all see only what the grammar allows.
A row whose logits hold a NaN, or whose processed distribution masks every token, is reported
as failed (token -1), never answered with a token it could not have drawn.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from aieng.sampling import SamplingParams
from aieng.worker.runner_io import SampledLogprobs

UINT64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
MASK32_U64 = np.uint64(MASK32)
HASH_MULTIPLIER = 0x45D9F3B  # < 2**27: hashing 32-bit values in int64 never overflows


@dataclass
class SamplingBatch:
    """Sampling inputs of one step's S sampled rows; tensors on the model's device."""

    slots: np.ndarray  # (S,) slot of each row
    all_greedy: bool
    greedy: torch.Tensor  # (S,) bool
    temperature: torch.Tensor  # (S,) float32, 1.0 on greedy rows
    top_k: torch.Tensor  # (S,) int64, vocab size where off
    top_p: torch.Tensor  # (S,) float32
    min_p: torch.Tensor  # (S,) float32
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    penalties: Penalties | None  # None when no row has one
    # (B,) with blocked_ids: tokens banned on a row — the plan's (EOS and stop ids before
    # min_tokens, decided by the core) and the bad words'.
    blocked_rows: torch.Tensor | None
    blocked_ids: torch.Tensor | None  # (B,)
    seeded_rows: torch.Tensor | None  # (K,) rows with their own seed
    seeded_keys: torch.Tensor | None  # (K, 2) int64: 32-bit hash keys of (seed, output index)
    logprob_rows: np.ndarray  # (L,) rows that asked for logprobs
    num_logprobs: np.ndarray  # (L,) how many top logprobs each of them wants
    # Structured outputs: rows (M,) and their allowed tokens as a bitmask (M, ceil(V / 32))
    # int32, token t at bit t % 32 of word t / 32 (the StepPlan's grammar_bitmask()).
    grammar_bitmask: tuple[np.ndarray, np.ndarray] | None = None
    # logit_bias: rows (B,), token ids (B,), biases (B,) float32 — added after the reported
    # logprobs are taken, like penalties; allowed_token_ids: rows (A,), ids (A,) — every other
    # token of those rows is masked before anything else, like a grammar.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # Speculative decoding with a draft distribution: rows (P,), their draft tokens (P,) and
    # the distributions q (P, V) the drafts were drawn from; those rows take the draft with
    # probability min(1, p/q), else a draw from norm(max(0, p - q)) (`rejection_sample`).
    proposals: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.slots)


@dataclass
class Penalties:
    repetition: torch.Tensor  # (S,) float32
    presence: torch.Tensor  # (S,)
    frequency: torch.Tensor  # (S,)
    output_counts: torch.Tensor  # (S, V) int32
    prompt_mask: torch.Tensor  # (S, V) bool


# Columns of SamplingTable.floats, in order.
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


class SamplingTable:
    """Per-request sampling state indexed by slot id (the StepPlan's `slots`)."""

    def __init__(self, vocab_size: int, device: str | torch.device = "cpu", capacity: int = 64):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.floats = np.zeros((0, len(FLOAT_FIELDS)), np.float32)
        self.top_k = np.zeros(0, np.int64)
        self.seed = np.zeros(0, np.int64)
        self.has_seed = np.zeros(0, bool)
        self.greedy = np.zeros(0, bool)
        self.has_penalty = np.zeros(0, bool)
        # logit_bias, allowed_token_ids or bad_words: only these rows are walked in Python
        self.has_token_rules = np.zeros(0, bool)
        self.has_grammar = np.zeros(0, bool)  # structured outputs: masks from the core
        self.num_logprobs = np.zeros(0, np.int32)  # -1: no logprobs
        self.num_output = np.zeros(0, np.int64)
        # Slots whose rows are not plain greedy (see `plain_greedy`): a step of rows none of
        # which is here skips every per-row check.
        self.not_plain: set[int] = set()
        self.logit_bias: dict[int, tuple[list[int], list[float]]] = {}  # slot -> (ids, biases)
        self.allowed_ids: dict[int, list[int]] = {}  # slot -> allowed_token_ids
        self.bad_words: dict[int, list[list[int]]] = {}  # slot -> bad words' token ids
        self.recent: dict[int, list[int]] = {}  # slot -> its last output tokens (bad words)
        self.output_counts: torch.Tensor | None = None  # (capacity, V), made on first penalty
        self.prompt_mask: torch.Tensor | None = None
        self._grow(capacity)

    @property
    def capacity(self) -> int:
        return len(self.top_k)

    def add_request(
        self,
        slot: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
        bad_words_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """Set slot's state; `output_token_ids` are tokens it already generated (a request
        moved here mid-way), which count for penalties and seeded draws."""
        if slot >= self.capacity:
            self._grow(max(slot + 1, 2 * self.capacity))
        greedy = params.greedy
        self.floats[slot] = (
            1.0 if greedy else params.temperature,
            1.0 if greedy else params.top_p,
            0.0 if greedy else params.min_p,
            params.repetition_penalty,
            params.presence_penalty,
            params.frequency_penalty,
        )
        top_k = params.top_k if params.top_k > 0 and not greedy else self.vocab_size
        self.top_k[slot] = min(top_k, self.vocab_size)  # top_k past the vocabulary: all of it
        self.greedy[slot] = greedy
        self.has_seed[slot] = params.seed is not None
        self.has_grammar[slot] = params.structured_outputs is not None
        self.seed[slot] = np.uint64((params.seed or 0) & UINT64).astype(np.int64)
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.num_output[slot] = len(output_token_ids)
        if params.logit_bias:
            self.logit_bias[slot] = (list(params.logit_bias), list(params.logit_bias.values()))
        else:
            self.logit_bias.pop(slot, None)
        if params.allowed_token_ids:
            self.allowed_ids[slot] = list(params.allowed_token_ids)
        else:
            self.allowed_ids.pop(slot, None)
        if bad_words_ids:
            self.bad_words[slot] = [list(w) for w in bad_words_ids]
            self.recent[slot] = list(output_token_ids)[-self._bad_word_context(slot) :]
        else:
            self.bad_words.pop(slot, None)
            self.recent.pop(slot, None)
        has_penalty = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self.has_penalty[slot] = has_penalty
        self.has_token_rules[slot] = bool(
            params.logit_bias or params.allowed_token_ids or bad_words_ids
        )
        if has_penalty and self.output_counts is None:
            shape = (self.capacity, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        if has_penalty and self.output_counts is not None and self.prompt_mask is not None:
            self.output_counts[slot] = 0
            self.prompt_mask[slot] = False
            ids = torch.as_tensor(list(prompt_token_ids), dtype=torch.long)
            self.prompt_mask[slot, ids.to(self.device)] = True
            outputs = torch.as_tensor(list(output_token_ids), dtype=torch.long)
            counts = torch.bincount(outputs, minlength=self.vocab_size).to(torch.int32)
            self.output_counts[slot] = counts.to(self.device)
        self.not_plain.discard(slot)
        if not self._plain(slot):
            self.not_plain.add(slot)

    def remove_request(self, slot: int) -> None:
        self.not_plain.discard(slot)
        self.logit_bias.pop(slot, None)
        self.allowed_ids.pop(slot, None)
        self.bad_words.pop(slot, None)
        self.recent.pop(slot, None)
        if slot < self.capacity:
            self.has_penalty[slot] = False
            self.has_token_rules[slot] = False

    def batch(
        self, slots: np.ndarray, banned: tuple[np.ndarray, np.ndarray] | None = None
    ) -> SamplingBatch:
        """slots (S,): the slot of each sampled row, in the plan's sampling order. banned:
        the plan's token bans (rows into `slots`, token ids): the EOS and stop ids of rows
        whose request has not produced min_tokens yet, decided by the core."""
        slots = np.asarray(slots, dtype=np.int64)
        device = self.device
        floats = self.floats[slots]  # (S, len(FLOAT_FIELDS))
        greedy = self.greedy[slots]
        all_greedy = bool(greedy.all())
        top_k = self.top_k[slots]
        any_top_k = not all_greedy and bool(np.any(top_k < self.vocab_size))
        any_top_p = not all_greedy and bool(np.any(floats[:, 1] < 1.0))
        any_min_p = not all_greedy and bool(np.any(floats[:, 2] > 0.0))
        float_columns = torch.from_numpy(floats).to(device)
        penalties = None
        if self.output_counts is not None and self.prompt_mask is not None:
            if self.has_penalty[slots].any():
                index = torch.from_numpy(slots).to(device)
                penalties = Penalties(
                    repetition=float_columns[:, 3],
                    presence=float_columns[:, 4],
                    frequency=float_columns[:, 5],
                    output_counts=self.output_counts[index],
                    prompt_mask=self.prompt_mask[index],
                )
        blocked_rows = blocked_ids = None
        rows: list[int] = []
        ids: list[int] = []
        if banned is not None and len(banned[0]):
            rows += np.asarray(banned[0], np.int64).tolist()
            ids += np.asarray(banned[1], np.int64).tolist()
        ruled = np.flatnonzero(self.has_token_rules[slots]).tolist()  # rows with token rules
        for r in ruled:
            if int(slots[r]) in self.bad_words:
                bad = self._bad_word_bans(int(slots[r]))
                rows += [r] * len(bad)
                ids += bad
        if rows:
            blocked_rows = torch.tensor(rows, dtype=torch.long).to(device)
            blocked_ids = torch.tensor(ids, dtype=torch.long).to(device)
        seeded_rows = seeded_keys = None
        seeded = np.flatnonzero(self.has_seed[slots]) if not all_greedy else np.zeros(0, np.int64)
        if len(seeded):
            seeded_slots = slots[seeded]
            keys = _mix(self.seed[seeded_slots], self.num_output[seeded_slots])  # (K,) uint64
            halves = np.stack([keys & MASK32_U64, keys >> np.uint64(32)], axis=1).astype(np.int64)
            seeded_rows = torch.from_numpy(seeded).to(device)
            seeded_keys = torch.from_numpy(halves).to(device)
        num_logprobs = self.num_logprobs[slots]
        logprob_rows = np.flatnonzero(num_logprobs >= 0)
        bias = allowed = None
        if ruled:
            found = [
                (r, self.logit_bias[int(slots[r])]) for r in ruled if slots[r] in self.logit_bias
            ]
            if found:
                rows = [r for r, (ids, _) in found for _ in ids]
                ids = [t for _, (ids, _) in found for t in ids]
                values = [v for _, (_, vs) in found for v in vs]
                bias = (
                    torch.tensor(rows, dtype=torch.long).to(device),
                    torch.tensor(ids, dtype=torch.long).to(device),
                    torch.tensor(values, dtype=torch.float32).to(device),
                )
            found_ids = [
                (r, self.allowed_ids[int(slots[r])]) for r in ruled if slots[r] in self.allowed_ids
            ]
            if found_ids:
                allowed = (
                    torch.tensor([r for r, ids in found_ids for _ in ids], dtype=torch.long).to(
                        device
                    ),
                    torch.tensor([t for _, ids in found_ids for t in ids], dtype=torch.long).to(
                        device
                    ),
                )
        return SamplingBatch(
            slots=slots,
            all_greedy=all_greedy,
            greedy=torch.from_numpy(greedy).to(device),
            temperature=float_columns[:, 0],
            top_k=torch.from_numpy(top_k).to(device),
            top_p=float_columns[:, 1],
            min_p=float_columns[:, 2],
            any_top_k=any_top_k,
            any_top_p=any_top_p,
            any_min_p=any_min_p,
            penalties=penalties,
            blocked_rows=blocked_rows,
            blocked_ids=blocked_ids,
            seeded_rows=seeded_rows,
            seeded_keys=seeded_keys,
            logprob_rows=logprob_rows,
            num_logprobs=num_logprobs[logprob_rows],
            bias=bias,
            allowed=allowed,
        )

    def _bad_word_context(self, slot: int) -> int:
        return max((len(w) - 1 for w in self.bad_words.get(slot, ())), default=0)

    def _bad_word_bans(self, slot: int) -> list[int]:
        """The last token of each bad word whose other tokens end the output so far."""
        recent = self.recent.get(slot, [])
        banned = []
        for word in self.bad_words[slot]:
            prefix = word[:-1]
            if not prefix or recent[len(recent) - len(prefix) :] == prefix:
                banned.append(word[-1])
        return banned

    def _plain(self, slot: int) -> bool:
        """Whether slot's rows take the argmax of the raw logits: greedy, without penalties,
        token rules (logit bias, allowed ids, bad words), a grammar or logprobs."""
        return bool(
            self.greedy[slot]
            and not self.has_penalty[slot]
            and not self.has_token_rules[slot]
            and not self.has_grammar[slot]
            and self.num_logprobs[slot] < 0
        )

    def plain_greedy(self, slots: np.ndarray) -> bool:
        """Whether every row of `slots` (added slots) takes its argmax of the raw logits."""
        return not self.not_plain or self.not_plain.isdisjoint(np.asarray(slots).tolist())

    def append_tokens(self, slots: np.ndarray, token_ids: np.ndarray) -> None:
        """Record accepted tokens: token i belongs to slots[i] (a slot may repeat)."""
        slots = np.asarray(slots, dtype=np.int64)
        np.add.at(self.num_output, slots, 1)
        if self.bad_words:
            tokens = np.asarray(token_ids)
            for i in np.flatnonzero(self.has_token_rules[slots]).tolist():
                slot, token = int(slots[i]), int(tokens[i])
                if slot in self.bad_words:
                    keep = self._bad_word_context(slot)
                    history = [*self.recent.get(slot, []), token]
                    self.recent[slot] = history[len(history) - keep :] if keep else []
        if self.output_counts is not None and len(slots) and self.has_penalty[slots].any():
            index = torch.from_numpy(slots).to(self.device)
            tokens = torch.from_numpy(np.asarray(token_ids, np.int64)).to(self.device)
            ones = torch.ones(len(tokens), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((index, tokens), ones, accumulate=True)

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self.floats = np.concatenate([self.floats, np.ones((extra, len(FLOAT_FIELDS)), np.float32)])
        for name in (
            "top_k",
            "seed",
            "has_seed",
            "greedy",
            "has_penalty",
            "has_token_rules",
            "has_grammar",
            "num_logprobs",
            "num_output",
        ):
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.zeros(extra, old.dtype)]))
        if self.output_counts is not None and self.prompt_mask is not None:
            pad = (extra, self.vocab_size)
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(pad)])
            self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(pad)])


def _mix(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """SplitMix64 of (seed, output index) per row -> 64-bit keys; uint64 arithmetic wraps."""
    z = seeds.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = z + indices.astype(np.uint64) + np.uint64(1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser over int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * HASH_MULTIPLIER) & MASK32
    x = x ^ (x >> 16)
    x = (x * HASH_MULTIPLIER) & MASK32
    return x ^ (x >> 16)


def seeded_exponential(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys (K, 2) int64 -> Exp(1) noise (K, V) float32, a pure function of (key, token id)."""
    ids = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :]
    bits = _hash32(_hash32(ids ^ keys[:, :1]) ^ keys[:, 1:])  # (K, V) in [0, 2**32)
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 bits
    return -torch.log(uniform)


@dataclass
class DeviceLogprobs:
    """Logprobs of the rows that asked for them, still on the device."""

    rows: np.ndarray  # (L,) host
    num_top: np.ndarray  # (L,) host
    chosen: torch.Tensor  # (L,) float32
    top_ids: torch.Tensor  # (L, K) int64
    top_logprobs: torch.Tensor  # (L, K) float32

    def to_host(self) -> SampledLogprobs:
        """Call after the device work is done (the runner waits once per step)."""
        return SampledLogprobs(
            rows=self.rows.astype(np.int64),
            chosen=self.chosen.cpu().numpy(),
            top_ids=self.top_ids.cpu().numpy(),
            top_logprobs=self.top_logprobs.cpu().numpy(),
            num_top=self.num_top.astype(np.int32),
        )


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # (S,) int64 on the device; -1 on failed rows
    logprobs: DeviceLogprobs | None


class Sampler:
    """logits (S, V) + SamplingBatch -> one token per row, with logprobs where asked."""

    def __init__(self, device: str | torch.device = "cpu", seed: int | None = None):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        if batch.grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, *batch.grammar_bitmask)
        if batch.allowed is not None:
            logits = allow_only(logits, *batch.allowed)
        raw_logprobs = None
        if len(batch.logprob_rows):  # reported logprobs: before any processing
            rows = torch.from_numpy(batch.logprob_rows).to(logits.device)
            raw_logprobs = torch.log_softmax(logits[rows], dim=-1)
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        if batch.bias is not None:
            logits = logits.index_put(
                (batch.bias[0], batch.bias[1]), batch.bias[2], accumulate=True
            )
        if batch.blocked_rows is not None:
            logits.index_put_(
                (batch.blocked_rows, batch.blocked_ids),
                torch.tensor(-math.inf, device=logits.device),
            )
        tokens = greedy_tokens(logits)
        if not batch.all_greedy:
            tokens = torch.where(batch.greedy, tokens, self._sample(logits, batch))
        return SamplerOutput(tokens, _logprobs(raw_logprobs, tokens, batch))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature[:, None]
        if batch.any_min_p:
            probs = logits.softmax(dim=-1)
            threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, -math.inf)
        if batch.any_top_k or batch.any_top_p:
            logits = apply_top_k_top_p(logits, batch)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        if batch.seeded_rows is not None and batch.seeded_keys is not None:
            noise[batch.seeded_rows] = seeded_exponential(batch.seeded_keys, probs.shape[-1])
        tokens = exponential_race(probs, noise)
        if batch.proposals is not None:
            rows, drafts, q = batch.proposals
            uniform = torch.rand(len(rows), generator=self.generator, device=probs.device)
            tokens[rows] = rejection_sample(probs[rows], q, drafts, uniform, noise[rows])
        return tokens


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniform: torch.Tensor, noise
) -> torch.Tensor:
    """Leviathan et al. / Chen et al.: p, q (P, V) the target's processed distribution and the
    one each draft was drawn from; the draft (P,) is kept when uniform * q(draft) < p(draft)
    (probability min(1, p/q)), else the token is drawn from norm(max(0, p - q)) by the
    exponential race over `noise` (P, V). The result is distributed as p, whatever q is."""
    p_draft = p.gather(1, drafts[:, None])[:, 0]
    q_draft = q.gather(1, drafts[:, None])[:, 0]
    accept = uniform * q_draft < p_draft
    residual = exponential_race((p - q).clamp_min(0.0), noise)
    # The residual is empty only where p <= q everywhere, i.e. p = q: the draft is then kept.
    residual = torch.where(residual >= 0, residual, exponential_race(p, noise))
    return torch.where(accept, drafts, residual)


def allow_only(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits (S, V): on each row named in `rows`, every token but its (row, id) pairs -> -inf
    (allowed_token_ids)."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[rows, ids] = True
    restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    restricted[rows] = True
    return logits.masked_fill(restricted[:, None] & ~keep, -math.inf)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) per row, noise ~ Exp(1): a draw from probs (the exponential race,
    Gumbel-max's twin). -1 where nothing can be drawn (a NaN, or every probability 0).

    Exp(1) noise can be exactly 0 (a uniform rounded to 1 in float32; torch's exponential_
    at u = 0): it is raised to the smallest normal float, so that such a token wins if it has
    any probability and a token of probability 0 gives 0 / tiny = 0, never 0 / 0 = NaN — which
    argmax would pick and fail the row."""
    race = probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)
    tokens = row_argmax(race)
    drawn = race.gather(1, tokens[:, None])[:, 0] > 0  # False for NaN and masked (0)
    return torch.where(drawn, tokens, torch.full_like(tokens, -1))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: its argmax, or -1 where that could not have been drawn — its
    logit not finite (masked, or NaN: a row holding a NaN has its argmax there). On the CPU
    in numpy, where each torch op's dispatch costs more than the work."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.contiguous().numpy()
        ids = values.argmax(axis=-1)
        valid = np.isfinite(values[np.arange(len(ids)), ids])
        return torch.from_numpy(np.where(valid, ids, -1))
    tokens = row_argmax(logits)
    valid = torch.isfinite(logits.gather(1, tokens[:, None])[:, 0])
    return torch.where(valid, tokens, torch.full_like(tokens, -1))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value (the first NaN if the row holds one). On the CPU
    through numpy, whose vectorised argmax is ~15x faster than torch's here."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.contiguous().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def apply_grammar_bitmask(
    logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray
) -> torch.Tensor:
    """logits (S, V); rows (M,) and bitmask (M, W) int32 -> logits with the tokens each masked
    row's grammar forbids at -inf (in place)."""
    if len(rows) == 0:
        return logits
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and sys.byteorder == "little":
        blocked = unpack_bitmask_numpy(bitmask, vocab).logical_not_()
    else:
        blocked = unpack_bitmask(bitmask, vocab, logits.device).logical_not_()
    if len(rows) == logits.shape[0] and np.array_equal(rows, np.arange(len(rows))):
        return logits.masked_fill_(blocked, -math.inf)
    index = torch.from_numpy(np.asarray(rows, np.int64)).to(logits.device)
    logits[index] = logits[index].masked_fill(blocked, -math.inf)
    return logits


def unpack_bitmask(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """(M, W) int32 words -> (M, vocab) bool, token t allowed at bit t % 32 of word t / 32;
    only the words travel to the device."""
    words = torch.from_numpy(bitmask).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((words[:, :, None] >> shifts) & 1).reshape(len(words), -1)[:, :vocab] == 1


def unpack_bitmask_numpy(bitmask: np.ndarray, vocab: int) -> torch.Tensor:
    """unpack_bitmask on the CPU through numpy (~10x faster): on a little-endian host the words'
    bytes hold the tokens in order, least significant bit first."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(np.ascontiguousarray(bits).view(bool))  # 0/1 bytes are bools


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output; presence, frequency over output."""
    counts = p.output_counts
    seen = p.prompt_mask | (counts > 0)
    penalty = p.repetition[:, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, penalised, logits)
    logits = logits - p.frequency[:, None] * counts
    return logits - p.presence[:, None] * (counts > 0)


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V)
    if batch.any_top_k:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(ranks[None] >= batch.top_k[:, None], -math.inf)
    if batch.any_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the first token is always kept
        sorted_logits.masked_fill_(mass_before > batch.top_p[:, None], -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(
    raw_logprobs: torch.Tensor | None, tokens: torch.Tensor, batch: SamplingBatch
) -> DeviceLogprobs | None:
    if raw_logprobs is None:
        return None
    rows = torch.from_numpy(batch.logprob_rows).to(tokens.device)
    chosen = raw_logprobs.gather(1, tokens[rows].clamp(min=0)[:, None])[:, 0]
    k = min(int(batch.num_logprobs.max(initial=0)), raw_logprobs.shape[-1])
    top_values, top_ids = raw_logprobs.topk(k, dim=-1)  # (L, K)
    return DeviceLogprobs(batch.logprob_rows, batch.num_logprobs, chosen, top_ids, top_values)
