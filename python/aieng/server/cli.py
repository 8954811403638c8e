"""`aieng serve`: its flags (the engine's `LLM(...)` arguments in kebab-case, then the
server's) and the function that runs it."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from aieng.server.config import MIB, ServerConfig

logger = logging.getLogger("aieng.server")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hugging Face checkpoint folder (default: the bundled default model)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    engine.add_argument(
        "--max-model-len", type=int, default=None, help="default: the model's context"
    )
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--long-prefill-token-threshold", type=int, default=0)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--api-key",
        default=os.environ.get("AIENG_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize (env AIENG_API_KEY)",
    )
    server.add_argument("--served-model-name", default=None, help="the model's name in the API")
    server.add_argument(
        "--max-queue-requests",
        type=int,
        default=256,
        help="requests admitted but not yet started; past it new ones get 429",
    )
    server.add_argument(
        "--max-queue-tokens",
        type=int,
        default=1 << 18,
        help="prompt tokens of the requests waiting to start; past it new ones get 429",
    )
    server.add_argument(
        "--kv-cache-watermark",
        type=float,
        default=0.95,
        help="refuse new requests (429) while KV usage is at least this and requests wait",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds from arrival after which a request is aborted; 0 for none",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM before they are aborted",
    )
    server.add_argument(
        "--max-body-bytes", type=int, default=4 * MIB, help="larger request bodies get 413"
    )
    server.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated CORS origins (CORS is off when empty)",
    )
    server.add_argument("--log-format", choices=("text", "json"), default="text")
    server.add_argument("--log-level", default="info")


def server_config(args: argparse.Namespace, model_path: Path) -> ServerConfig:
    from aieng.models.default import DEFAULT_MODEL_NAME

    name = args.served_model_name or (
        DEFAULT_MODEL_NAME if args.model is None else model_path.name or str(model_path)
    )
    return ServerConfig(
        served_model_name=name,
        model_path=str(args.model or model_path),
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        max_queue_requests=args.max_queue_requests,
        max_queue_tokens=args.max_queue_tokens,
        kv_cache_watermark=args.kv_cache_watermark,
        request_timeout=args.request_timeout or None,
        shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=args.max_body_bytes,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        log_format=args.log_format,
    )


def engine_config(args: argparse.Namespace, model_path: Path):
    from aieng.engine import EngineConfig

    return EngineConfig(
        model=str(model_path),
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )


def run_serve(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or SIGINT; 0 after a clean drain, 1 if the model fails to load."""
    import uvicorn

    from aieng.engine import LLMEngine
    from aieng.models.default import resolve_model
    from aieng.server.app import build_app
    from aieng.server.request_log import configure_logging
    from aieng.server.shutdown import DrainingServer

    configure_logging(args.log_format, args.log_level)
    try:
        model_path = resolve_model(args.model)
        if not model_path.is_dir():
            raise FileNotFoundError(f"model folder not found: {model_path}")
        config = server_config(args, model_path)
        engine_cfg = engine_config(args, model_path)
    except (FileNotFoundError, ValueError) as error:
        logger.error("%s", error)
        return 2
    failures: list[BaseException] = []
    server: DrainingServer | None = None

    def on_load_failure(error: BaseException) -> None:
        failures.append(error)
        if server is not None:
            server.should_exit = True

    app = build_app(config, lambda: LLMEngine(engine_cfg), on_load_failure)
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = DrainingServer(uvicorn_config, app.state.context, config.shutdown_timeout)
    server.run()
    if failures:
        return 1
    return 0 if server.started else 1
