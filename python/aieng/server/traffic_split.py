"""Canary and shadow traffic: a candidate version served beside the primary one.

- **canary**: `percent` of generation requests are served by the candidate (the response's
  `x-aieng-model-version` names it); the rest by the primary.
- **shadow**: every eligible request is served by the primary and mirrored to the candidate,
  whose answer is never returned. When both have finished, the pair is compared — exact text
  match, and for greedy requests the first token where they differ — with both latencies;
  the result goes to `/metrics` (`aieng_shadow_requests_total{outcome}`,
  `aieng_shadow_agreement_total`, `aieng_shadow_latency_ratio`) and one JSON log line per pair
  (logger `aieng.shadow`).

Shadow work never delays the primary: the candidate is its own engine (its own scheduler and
KV cache), its requests run at a lower priority class than canary traffic there, and a mirror
is dropped — counted, never queued — when the primary has requests waiting or the candidate
already holds `max_num_seqs` requests. Only single-prompt, n = 1 requests are mirrored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aieng.engine.engine_client import EngineClient
    from aieng.server.views import AdmittedGeneration, ShadowHost

shadow_log = logging.getLogger("aieng.shadow")
SHADOW_PRIORITY = 10  # below canary and ordinary traffic (lower classes run first)
MODES = ("canary", "shadow")


@dataclass
class TrafficSplit:
    version: str
    engine: EngineClient
    mode: str  # canary | shadow
    percent: float = 0.0  # canary only
    rng: random.Random = field(default_factory=random.Random)
    tasks: set[asyncio.Task] = field(default_factory=set)

    def takes_request(self) -> bool:
        """Canary: does this request go to the candidate?"""
        return self.mode == "canary" and self.rng.random() * 100 < self.percent

    def describe(self) -> dict[str, Any]:
        body: dict[str, Any] = {"version": self.version, "mode": self.mode}
        if self.mode == "canary":
            body["percent"] = self.percent
        return body


def mirror(ctx: ShadowHost, split: TrafficSplit, primary: AdmittedGeneration) -> None:
    """After the primary request is admitted: mirror it to the shadow candidate, or count why
    not."""
    metrics = ctx.metrics
    if len(primary.prompts) != 1 or primary.n != 1:
        metrics.shadow_outcome("skipped")
        return
    stats, candidate = ctx.stats(), split.engine
    if (stats is not None and stats.num_waiting > 0) or (
        candidate.stats.num_requests >= candidate.model_info.max_num_seqs
    ):
        metrics.shadow_outcome("dropped")  # under load the mirror goes first
        return
    task = asyncio.create_task(_shadow(ctx, split, primary))
    split.tasks.add(task)
    task.add_done_callback(split.tasks.discard)


async def _shadow(ctx: ShadowHost, split: TrafficSplit, primary: AdmittedGeneration) -> None:
    params = primary.params[0]
    start = time.monotonic()
    tokens: list[int] = []
    text = ""
    reason = None
    try:
        async for out in split.engine.generate(
            f"shadow-{primary.engine_ids[0]}", primary.prompts[0], params, priority=SHADOW_PRIORITY
        ):
            completion = out.outputs[0]
            tokens += completion.token_ids
            text += completion.text
            reason = completion.finish_reason
    except Exception as error:
        ctx.metrics.shadow_outcome("failed")
        shadow_log.warning("shadow of %s failed: %s", primary.request_id, error)
        return
    shadow_s = time.monotonic() - start
    await primary.done.wait()
    choice = primary.choices[0]
    if choice.finish_reason in (None, "abort", "error"):
        ctx.metrics.shadow_outcome("primary_incomplete")
        return
    primary_s = (primary.last_output or time.monotonic()) - primary.arrival
    same_text = "".join(choice.text) == text
    record: dict[str, Any] = {
        "request_id": primary.request_id,
        "primary_version": primary.http.scope.get("state", {}).get("model_version"),
        "shadow_version": split.version,
        "exact_match": same_text,
        "primary_tokens": len(choice.token_ids),
        "shadow_tokens": len(tokens),
        "primary_finish_reason": choice.finish_reason,
        "shadow_finish_reason": reason,
        "primary_latency_s": round(primary_s, 4),
        "shadow_latency_s": round(shadow_s, 4),
    }
    if params.greedy:
        record["first_difference"] = first_difference(choice.token_ids, tokens)
    ctx.metrics.shadow_compared(same_text, shadow_s / primary_s if primary_s > 0 else None)
    shadow_log.info("%s", json.dumps(record))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token sequences differ (a length if one is a prefix of the
    other and they differ in length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
