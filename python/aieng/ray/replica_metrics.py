"""The ingress's `/metrics`, per replica: each replica's load, KV usage, prefix-cache hits and
model version, labelled `replica` (Ray Serve's replica id), beside the pooled figures
`aieng serve`'s names carry. Read from the replicas' last reports (`ReplicaBoard`) at scrape
time, so a replica that stopped reporting (gone, or not yet running) has no series."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aieng.ray.board import ReplicaBoard

LABELS = ["model_name", "replica"]


class ReplicaCollector(Collector):
    def __init__(self, board: ReplicaBoard, model_name: str):
        self.board, self.model_name = board, model_name

    def collect(self) -> Iterable[Metric]:
        reports = sorted(self.board.reports().items())
        draining = self.board.draining()
        gauges = {
            "num_requests_running": ("Requests in the replica's running batch.", []),
            "num_requests_waiting": ("Requests waiting in the replica's scheduler.", []),
            "kv_cache_usage_perc": ("Fraction of the replica's KV blocks held by requests.", []),
            "kv_cache_num_blocks": ("KV cache blocks in the replica's pool.", []),
            "prefix_cache_hit_rate": (
                "Prompt tokens found in the replica's prefix cache / tokens looked up (0 before "
                "any lookup).",
                [],
            ),
            "draining": ("1 while the ingress drains the replica (a rolling upgrade).", []),
            "num_requests": ("Requests the replica's engine holds (running or waiting).", []),
        }
        counters = {
            "prefix_cache_queries": (
                "Prompt tokens the replica looked up in its prefix cache.",
                [],
            ),
            "prefix_cache_hits": ("Prompt tokens found in the replica's prefix cache.", []),
        }
        info = GaugeMetricFamily(
            "aieng_replica_model_info",
            "The model version each replica serves (value 1; '' without a manifest).",
            labels=[*LABELS, "version"],
        )
        for replica, report in reports:
            stats, key = report.stats, [self.model_name, replica]
            queries = stats.prefix_cache_queries
            values = {
                "num_requests_running": stats.num_running,
                "num_requests_waiting": stats.num_waiting,
                "kv_cache_usage_perc": stats.kv_cache_usage,
                "kv_cache_num_blocks": stats.num_blocks,
                "prefix_cache_hit_rate": stats.prefix_cache_hits / queries if queries else 0.0,
                "draining": 1.0 if replica in draining else 0.0,
                "prefix_cache_queries": queries,
                "prefix_cache_hits": stats.prefix_cache_hits,
                "num_requests": stats.num_requests,
            }
            for name, (_doc, rows) in (gauges | counters).items():
                rows.append((key, values[name]))
            info.add_metric([*key, report.version], 1)
        for table, family in ((gauges, GaugeMetricFamily), (counters, CounterMetricFamily)):
            for name, (doc, rows) in table.items():
                metric = family(f"aieng_replica_{name}", doc, labels=LABELS)
                for key, value in rows:
                    metric.add_metric(key, value)
                yield metric
        yield info
