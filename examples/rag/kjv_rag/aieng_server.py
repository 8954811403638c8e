"""An aieng server in a subprocess (the bundled model), for the one command and the evaluation."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    """A TCP port of 127.0.0.1 no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def aieng_server(port: int = 0, *extra: str) -> Iterator[str]:
    """Starts `python -m aieng serve` on `port` (0: a free one); yields its /v1 URL once
    ready."""
    port = port or free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "aieng", "serve", "--port", str(port), *extra],
        env=os.environ.copy(),
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, server)
        yield f"{base}/v1"
    finally:
        server.terminate()
        server.wait(30)


def wait_ready(base: str, server: subprocess.Popen, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.poll() is not None:
            raise SystemExit(f"the aieng server exited with {server.returncode}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the aieng server at {base} was not ready in {timeout} s")


def served_model(url: str) -> str:
    return httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]
