"""`speculative_config`: vLLM's dictionary, read and checked once, by name.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2}
    {"model": "path/to/draft", "num_speculative_tokens": 4}   # method "draft_model"
    {"model": "default-draft", ...}   # the draft shipped beside the default model

On the command line the word `draft` is short for the shipped draft with its measured k.
A draft must share its target's vocabulary and tokenizer (`check_draft`, at engine start).
Importing this module does not import torch (the CLI reads it for `--speculative-config`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# The longest n-gram looked up: the search grows with its square, and a match of 32 tokens
# already pins the continuation down.
MAX_PROMPT_LOOKUP = 32
MAX_DISABLE_BY_BATCH_SIZE = 1 << 20  # past any batch a step can hold
# The draft trained for the default model, shipped beside it, and its name in "model".
SHIPPED_DRAFT_NAME = "default-draft"
SHIPPED_DRAFT_PATH = Path(__file__).resolve().parent.parent / "default_model" / "draft"
# `--speculative-config draft`: the shipped draft with the k that measured best for it.
SHIPPED_DRAFT_WORD = "draft"
SHIPPED_DRAFT_TOKENS = 2
_KEYS = {
    "method": str,
    "model": str,
    "num_speculative_tokens": int,
    "prompt_lookup_max": int,
    "prompt_lookup_min": int,
    "disable_by_batch_size": int,
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative_config. `disable_by_batch_size`: no drafts in a step whose
    running requests exceed it (0: always speculate; None: the limit measured for the device,
    `measured_batch_limit`)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft checkpoint's folder
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """Reads vLLM's dictionary; ValueError naming the field that is wrong."""
        reason = refusal(value)
        if reason is not None:
            raise ValueError(f"speculative_config {reason}")
        given = dict(value)
        if "model" in given:
            given.setdefault("method", "draft_model")
            if given["model"] == SHIPPED_DRAFT_NAME:
                given["model"] = str(SHIPPED_DRAFT_PATH)
        return cls(**given)


# The largest batch at which speculation measured faster than plain decoding, by device type
# (`benches/bench_speculative.py --sweep`, ngram k=4 on the default model, 2 threads: 1.90x,
# 1.88x, 1.15x and 1.44x at 1, 2, 4 and 8 requests, 0.85x at 16 and 1.00x at 64; the table is
# benches/results/bench_speculative_sweep.md). Devices not measured speculate at any batch.
MEASURED_BATCH_LIMITS = {"cpu": 8}


def measured_batch_limit(config: SpeculativeConfig, device: str) -> int:
    """The batch size above which `config` stops speculating on `device` (0: never stops)."""
    if config.disable_by_batch_size is not None:
        return config.disable_by_batch_size
    return MEASURED_BATCH_LIMITS.get(device.split(":")[0], 0)


def refusal(value: Any) -> str | None:
    """Why `value` is not a valid speculative_config (None when it is): the EngineArgs check."""
    if not isinstance(value, dict):
        return f"must be a JSON object, got {value!r}"
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        return f"has unknown field {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})"
    for key, kind in _KEYS.items():
        if key in value and (not isinstance(value[key], kind) or isinstance(value[key], bool)):
            return f"'{key}' must be {'a string' if kind is str else 'an integer'}"
    method = value.get("method", "draft_model" if "model" in value else None)
    if method is None:
        return "needs 'method' (one of: " + ", ".join(METHODS) + ") or a draft 'model'"
    if method not in METHODS:
        return f"'method' {method!r} is unknown (one of: {', '.join(METHODS)})"
    if (method == "draft_model") != ("model" in value):
        return (
            "'method' draft_model needs 'model' (the draft's folder)"
            if method == "draft_model"
            else f"'model' is a draft model's field; method {method!r} takes none"
        )
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
    if high > MAX_PROMPT_LOOKUP:
        return f"'prompt_lookup_max' must be at most {MAX_PROMPT_LOOKUP}, got {high}"
    if not 0 <= value.get("disable_by_batch_size", 0) <= MAX_DISABLE_BY_BATCH_SIZE:
        return f"'disable_by_batch_size' must be in [0, {MAX_DISABLE_BY_BATCH_SIZE}]"
    return None


def parse_json(text: str) -> dict[str, Any]:
    """The `--speculative-config` flag's JSON text -> a dictionary (ValueError otherwise); the
    word `draft` is the shipped draft of the default model."""
    if text.strip() == SHIPPED_DRAFT_WORD:
        return {"model": SHIPPED_DRAFT_NAME, "num_speculative_tokens": SHIPPED_DRAFT_TOKENS}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {text}")
    return value


def check_draft(target: str | Path, draft: str | Path) -> None:
    """Refuses (ValueError, by name) a draft that cannot propose for `target`: a missing
    folder, another vocabulary size, another tokenizer (vocabulary, merges or added tokens)."""
    target, draft = Path(target), Path(draft)
    if not (draft / "config.json").is_file():
        raise ValueError(f"speculative_config 'model': no checkpoint (config.json) in {draft}")
    sizes = [_vocab_size(folder) for folder in (target, draft)]
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"speculative_config 'model': the draft's vocabulary has {sizes[1]} tokens, the "
            f"target's {sizes[0]}; a draft must share its target's tokenizer"
        )
    hashes = [tokenizer_hash(folder) for folder in (target, draft)]
    if hashes[0] != hashes[1]:
        raise ValueError(
            f"speculative_config 'model': the draft's tokenizer ({draft / 'tokenizer.json'}) "
            f"differs from the target's ({target / 'tokenizer.json'}); a draft must share its "
            "target's tokenizer"
        )


def tokenizer_hash(folder: Path) -> str:
    """A hash of what tokenizes in a folder's tokenizer.json: its model (vocabulary, merges)
    and added tokens."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"speculative_config 'model': no tokenizer.json in {folder}")
    data = json.loads(path.read_text(encoding="utf-8"))
    wanted = {"model": data.get("model"), "added_tokens": data.get("added_tokens")}
    return hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()


def _vocab_size(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if not isinstance(size, int):
        raise ValueError(f"speculative_config 'model': no vocab_size in {folder / 'config.json'}")
    return size
