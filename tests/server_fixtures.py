"""Real servers on loopback for the server tests: in a thread (the test can reach the engine)
or as a `python -m aieng.server` subprocess (signals, exit codes, logs)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint

from aieng.config.engine_args import EngineArgs
from aieng.engine.llm_engine import LLMEngine
from aieng.server.app import build_app
from aieng.server.config import ServerConfig

VOCAB = 384
MODEL_NAME = "tiny-llama"
ENGINE_DEFAULTS = dict(kv_cache_memory=1 << 22, block_size=4)


def make_model_dir(folder: Path, max_positions: int = 2048) -> Path:
    save_model_dir(folder, byte_level_bpe(VOCAB))
    return build_checkpoint(
        "llama", folder, vocab_size=VOCAB, max_position_embeddings=max_positions
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


class ThreadServer:
    """build_app + uvicorn in a background thread of the test process."""

    def __init__(
        self,
        model: Path,
        engine: dict[str, Any] | None = None,
        loading_gate: threading.Event | None = None,
        **server: Any,
    ):
        """With `loading_gate`, the model load waits for the event (a slow load, for tests
        of the starting state)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = ServerConfig(served_model_name=MODEL_NAME, model_path=str(model), **server)
        engine_config = EngineArgs(model=str(model), **{**ENGINE_DEFAULTS, **(engine or {})})

        def load() -> LLMEngine:
            if loading_gate is not None:
                loading_gate.wait(60)
            return LLMEngine(engine_config)

        def load_version(folder: Path) -> LLMEngine:  # hot reload (`model_dir`)
            return LLMEngine(dataclasses.replace(engine_config, model=str(folder)))

        self.app = build_app(config, load, load_version=load_version)
        self.loading_gate = loading_gate
        self.ctx = self.app.state.context
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_config=None)
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve()

        asyncio.run(serve())

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        if self.loading_gate is None:
            wait_ready(self.url)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def in_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs fn(engine) in the engine loop's thread, between steps."""
        assert self.loop is not None and self.ctx.engine is not None
        future = asyncio.run_coroutine_threadsafe(self.ctx.engine.call(fn), self.loop)
        return future.result(30)

    def in_loop(self, fn: Callable[[], Any]) -> Any:
        """Runs fn() on the server's event loop."""
        assert self.loop is not None

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Waits until no request runs or waits; returns the metrics then."""
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["aieng_num_requests_running"] == 0 and m["aieng_num_requests_waiting"] == 0
            if (idle and self.ctx.admission.num_in_flight == 0) or time.monotonic() > end:
                return m
            time.sleep(0.05)


def scrape(url: str) -> dict[str, float]:
    """/metrics as {name or name{label=value,...}: value}; a name alone sums its series."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if labels:
                key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                values[f"{sample.name}{{{key}}}"] = sample.value
    return values


class SubprocessServer:
    """`python -m aieng.server MODEL --port P ARGS...` with its stderr captured to a file
    (model None: the bundled default model)."""

    def __init__(self, model: Path | None, log_file: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "aieng.server", *([str(model)] if model else [])]
        command += ["--port", str(self.port)]
        command += ["--kv-cache-memory", str(1 << 22), "--block-size", "4", *args]
        self.log_file = log_file
        self._log = log_file.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def __enter__(self) -> SubprocessServer:
        try:
            wait_ready(self.url, proc=self.proc)
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.kill()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    @property
    def log(self) -> str:
        self._log.flush()
        return self.log_file.read_text()
