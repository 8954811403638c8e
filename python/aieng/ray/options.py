"""How the replicas run on Ray: how many (fixed, or autoscaled between bounds on ongoing
requests), how requests reach them, what each asks of the cluster and how it stops."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

ROUTING_POLICIES = ("prefix", "round_robin")
ROUTER_CLASS = "aieng.ray.router.EngineReplicaRouter"


@dataclass(frozen=True)
class RayServeOptions:
    num_replicas: int = 1  # without min/max_replicas: this many, always
    min_replicas: int | None = None  # with max_replicas: autoscale between them
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0  # per replica, what the autoscaler aims at
    upscale_delay_s: float = 2.0  # load above target this long adds a replica
    downscale_delay_s: float = 10.0  # load below target this long drains one
    look_back_period_s: float = 10.0  # the autoscaler averages the load over this window
    max_ongoing_requests: int = 64  # per replica; past it the router passes a replica over
    routing: str = "prefix"  # "prefix" (prefix-cache affinity) or "round_robin"
    prefix_blocks: int = 4  # leading KV blocks of a prompt hashed for its affinity
    imbalance: int = 8  # requests more than the least loaded replica that end an affinity
    max_retries: int = 2  # replicas a request tries after one fails before it streams
    replica_num_cpus: float = 1.0  # Ray resources per replica (0 or a fraction shares cores)
    replica_num_gpus: float = 0.0
    ingress_num_cpus: float = 0.0
    graceful_shutdown_timeout_s: float = 60.0  # a draining replica's streams get this long
    health_check_period_s: float = 2.0
    stats_period_s: float = 0.5  # how often a replica reports its EngineStats

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both min_replicas and max_replicas (autoscaling), or neither")
        if self.autoscaling:
            assert self.min_replicas is not None and self.max_replicas is not None
            if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
                raise ValueError(
                    "autoscaling needs 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                    f"got {self.min_replicas} and {self.max_replicas}"
                )
        for name in ("num_replicas", "max_ongoing_requests", "prefix_blocks", "imbalance"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_retries", "replica_num_cpus", "replica_num_gpus", "ingress_num_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "target_ongoing_requests",
            "look_back_period_s",
            "stats_period_s",
            "health_check_period_s",
            "graceful_shutdown_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    def replica_deployment(self, block_size: int, board: str) -> dict[str, Any]:
        """The options of the replicas' `serve.deployment`. `board`: where the router keeps
        the replicas' stats for the ingress (`router.ReplicaBoard`)."""
        from ray.serve.config import RequestRouterConfig

        router = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={
                "policy": self.routing,
                "block_size": block_size,
                "prefix_blocks": self.prefix_blocks,
                "imbalance": self.imbalance,
                "board": board,
            },
            request_routing_stats_period_s=self.stats_period_s,
        )
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {
                "num_cpus": self.replica_num_cpus,
                "num_gpus": self.replica_num_gpus,
            },
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.5,
            "health_check_period_s": self.health_check_period_s,
            "request_router_config": router,
        }
        if self.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "initial_replicas": max(self.min_replicas or 0, 1),
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s,
                "metrics_interval_s": min(self.look_back_period_s / 2, 10.0),
            }
        else:
            options["num_replicas"] = self.num_replicas
        return options

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("Ray Serve options")
        kinds = {"int": int, "float": float, "str": str}
        for f in dataclasses.fields(cls):
            group.add_argument(
                f"--{f.name.replace('_', '-')}",
                type=kinds[str(f.type).split(" ")[0]],
                default=argparse.SUPPRESS,
                choices=ROUTING_POLICIES if f.name == "routing" else None,
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RayServeOptions:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
