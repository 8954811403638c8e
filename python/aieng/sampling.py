"""Sampling parameters, with vLLM's names and defaults, validated when they are built.

Numbers must also survive float32, the sampler's compute dtype: a temperature or a penalty that
overflows there (or whose inverse does) would make the sampler draw from NaN probabilities.
min_p and the presence and frequency penalties are bounded, so their ranges already ensure it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aieng.errors import invalid_field
from aieng.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from aieng._core import Grammar

GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32 (a subnormal)
MAX_TOP_K = (1 << 31) - 1  # top_k past the vocabulary means all of it; past int32 is an error
MAX_N = 1024  # sequences of one request: each is a request in the core
MAX_TOKENS = (1 << 31) - 1  # max_tokens and min_tokens: past any context, and within int32
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a 64-bit seed


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
    max_tokens: int = 16  # 0: score the prompt only (with prompt_logprobs), generate nothing
    min_tokens: int = 0
    logprobs: int | None = None
    # Log-probability of every prompt token given the ones before it, plus the top
    # `prompt_logprobs` alternatives at each position (vLLM's name). Computed in the prefill's
    # own forward; such a request reads no cached prefix (a cached block has no logits stored),
    # so it computes its whole prompt.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # only these token ids may be drawn (vLLM's allowed_token_ids)
    allowed_token_ids: list[int] | None = None
    # words never to generate (vLLM's bad_words): each is tokenized as written and with a
    # leading space; its last token is banned wherever the output ends with the others
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1, maximum=MAX_N)
        _check_float("temperature", self.temperature, minimum=0.0)
        # Non-greedy temperatures are >= GREEDY_EPS, so their inverse is finite too.
        _check_float32("temperature", self.temperature)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_float32("top_p", self.top_p, positive=True)
        _check_int("top_k", self.top_k, minimum=-1)
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k must be at most {MAX_TOP_K}, got {self.top_k}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_float32("repetition_penalty", self.repetition_penalty, inverse=True)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed, *SEED_RANGE)
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
        _check_int("max_tokens", self.max_tokens, minimum=0, maximum=MAX_TOKENS)
        _check_int("min_tokens", self.min_tokens, minimum=0, maximum=MAX_TOKENS)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        # logprobs and prompt_logprobs: bounded by the engine's max_logprobs (verify)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words
            ):
                raise ValueError(
                    f"bad_words must be a list of non-blank strings, got {self.bad_words!r}"
                )
            self.bad_words = list(self.bad_words) or None
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError(
                    "allowed_token_ids must be a non-empty list of ints, got "
                    f"{self.allowed_token_ids!r}"
                )
            for token in self.allowed_token_ids:
                _check_int("allowed_token_ids", token, minimum=0)
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{self.structured_outputs!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def verify(self, vocab_size: int, max_logprobs: int) -> None:
        """The checks that need the engine: token ids inside the model's vocabulary, and at most
        `max_logprobs` logprobs and prompt logprobs (-1: the vocabulary). Raises
        InvalidArgumentError (a ValueError) naming the field."""
        limit = vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > limit:
                raise invalid_field(
                    name,
                    f"{name}: {value} were asked for, at most {limit} are allowed (the engine's "
                    f"max_logprobs is {max_logprobs}, the vocabulary has {vocab_size} tokens)",
                )
        token_fields = {
            "stop_token_ids": self.stop_token_ids or (),
            "logit_bias": self.logit_bias or (),
            "allowed_token_ids": self.allowed_token_ids or (),
        }
        for name, tokens in token_fields.items():
            for token in tokens:
                if not 0 <= token < vocab_size:
                    message = f"token id {token} is outside the vocabulary [0, {vocab_size})"
                    raise invalid_field(name, f"{name}: {message}")

    def check_satisfiable(
        self,
        eos_token_ids: Collection[int],
        banned_ids: Collection[int] = (),
        grammar: Grammar | None = None,
    ) -> None:
        """Refuses a request that could never draw a token, knowable before it runs: every id
        of allowed_token_ids is banned (`banned_ids`: the one-token bad words), or, before
        min_tokens, ends the request (an EOS id unless ignore_eos, a stop id), which min_tokens
        masks, or is refused by the first step of `grammar` (the compiled structured_outputs).
        Raises InvalidArgumentError (a ValueError) naming the field."""
        if self.allowed_token_ids is None:
            return
        allowed, banned = set(self.allowed_token_ids), set(banned_ids)
        if allowed <= banned:
            raise invalid_field(
                "allowed_token_ids",
                "allowed_token_ids: every allowed token is a one-token bad word (bad_words), so "
                "no token can ever be drawn",
            )
        ending = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ending |= set(eos_token_ids)
        if grammar is not None:
            # Where the grammar may end, the ending ids are allowed: once min_tokens are out.
            ends = sorted(ending) if self.min_tokens == 0 else []
            if not grammar.allowed_first(sorted(allowed - banned), ends):
                raise invalid_field(
                    "allowed_token_ids",
                    f"allowed_token_ids: none of {sorted(allowed - banned)[:8]} can start the "
                    "output that the structured output constraint (structured_outputs or "
                    "response_format) requires, so no token can ever be drawn",
                )
        if self.min_tokens == 0:
            return
        if allowed <= banned | ending:
            raise invalid_field(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) can never be met: every token of "
                f"allowed_token_ids {sorted(allowed)[:8]} ends the request (an EOS id "
                f"{sorted(eos_token_ids)} unless ignore_eos, or one of stop_token_ids) or is a "
                "bad word, and min_tokens masks the ending ones",
            )


MAX_LOGIT_BIAS = 100.0


def _check_logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    checked = {}
    for token, value in bias.items():
        _check_int("logit_bias", token, minimum=0)
        _check_float("logit_bias", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {value}")
        checked[int(token)] = float(value)
    return checked or None


def _check_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None
) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_float(name: str, value: object, minimum: float | None = None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float32(name: str, value: float, positive: bool = False, inverse: bool = False) -> None:
    """The sampler computes in float32: `value` must stay finite there, and > 0 when `positive`.
    With `inverse` (a value the sampler divides by) it must be > 0, and so must 1/value."""
    values = (value, 1.0 / value) if inverse else (value,)
    if all(_survives_float32(v, positive or inverse) for v in values):
        return
    if inverse:
        limits = (
            f"between {1 / FLOAT32_MAX:.4g} and {FLOAT32_MAX:.4g}, so that it and its inverse "
            "are finite and positive in float32"
        )
    elif positive:
        limits = "positive and finite in float32"
    else:
        limits = f"finite in float32 (at most {FLOAT32_MAX:.4g})"
    raise ValueError(f"{name} must be {limits}, got {value!r}")


def _survives_float32(value: float, positive: bool) -> bool:
    try:
        (as_float32,) = struct.unpack("f", struct.pack("f", value))
    except OverflowError:  # some Pythons raise instead of rounding to inf
        return False
    return math.isfinite(as_float32) and (as_float32 > 0.0 or not positive)


def _check_stop(stop: object) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stops)
