"""`aieng serve`: its flags (the engine's, generated from EngineArgs, then the server's) and
the function that runs it."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

from aieng.config.cli_args import engine_args
from aieng.config.engine_args import (
    EngineArgs,
    at_least,
    cli_type,
    non_negative_float,
    port_number,
    positive_int,
    probability,
)
from aieng.server.config import MIB, ServerConfig
from aieng.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("aieng.server")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
non_negative_int = cli_type(int, at_least(0))


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=argparse.SUPPRESS,  # absent: --model, else the bundled default model
        metavar="MODEL",
        help="a Hugging Face checkpoint folder, like --model",
    )
    EngineArgs.add_cli_args(parser)
    server = parser.add_argument_group("server options")
    server.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    server.add_argument(
        "--port", type=port_number, default=8000, help="1 to 65535 (default: %(default)s)"
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("AIENG_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize (env AIENG_API_KEY)",
    )
    server.add_argument("--served-model-name", default=None, help="the model's name in the API")
    server.add_argument(
        "--max-queue-requests",
        type=positive_int,
        default=256,
        help="requests admitted but not yet started; past it new ones get 429",
    )
    server.add_argument(
        "--max-queue-tokens",
        type=positive_int,
        default=1 << 18,
        help="prompt tokens of the requests waiting to start; past it new ones get 429",
    )
    server.add_argument(
        "--kv-cache-watermark",
        type=probability,
        default=0.95,
        help="refuse new requests (429) while KV usage is at least this and requests wait",
    )
    server.add_argument(
        "--request-timeout",
        type=non_negative_float,
        default=600.0,
        help="seconds from arrival after which a request is aborted; 0 for none",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM before they are aborted",
    )
    server.add_argument(
        "--max-body-bytes", type=positive_int, default=4 * MIB, help="larger request bodies get 413"
    )
    server.add_argument(
        "--request-read-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds a client may take to send its request headers, and between two parts of "
        "its body; past it the answer is 408 and the connection closes; 0 for none",
    )
    server.add_argument(
        "--request-body-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds a client may take to send its whole request body, however it trickles; "
        "past it the answer is 408 and the connection closes; 0 for none (default: %(default)s)",
    )
    server.add_argument(
        "--max-concurrent-body-reads",
        type=positive_int,
        default=64,
        help="request bodies received at once; past it new ones get 503 (default: %(default)s)",
    )
    server.add_argument(
        "--small-first-ms",
        type=non_negative_float,
        default=100.0,
        help="while a request with a small body (64 KiB or less) or none waits for its first "
        "answer, larger bodies are not read, for at most this long (and each of their chunks "
        "waits at most this long), so a flood of large bodies does not delay light requests; "
        "0 turns it off (default: %(default)s)",
    )
    server.add_argument(
        "--max-body-reads-per-client",
        type=non_negative_int,
        default=16,
        help="request bodies received at once from one client address; past it its new ones "
        "get 429 (behind a proxy every client has the proxy's address); 0 for no per-client "
        "bound (default: %(default)s)",
    )
    server.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated CORS origins (CORS is off when empty)",
    )
    server.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="serve versions of one model: DIR's subfolders, each a checkpoint with "
        "aieng-model.json; the latest stable version serves first (hot reload: --admin-key)",
    )
    server.add_argument(
        "--serve-all-versions",
        action="store_true",
        help="with --model-dir: load every version that fits in memory at start, each served "
        "as NAME@VERSION beside the default (latest stable) one",
    )
    server.add_argument(
        "--admin-key",
        default=os.environ.get("AIENG_ADMIN_KEY"),
        help="the admin API's key (POST /admin/models/NAME/load, ...); also AIENG_ADMIN_KEY",
    )
    server.add_argument(
        "--cost-per-hour",
        type=float,
        default=None,
        metavar="USD",
        help="the machine's price per hour: exports aieng_cost_usd_total and "
        "aieng_cost_per_1k_output_tokens",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="read tool calls out of chat outputs with this parser (hermes: Qwen2.5, Qwen3, "
        'Hermes); needed for tool_choice "auto", the default when a request has tools',
    )
    server.add_argument("--log-format", choices=("text", "json"), default="text")
    server.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, default="info", help="(default: info)"
    )


def server_config(
    args: argparse.Namespace, model_path: Path, served_model_name: str | None = None
) -> ServerConfig:
    """The server's options; `model_path`: the folder the engine loads (the bundled model's when
    no model was named); `served_model_name`: the name it is served under, where not the
    folder's."""
    from aieng.config.default_model import served_name

    name = (
        served_model_name
        or args.served_model_name
        or served_name(None if args.model is None else model_path)
    )
    return ServerConfig(
        served_model_name=name,
        model_path=str(model_path),
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        max_queue_requests=args.max_queue_requests,
        max_queue_tokens=args.max_queue_tokens,
        kv_cache_watermark=args.kv_cache_watermark,
        request_timeout=args.request_timeout or None,
        shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes,
        request_read_timeout=args.request_read_timeout or None,
        request_body_timeout=args.request_body_timeout or None,
        max_concurrent_body_reads=args.max_concurrent_body_reads,
        max_body_reads_per_client=args.max_body_reads_per_client or None,
        small_first_ms=args.small_first_ms,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        log_format=args.log_format,
        cost_per_hour=args.cost_per_hour,
        model_dir=args.model_dir,
        serve_all_versions=args.serve_all_versions,
        admin_key=args.admin_key or None,
        tool_call_parser=args.tool_call_parser,
    )


def run_serve(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or SIGINT; 0 after a clean drain, 1 if the model fails to load."""
    import uvicorn

    from aieng.engine.llm_engine import LLMEngine
    from aieng.server.app import build_app
    from aieng.server.request_log import configure_logging
    from aieng.server.shutdown import DrainingServer
    from aieng.server.slow_clients import header_timeout_protocol

    configure_logging(args.log_format, args.log_level)
    try:
        engine = engine_args(args)
        name = args.served_model_name
        if args.model_dir is not None:  # MODEL if it is one of them, else a latest stable
            from aieng.server.model_versions import scan_model_dir, serving_version

            catalog = scan_model_dir(Path(args.model_dir))
            first = serving_version(args.model, catalog)
            engine = dataclasses.replace(engine, model=str(first.folder))
            name = name or first.name
        config = server_config(args, Path(engine.model), name)
    except (FileNotFoundError, ValueError) as error:
        logger.error("%s", error)
        return 2
    from aieng.engine.llm_engine import run_as_launched_worker

    worker_status = run_as_launched_worker(engine)  # a launcher's rank > 0: no server, a worker
    if worker_status is not None:
        return worker_status
    failures: list[BaseException] = []
    server: DrainingServer | None = None

    def on_load_failure(error: BaseException) -> None:
        failures.append(error)
        if server is not None:
            server.should_exit = True

    def load_version(folder: Path) -> LLMEngine:
        return LLMEngine(dataclasses.replace(engine, model=str(folder)))

    app = build_app(config, lambda: LLMEngine(engine), on_load_failure, load_version)
    read_timeout = config.request_read_timeout
    uvicorn_config = uvicorn.Config(
        app,
        http=header_timeout_protocol(read_timeout) if read_timeout else "h11",
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = DrainingServer(uvicorn_config, app.state.context, config.shutdown_timeout)
    server.run()
    if failures or app.state.context.engine_failed:
        return 1
    return 0 if server.started else 1
