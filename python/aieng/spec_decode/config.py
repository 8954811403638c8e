"""`speculative_config`: vLLM's dictionary, read and checked once, by name.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2}

Importing this module does not import torch (the CLI reads it for `--speculative-config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {
    "method": str,
    "num_speculative_tokens": int,
    "prompt_lookup_max": int,
    "prompt_lookup_min": int,
    "disable_by_batch_size": int,
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative_config. `disable_by_batch_size`: no drafts in a step whose
    running requests exceed it (0: always speculate)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 0

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """Reads vLLM's dictionary; ValueError naming the field that is wrong."""
        reason = refusal(value)
        if reason is not None:
            raise ValueError(f"speculative_config {reason}")
        given = dict(value)
        if "method" not in given and "model" in given:
            given["method"] = given.pop("model")
        return cls(**given)


def refusal(value: Any) -> str | None:
    """Why `value` is not a valid speculative_config (None when it is): the EngineArgs check."""
    if not isinstance(value, dict):
        return f"must be a JSON object, got {value!r}"
    if "model" in value:
        return "'model': a draft-model proposer is not available yet; use {'method': 'ngram', ...}"
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        return f"has unknown field {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})"
    for key, kind in _KEYS.items():
        if key in value and (not isinstance(value[key], kind) or isinstance(value[key], bool)):
            return f"'{key}' must be {'a string' if kind is str else 'an integer'}"
    method = value.get("method")
    if method is None:
        return "needs 'method' (one of: " + ", ".join(METHODS) + ")"
    if method not in METHODS:
        return f"'method' {method!r} is unknown (one of: {', '.join(METHODS)})"
    k = value.get("num_speculative_tokens")
    if k is None:
        return "needs 'num_speculative_tokens'"
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        return f"'num_speculative_tokens' must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
    low, high = value.get("prompt_lookup_min", 1), value.get("prompt_lookup_max", 4)
    if low < 1:
        return f"'prompt_lookup_min' must be at least 1, got {low}"
    if high < low:
        return f"'prompt_lookup_max' ({high}) must be at least 'prompt_lookup_min' ({low})"
    if value.get("disable_by_batch_size", 0) < 0:
        return "'disable_by_batch_size' must be at least 0"
    return None


def parse_json(text: str) -> dict[str, Any]:
    """The `--speculative-config` flag's JSON text -> a dictionary (ValueError otherwise)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {text}")
    return value
