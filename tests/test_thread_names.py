"""The server's threads carry their Python names for the operating system (top -H, perf,
/proc), so the event loop, the engine's loop and the pools are told apart."""

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from aieng.engine.thread_names import OS_NAME_BYTES, name_os_thread
from aieng.server.fair_pool import FairPool

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="names from /proc (Linux)")


def os_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_thread_takes_its_python_name_cut_to_what_linux_keeps():
    seen: dict[str, str] = {}

    def run() -> None:
        before = os_name(threading.get_native_id())
        name_os_thread()
        seen["before"], seen["after"] = before, os_name(threading.get_native_id())

    thread = threading.Thread(target=run, name="aieng-a-long-thread-name")
    thread.start()
    thread.join()
    assert seen["before"] != seen["after"] == "aieng-a-long-thread-name"[:OS_NAME_BYTES]


def test_the_fair_pools_threads_are_named():
    pool = FairPool(1, "aieng-parse")
    native_id = asyncio.run(pool.run(("client", ""), 1, threading.get_native_id))
    assert os_name(native_id) == "aieng-parse_0"
