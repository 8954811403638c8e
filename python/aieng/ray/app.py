"""The Ray Serve application: engine replicas behind the OpenAI ingress.

From Python, `build_app(EngineArgs(...), RayServeOptions(num_replicas=2))`; from the shell,
`serve run aieng.ray:app model=PATH num_replicas=2 routing=prefix` (every `aieng serve` flag
and every `RayServeOptions` field, as `name=value`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ray import serve
from ray.serve import Application

from aieng.config.cli_args import engine_args
from aieng.config.default_model import served_name
from aieng.config.engine_args import EngineArgs
from aieng.ray.ingress import OpenAIIngress
from aieng.ray.options import RayServeOptions
from aieng.ray.replica import EngineReplica
from aieng.server.cli import add_serve_arguments, server_config
from aieng.server.config import ServerConfig

REPLICAS = "EngineReplica"
INGRESS = "OpenAIIngress"


def build_app(
    engine: EngineArgs,
    options: RayServeOptions | None = None,
    server: ServerConfig | None = None,
) -> Application:
    """`engine.model` must be a checkpoint folder every replica (and the ingress) can read;
    None: the bundled default model, served under its name (aieng-kjv-6m)."""
    options = options or RayServeOptions()
    server = server or ServerConfig(served_model_name=served_name(engine.model))
    board = f"{REPLICAS}@{id(options):x}"
    replicas = (
        serve.deployment(EngineReplica)
        .options(name=REPLICAS, **options.replica_deployment(engine.block_size, board))
        .bind(engine)
    )
    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS,
        max_ongoing_requests=max(server.max_queue_requests * 4, 1024),
        ray_actor_options={"num_cpus": options.ingress_num_cpus},
    )
    return ingress.bind(replicas, server, options, board)


def app(args: dict[str, str]) -> Application:
    """The application builder of `serve run aieng.ray:app key=value ...`."""
    parser = argparse.ArgumentParser(prog="serve run aieng.ray:app", add_help=False)
    add_serve_arguments(parser)
    RayServeOptions.add_cli_args(parser)
    argv: list[str] = []
    for key, value in args.items():
        flag = f"--{key.replace('_', '-')}"
        if str(value).lower() in ("true", "false"):  # a switch: --flag or --no-flag
            if str(value).lower() == "true":
                argv.append(flag)
            elif f"--no-{flag[2:]}" in parser._option_string_actions:
                argv.append(f"--no-{flag[2:]}")
            continue
        argv += [flag, str(value)]
    parsed = parser.parse_args(argv)
    parsed.model = getattr(parsed, "model", None)
    engine = engine_args(parsed)
    return build_app(
        engine, RayServeOptions.from_cli_args(parsed), server_config(parsed, Path(engine.model))
    )
