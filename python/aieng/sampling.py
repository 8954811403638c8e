"""Sampling parameters (vLLM's names and defaults) and the batched sampler.

`SamplingParams` is validated when it is built. `SamplingTable` holds per-request sampling state in
arrays indexed by the scheduler's persistent slot ids, so building a step's `SamplingBatch` is a few
array gathers, not a loop over requests. `Sampler` draws one token per row with torch ops over the
whole batch; only rows with their own seed get a Python-level generator each.

Seeded rows draw from noise that depends only on (seed, index of the output token), so a seed
gives the same tokens whatever else is in the batch and whichever step produces the token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
UINT64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_float("temperature", self.temperature, minimum=0.0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        self.stop = _check_stop(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise ValueError(
                    f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}"
                )
            for token in self.stop_token_ids:
                _check_int("stop_token_ids", token, minimum=0)
            self.stop_token_ids = list(self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def _check_int(name: str, value: object, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object, minimum: float | None = None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_stop(stop: object) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stops)


@dataclass
class SampledLogprobs:
    chosen: np.ndarray  # (S,) float32: log-probability of each sampled token
    top_ids: np.ndarray  # (S, K) int64: K = the largest `logprobs` asked for in the batch
    top_logprobs: np.ndarray  # (S, K) float32; row s is valid up to num_top[s]
    num_top: np.ndarray  # (S,) int32: `logprobs` of each row (0 when not asked for)


@dataclass
class SamplingBatch:
    """Sampling inputs of one step's S sampled rows, on the model's device."""

    slots: np.ndarray  # (S,) slot of each row
    temperature: torch.Tensor  # (S,) float32, 1.0 on greedy rows
    greedy: torch.Tensor  # (S,) bool
    top_k: torch.Tensor  # (S,) int64, vocab size where off
    top_p: torch.Tensor  # (S,) float32
    min_p: torch.Tensor  # (S,) float32
    repetition_penalty: torch.Tensor  # (S,) float32
    presence_penalty: torch.Tensor  # (S,) float32
    frequency_penalty: torch.Tensor  # (S,) float32
    output_counts: torch.Tensor | None  # (S, V) int32, None when no row has a penalty
    prompt_mask: torch.Tensor | None  # (S, V) bool
    seeded_rows: list[tuple[int, int]]  # (row, generator seed) of rows with their own seed
    blocked_tokens: list[tuple[int, list[int]]]  # (row, ids) banned until min_tokens
    num_logprobs: np.ndarray  # (S,) int32
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @property
    def num_rows(self) -> int:
        return len(self.slots)


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
    """Per-request sampling state indexed by slot id (the StepPlan's `slots`).

    The engine calls `add_request` when a request gets its slot, `batch(plan)` before each step
    and `append_tokens(batch, token_ids)` with the tokens the step sampled.
    """

    def __init__(self, vocab_size: int, device: str | torch.device = "cpu", capacity: int = 64):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.floats = np.zeros((0, len(FLOAT_FIELDS)), np.float32)
        self.top_k = np.zeros(0, np.int64)
        self.seed = np.zeros(0, np.int64)
        self.has_seed = np.zeros(0, bool)
        self.greedy = np.zeros(0, bool)
        self.num_logprobs = np.zeros(0, np.int32)
        self.num_output = np.zeros(0, np.int64)
        self.min_tokens = np.zeros(0, np.int64)
        self.min_tokens_ids: dict[int, list[int]] = {}
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
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """Set slot's state; `output_token_ids` are tokens it already generated (recompute)."""
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
        self.top_k[slot] = self.vocab_size if greedy or params.top_k <= 0 else params.top_k
        self.greedy[slot] = greedy
        self.has_seed[slot] = params.seed is not None
        self.seed[slot] = np.uint64((params.seed or 0) & UINT64).astype(np.int64)
        self.num_logprobs[slot] = params.logprobs or 0
        self.num_output[slot] = len(output_token_ids)
        self.min_tokens[slot] = params.min_tokens
        banned = list(params.stop_token_ids or ()) + (
            [] if params.ignore_eos else list(eos_token_ids)
        )
        if params.min_tokens > 0 and banned:
            self.min_tokens_ids[slot] = banned
        else:
            self.min_tokens_ids.pop(slot, None)
        has_penalty = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        if has_penalty and self.output_counts is None:
            shape = (self.capacity, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        if self.output_counts is not None and self.prompt_mask is not None:
            self.output_counts[slot] = 0
            self.prompt_mask[slot] = False
            if has_penalty:
                ids = torch.as_tensor(list(prompt_token_ids), dtype=torch.long, device=self.device)
                self.prompt_mask[slot, ids] = True
                outputs = torch.as_tensor(list(output_token_ids), dtype=torch.long)
                counts = torch.bincount(outputs, minlength=self.vocab_size).to(torch.int32)
                self.output_counts[slot] = counts.to(self.device)

    def remove_request(self, slot: int) -> None:
        self.min_tokens_ids.pop(slot, None)

    def batch(self, plan) -> SamplingBatch:
        rows = np.asarray(plan.sample_request_rows, dtype=np.int64)
        slots = np.asarray(plan.slots, dtype=np.int64)[rows]
        floats = torch.from_numpy(self.floats[slots]).to(self.device)  # (S, len(FLOAT_FIELDS))
        columns = dict(zip(FLOAT_FIELDS, floats.unbind(1), strict=True))
        top_k = self.top_k[slots]
        counts = mask = None
        if self.output_counts is not None and self.prompt_mask is not None:
            index = torch.from_numpy(slots).to(self.device)
            counts, mask = self.output_counts[index], self.prompt_mask[index]
        seeded = np.flatnonzero(self.has_seed[slots])
        blocked = np.flatnonzero(self.num_output[slots] < self.min_tokens[slots])
        return SamplingBatch(
            slots=slots,
            greedy=torch.from_numpy(self.greedy[slots]).to(self.device),
            top_k=torch.from_numpy(top_k).to(self.device),
            output_counts=counts,
            prompt_mask=mask,
            seeded_rows=[
                (int(r), _mix(int(self.seed[slots[r]]) & UINT64, int(self.num_output[slots[r]])))
                for r in seeded
            ],
            blocked_tokens=[
                (int(r), self.min_tokens_ids[int(slots[r])])
                for r in blocked
                if int(slots[r]) in self.min_tokens_ids
            ],
            num_logprobs=self.num_logprobs[slots],
            any_top_k=bool(np.any(top_k < self.vocab_size)),
            any_top_p=bool(np.any(self.floats[slots, 1] < 1.0)),
            any_min_p=bool(np.any(self.floats[slots, 2] > 0.0)),
            **columns,
        )

    def append_tokens(self, batch: SamplingBatch, token_ids: np.ndarray) -> None:
        """Record the tokens a step sampled (one per row of `batch`)."""
        self.num_output[batch.slots] += 1
        if self.output_counts is not None and batch.num_rows:
            slots = torch.from_numpy(batch.slots).to(self.device)
            tokens = torch.as_tensor(np.asarray(token_ids, np.int64), device=self.device)
            ones = torch.ones(len(tokens), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((slots, tokens), ones, accumulate=True)

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self.floats = np.concatenate([self.floats, np.ones((extra, len(FLOAT_FIELDS)), np.float32)])
        for name in (
            "top_k",
            "seed",
            "has_seed",
            "greedy",
            "num_logprobs",
            "num_output",
            "min_tokens",
        ):
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.zeros(extra, old.dtype)]))
        if self.output_counts is not None and self.prompt_mask is not None:
            pad = (extra, self.vocab_size)
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(pad)])
            self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(pad)])


def _mix(seed: int, index: int) -> int:
    """SplitMix64 of (seed, output index) -> a generator seed in [0, 2**63)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & UINT64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & UINT64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & UINT64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """logits (S, V) + SamplingBatch -> one token per row, with logprobs."""

    def __init__(self, device: str | torch.device = "cpu", seed: int | None = None):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, SampledLogprobs]:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # reported logprobs: before any processing
        if batch.output_counts is not None:
            logits = apply_penalties(logits, batch)
        if batch.blocked_tokens:
            logits = logits.clone()
            for row, ids in batch.blocked_tokens:
                logits[row, ids] = -math.inf
        tokens = logits.argmax(dim=-1)
        if not bool(batch.greedy.all()):
            sampled = self._sample(logits, batch)
            tokens = torch.where(batch.greedy, tokens, sampled)
        return tokens, _logprobs(raw_logprobs, tokens, batch.num_logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits / batch.temperature[:, None]
        if batch.any_min_p:
            probs = logits.softmax(dim=-1)
            threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, -math.inf)
        if batch.any_top_k or batch.any_top_p:
            logits = apply_top_k_top_p(logits, batch)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in batch.seeded_rows:
            generator = torch.Generator(self.device).manual_seed(seed)
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output; presence, frequency over output."""
    counts, prompt_mask = batch.output_counts, batch.prompt_mask
    assert counts is not None and prompt_mask is not None
    seen = prompt_mask | (counts > 0)
    penalty = batch.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, penalised, logits)
    logits = logits - batch.frequency_penalty[:, None] * counts
    return logits - batch.presence_penalty[:, None] * (counts > 0)


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
    raw_logprobs: torch.Tensor, tokens: torch.Tensor, num_logprobs: np.ndarray
) -> SampledLogprobs:
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
    k = min(int(num_logprobs.max(initial=0)), raw_logprobs.shape[-1])
    top_values, top_ids = raw_logprobs.topk(k, dim=-1)  # (S, K)
    return SampledLogprobs(
        chosen=chosen.cpu().numpy(),
        top_ids=top_ids.cpu().numpy().astype(np.int64),
        top_logprobs=top_values.cpu().numpy(),
        num_top=num_logprobs.astype(np.int32),
    )
