"""A local Ray cluster for the Ray tests (one per test session, this machine's 2 CPUs) and the
aieng Ray Serve applications they deploy on it, reached over HTTP like any client would."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import ray
from ray import serve
from server_fixtures import MODEL_NAME, free_port, scrape, wait_ready

from aieng.config.engine_args import EngineArgs
from aieng.ray import RayServeOptions, build_app
from aieng.server.config import ServerConfig

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"
HTTP_PORT: int | None = None


def ray_cluster() -> int:
    """Starts Ray and Serve once per process (later calls reuse them); the HTTP port. Ray's
    processes get this checkout's python/ first on their path, as the test process has."""
    global HTTP_PORT
    if not ray.is_initialized():
        path = os.pathsep.join(p for p in (str(PYTHON_DIR), os.environ.get("PYTHONPATH")) if p)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
        )
    if HTTP_PORT is None:
        HTTP_PORT = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    return HTTP_PORT


def shutdown_cluster() -> None:
    """Stops Serve and Ray, so that the tests after the Ray tests run without them."""
    global HTTP_PORT
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    HTTP_PORT = None


class RayApp:
    """An aieng application deployed on the cluster under `name`, served at /`name`."""

    def __init__(
        self,
        name: str,
        model: Path,
        engine: dict,
        server: dict | None = None,
        **options: object,
    ):
        """`server`: ServerConfig fields beyond the model's name and path."""
        port = ray_cluster()
        self.name = name
        self.url = f"http://127.0.0.1:{port}/{name}"
        config = ServerConfig(served_model_name=MODEL_NAME, model_path=str(model), **(server or {}))
        options = {"replica_num_cpus": 0, "stats_period_s": 0.2, **options}
        app = build_app(EngineArgs(model=str(model), **engine), RayServeOptions(**options), config)
        serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
        wait_ready(self.url, timeout=120)

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)

    def running_replicas(self) -> int:
        deployments = serve.status().applications[self.name].deployments
        return deployments["EngineReplica"].replica_states.get("RUNNING", 0)

    def replica_actors(self) -> list[ray.actor.ActorHandle]:
        prefix = f"SERVE_REPLICA::{self.name}#EngineReplica"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        return [ray.get_actor(n, namespace="serve") for n in names if n.startswith(prefix)]

    def wait_for(self, what: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if what():
                return True
            time.sleep(step)
        return what()

    def delete(self) -> None:
        serve.delete(self.name)
