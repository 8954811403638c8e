"""The pipeline: its steps in order over one `RagContext`, each under its own timeout, timed,
counted in Prometheus metrics by step and outcome, and degraded as it declares when it fails.
A step without a fallback (its `degrade` re-raises) fails the question."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from kjv_rag.steps import RagContext, Step

logger = logging.getLogger(__name__)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class PipelineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.step_seconds = Histogram(
            "rag_step_seconds", "Time per pipeline step.", ["step"],
            buckets=STEP_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.step_outcomes = Counter(
            "rag_step_outcomes", "Pipeline steps by outcome: ok, degraded, timeout.",
            ["step", "outcome"], registry=self.registry,
        )  # fmt: skip
        self.answers = Counter(
            "rag_answers", "Answers by what they had to do without (none: whole).",
            ["degraded"], registry=self.registry,
        )  # fmt: skip


class Pipeline:
    def __init__(self, steps: Sequence[Step], metrics: PipelineMetrics | None = None):
        self.steps = list(steps)
        self.metrics = metrics or PipelineMetrics()

    async def run(self, ctx: RagContext) -> RagContext:
        for step in self.steps:
            started = time.perf_counter()
            outcome = "ok"
            try:
                await asyncio.wait_for(step.run(ctx), step.timeout_s)
            except Exception as error:  # TimeoutError included
                outcome = "timeout" if isinstance(error, TimeoutError) else "degraded"
                ctx.errors[step.name] = f"{type(error).__name__}: {error}"[:300]
                logger.warning("rag step %s: %s; degrading", step.name, ctx.errors[step.name])
                step.degrade(ctx, error)
            finally:
                seconds = time.perf_counter() - started
                ctx.timings[step.name] = seconds
                self.metrics.step_seconds.labels(step.name).observe(seconds)
                self.metrics.step_outcomes.labels(step.name, outcome).inc()
        self.metrics.answers.labels(",".join(ctx.degraded) or "none").inc()
        return ctx
