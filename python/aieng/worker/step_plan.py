"""The one plan contract: what a step's plan holds, as the runner reads it.

`StepPlan` is the contract of one engine step — the Rust core's `aieng._core.StepPlan` satisfies
it, and so must everything else that stands in for a plan: the copy a tensor-parallel rank
receives (`distributed.messages.PlanSnapshot`, which copies exactly `STEP_ARRAYS`), and the
plans tests build. `ForwardPlan` is its forward-only part (the token arrays a model forward and
an attention backend read): one-off forwards (prompt scoring, memory profiling, CUDA-graph
capture) build a `ForwardArrays`. A field added here is a field every producer must have: the
contract test (`tests/test_step_plan_contract.py`) fails for any producer that lacks one, the
Rust plan included.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class ForwardPlan(Protocol):
    """The token arrays of a forward: R rows (requests), T tokens laid out row after row."""

    input_ids: np.ndarray  # (T,) int32: the tokens to run
    positions: np.ndarray  # (T,) int32: their positions in their sequences
    slot_mapping: np.ndarray  # (T,) int32: each token's KV cache slot (block * size + offset)
    query_start_loc: np.ndarray  # (R + 1,) int32: row r's tokens are [qsl[r], qsl[r + 1])
    num_computed_tokens: np.ndarray  # (R,) int32: tokens of each row already in the cache
    seq_lens: np.ndarray  # (R,) int32: each row's context length after this step


@runtime_checkable
class StepPlan(ForwardPlan, Protocol):
    """One engine step: a forward, the rows that sample, and the block-table changes."""

    num_requests: int  # R
    num_tokens: int  # T
    slots: np.ndarray  # (R,) int32: each row's slot (its sampling row, its block table)
    logits_indices: np.ndarray  # (S,) int32: the token rows whose logits are sampled
    sample_request_rows: np.ndarray  # (S,) int32: the request row of each sampled token
    new_block_slots: np.ndarray  # (B,) int32: table[new_block_slots, new_block_indices]
    new_block_indices: np.ndarray  # (B,) int32:   = new_block_ids, applied each step
    new_block_ids: np.ndarray  # (B,) int32
    banned_rows: np.ndarray  # (K,) int32: sampling row i (into logits_indices) may not draw
    banned_ids: np.ndarray  # (K,) int32:   banned_ids[i]: EOS and stop ids before min_tokens

    def grammar_bitmask(self) -> Any:
        """The constrained rows' token masks (rows, bitmask), or None when no row has one."""
        ...


def _annotated(protocol: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in reversed(protocol.__mro__):
        if klass is object or klass is Protocol or not getattr(klass, "_is_protocol", False):
            continue
        for name in typing.get_type_hints(klass):
            if name not in names:
                names.append(name)
    return tuple(names)


FORWARD_ARRAYS = _annotated(ForwardPlan)
# Every field of a step plan: the arrays (copied to other ranks) and the two counts.
STEP_FIELDS = _annotated(StepPlan)
STEP_ARRAYS = tuple(name for name in STEP_FIELDS if name not in ("num_requests", "num_tokens"))


def missing_fields(plan: object, protocol: type = StepPlan) -> list[str]:
    """The contract's fields (and methods) `plan` lacks: [] for a conforming producer."""
    wanted = STEP_FIELDS if protocol is StepPlan else FORWARD_ARRAYS
    missing = [name for name in wanted if not hasattr(plan, name)]
    if protocol is StepPlan and not callable(getattr(plan, "grammar_bitmask", None)):
        missing.append("grammar_bitmask()")
    return missing


@dataclass(frozen=True)
class ForwardArrays:
    """A forward's arrays on their own: a one-off forward's plan (a `ForwardPlan`)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    num_computed_tokens: np.ndarray
    seq_lens: np.ndarray
