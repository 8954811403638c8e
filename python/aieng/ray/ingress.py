"""`OpenAIIngress`: the OpenAI API of `aieng serve` (`aieng.server.app.build_app`: the same
routes, validation, errors, streaming, auth and metrics) as the Ray Serve ingress, its engine
the replicas behind the router (`ReplicaPoolClient`); plus per-replica metrics and the rolling
upgrade's admin routes."""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from aieng.ray.board import ReplicaBoard
from aieng.ray.options import RayServeOptions
from aieng.ray.pool_client import ReplicaPoolClient
from aieng.ray.replica_metrics import ReplicaCollector
from aieng.ray.upgrade import RollingUpgrade
from aieng.ray.upgrade_routes import router as upgrade_router
from aieng.server.app import build_app
from aieng.server.config import ServerConfig


@serve.ingress()
class OpenAIIngress:
    def __init__(
        self,
        replicas: DeploymentHandle,
        config: ServerConfig,
        options: RayServeOptions,
        board: str,
    ):
        self.replicas, self.config, self.options, self.board = replicas, config, options, board

    def __serve_build_asgi_app__(self) -> FastAPI:
        board = ReplicaBoard.of(self.board)

        def connect() -> ReplicaPoolClient:
            return ReplicaPoolClient(self.replicas, board, self.options.max_retries)

        app = build_app(self.config, connect)
        ctx = app.state.context
        ctx.metrics.registry.register(ReplicaCollector(board, self.config.served_model_name))

        async def upgraded() -> None:
            """Every replica serves the new version: its model info and generation defaults."""
            pool = ctx.engine
            if isinstance(pool, ReplicaPoolClient):
                info = await pool.refresh_model_info()
                ctx.model_defaults = dict(info.generation_defaults)

        app.state.rolling_upgrade = RollingUpgrade(
            self.replicas, board, self.options.graceful_shutdown_timeout_s, upgraded
        )
        app.include_router(upgrade_router)
        return app
