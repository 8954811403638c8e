"""Prometheus metrics with vLLM's names under an `aieng_` prefix.

Engine-side values (running, waiting, KV usage, prefix cache, preemptions) are read from the
engine loop's last published `EngineStats` at scrape time; request-side values are counted and
observed as requests finish.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aieng.engine.engine_client import EngineStats

if TYPE_CHECKING:
    from aieng.worker.gpu_memory import GpuMemory

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterable[Metric]:
        stats = self.stats() or EngineStats()
        labels = ["model_name"]
        values: list[tuple[type, str, str, float]] = [
            (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
             stats.num_running),
            (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.",
             stats.num_waiting),
            (GaugeMetricFamily, "max_num_seqs",
             "Requests the running batch can hold (batch fill = running / this).",
             stats.max_num_seqs),
            (GaugeMetricFamily, "kv_cache_num_blocks",
             "KV cache blocks in the pool (what kv_cache_memory holds at the cache's dtype).",
             stats.num_blocks),
            (GaugeMetricFamily, "kv_cache_usage_perc",
             "Fraction of KV blocks held by requests (1 = full); cached free blocks count free.",
             stats.kv_cache_usage),
            (GaugeMetricFamily, "kv_cache_cached_blocks",
             "Free KV blocks that still hold a reusable cached prefix.", stats.num_cached_blocks),
            (CounterMetricFamily, "prefix_cache_queries",
             "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            (CounterMetricFamily, "prefix_cache_hits",
             "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            (CounterMetricFamily, "num_preemptions", "Requests preempted for KV space.",
             stats.num_preemptions),
            (CounterMetricFamily, "engine_steps", "Engine steps run.", stats.num_steps),
            (GaugeMetricFamily, "step_token_budget",
             "Token budget of the last step: max_num_batched_tokens, less while clients share "
             "the engine and the step is bounded in time (shared_step_ms).",
             stats.step_token_budget),
            (CounterMetricFamily, "spec_decode_num_drafts",
             "Speculative decoding: requests' drafts verified.", stats.spec_decode_num_drafts),
            (CounterMetricFamily, "spec_decode_num_draft_tokens",
             "Speculative decoding: draft tokens verified.", stats.spec_decode_num_draft_tokens),
            (CounterMetricFamily, "spec_decode_num_accepted_tokens",
             "Speculative decoding: draft tokens accepted.",
             stats.spec_decode_num_accepted_tokens),
        ]  # fmt: skip
        for family, name, doc, value in values:
            metric = family(f"aieng_{name}", doc, labels=labels)
            metric.add_metric([self.model_name], value)
            yield metric
        per_position = CounterMetricFamily(
            "aieng_spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each draft position (0 first).",
            labels=[*labels, "position"],
        )
        for position, value in enumerate(stats.spec_decode_accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], value)
        yield per_position
        if stats.kv_cache_dtype:  # vLLM's cache_config_info: the cache's configuration as labels
            info = GaugeMetricFamily(
                "aieng_cache_config_info",
                "KV cache configuration (value 1): its dtype, block size and number of blocks.",
                labels=[*labels, "cache_dtype", "block_size", "num_blocks"],
            )
            config = [stats.kv_cache_dtype, str(stats.block_size), str(stats.num_blocks)]
            info.add_metric([self.model_name, *config], 1)
            yield info
        if stats.kernels:
            names = sorted(stats.kernels)
            kernels = GaugeMetricFamily(
                "aieng_kernel_config_info",
                "Compute paths chosen at load (value 1): the attention backend, the linear "
                "layers' kernels and the CPU instruction set the CPU kernels run on ('' off CPU).",
                labels=[*labels, *names],
            )
            kernels.add_metric([self.model_name, *(stats.kernels[n] for n in names)], 1)
            yield kernels


class GpuMemoryCollector(Collector):
    """aieng_gpu_memory_bytes{component}: weights, KV cache, activation peak, CUDA context and
    the device's totals (aieng.worker.gpu_memory), read at scrape time; nothing off a GPU."""

    def __init__(self, figures: Callable[[], GpuMemory | None], model_name: str):
        self.figures, self.model_name = figures, model_name

    def collect(self) -> Iterable[Metric]:
        figures = self.figures()
        if figures is None:
            return
        metric = GaugeMetricFamily(
            "aieng_gpu_memory_bytes",
            "GPU memory by component: weights, kv_cache, activation_peak, cuda_context (NVML), "
            "torch's allocated and reserved, the device's used and total.",
            labels=["model_name", "component"],
        )
        for component, value in figures.gauges().items():
            metric.add_metric([self.model_name, component], value)
        yield metric


class ServiceCollector(Collector):
    """The server's own state: whether its engine is dead (an alert's input), its uptime, the
    requests waiting at the fair gate for their turn to go to the engine, and —
    given the machine's price (`--cost-per-hour`) — what it has cost and what a thousand output
    tokens cost over its life so far. The cost is the machine's: idle time is paid for too."""

    def __init__(
        self,
        model_name: str,
        engine_dead: Callable[[], bool],
        generated_tokens: Callable[[], float],
        cost_per_hour: float | None,
        load_phases: Callable[[], dict[str, float] | None] = lambda: None,
        admission_waiting: Callable[[], int] = lambda: 0,
    ):
        self.model_name, self.engine_dead, self.load_phases = model_name, engine_dead, load_phases
        self.admission_waiting = admission_waiting
        self.generated_tokens, self.cost_per_hour = generated_tokens, cost_per_hour
        self.started = time.monotonic()

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name"]
        uptime = time.monotonic() - self.started
        dead = GaugeMetricFamily(
            "aieng_engine_dead",
            "1 once the engine loop has died (the server answers 503).",
            labels=labels,
        )
        dead.add_metric([self.model_name], float(self.engine_dead()))
        yield dead
        up = CounterMetricFamily(
            "aieng_uptime_seconds", "Seconds since the server started.", labels=labels
        )
        up.add_metric([self.model_name], uptime)
        yield up
        waiting = GaugeMetricFamily(
            "aieng_admission_waiting",
            "Requests (one per prompt) admitted and waiting at the fair gate for their turn to "
            "go to the engine.",
            labels=labels,
        )
        waiting.add_metric([self.model_name], float(self.admission_waiting()))
        yield waiting
        phases = self.load_phases()
        if phases is not None:
            load = GaugeMetricFamily(
                "aieng_model_load_seconds",
                "Where loading the model went: build, read, place (convert and copy to the "
                "device), repack (quantized layers), kv_cache (sizing and allocation).",
                labels=[*labels, "phase"],
            )
            for phase, seconds in phases.items():
                load.add_metric([self.model_name, phase], seconds)
            yield load
        if self.cost_per_hour is None:
            return
        cost = self.cost_per_hour * uptime / 3600
        total = CounterMetricFamily(
            "aieng_cost_usd",
            "What the machine has cost since the server started (--cost-per-hour).",
            labels=labels,
        )
        total.add_metric([self.model_name], cost)
        yield total
        tokens = self.generated_tokens()
        per_1k = GaugeMetricFamily(
            "aieng_cost_per_1k_output_tokens",
            "Machine cost per 1000 generated tokens since the server started (NaN before any).",
            labels=labels,
        )
        per_1k.add_metric([self.model_name], cost / tokens * 1000 if tokens else math.nan)
        yield per_1k


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        gpu_memory: Callable[[], GpuMemory | None] = lambda: None,
        engine_dead: Callable[[], bool] = lambda: False,
        cost_per_hour: float | None = None,
        load_phases: Callable[[], dict[str, float] | None] = lambda: None,
        admission_waiting: Callable[[], int] = lambda: 0,
    ):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds
        self.registry.register(EngineCollector(stats, model_name))
        self.registry.register(GpuMemoryCollector(gpu_memory, model_name))
        self.registry.register(
            ServiceCollector(
                model_name,
                engine_dead,
                self._generated_tokens,
                cost_per_hour,
                load_phases,
                admission_waiting,
            )
        )
        model = ["model_name"]

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"aieng_{name}", doc, [*model, *labels], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple = LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"aieng_{name}", doc, model, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Finished completions by finish reason.", "finished_reason"
        )
        self.request_rejected = counter(
            "request_rejected", "Requests refused, by reason.", "reason"
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two outputs.")
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Mean time per output token after the first."
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last output.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.")
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", STEP_TOKEN_BUCKETS
        )
        self.shadow_requests = counter(
            "shadow_requests",
            "Shadow traffic by outcome: compared, dropped (load), skipped (n > 1 or several "
            "prompts), failed, primary_incomplete.",
            "outcome",
        )
        self.shadow_agreement = counter(
            "shadow_agreement", "Compared shadow requests whose text matched the primary's."
        )
        self.shadow_latency_ratio = histogram(
            "shadow_latency_ratio",
            "Shadow latency / primary latency per compared request.",
            (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0),
        )
        self.http_requests = counter(
            "http_requests", "HTTP answers by route and status code.", "route", "status"
        )

        self.generated = 0  # tokens, for the cost per 1k
        # Series without a label beyond the model's exist from the start (at 0), so that a rate
        # over them is defined before the first request, not missing.
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl):
            metric.labels(model_name)
        for metric in (self.tpot, self.e2e, self.queue_time, self.iteration_tokens):
            metric.labels(model_name)
        for metric in (self.shadow_agreement, self.shadow_latency_ratio):
            metric.labels(model_name)

    def shadow_outcome(self, outcome: str) -> None:
        """A request not compared with its shadow: skipped, dropped, failed, primary_incomplete."""
        self.shadow_requests.labels(self.model_name, outcome).inc()

    def shadow_compared(self, exact_match: bool, latency_ratio: float | None) -> None:
        self.shadow_requests.labels(self.model_name, "compared").inc()
        if exact_match:
            self.shadow_agreement.labels(self.model_name).inc()
        if latency_ratio is not None:
            self.shadow_latency_ratio.labels(self.model_name).observe(latency_ratio)

    def _generated_tokens(self) -> float:
        return self.generated

    def observe_step(self, num_tokens: int) -> None:
        if num_tokens:
            self.iteration_tokens.labels(self.model_name).observe(num_tokens)

    def rejected(self, reason: str) -> None:
        self.request_rejected.labels(self.model_name, reason).inc()

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def finished(
        self,
        completion_tokens: int,
        finish_reasons: list[str],
        ttft: float | None,
        e2e: float,
        queue_time: float | None,
        tpot: float | None,
    ) -> None:
        m = self.model_name
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.generated += completion_tokens
        for reason in finish_reasons:
            self.request_success.labels(m, reason).inc()
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        if queue_time is not None:
            self.queue_time.labels(m).observe(queue_time)
        if tpot is not None:
            self.tpot.labels(m).observe(tpot)
        self.e2e.labels(m).observe(e2e)

    def inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)
