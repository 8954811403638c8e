"""The operating system's name of a thread: its Python name, so tools that see threads by
name (`top -H`, `perf sched`, /proc/<pid>/task/*/comm) tell the engine's loop, the server's
pools and the event loop apart. Python (before 3.14) names none of them: all are `python`."""

from __future__ import annotations

import threading
from pathlib import Path

# Linux keeps 15 bytes of a thread's name.
OS_NAME_BYTES = 15


def name_os_thread() -> None:
    """Names the calling thread, for the operating system, after its Python name (cut to
    what Linux keeps). Elsewhere, or where /proc is not writable, it does nothing."""
    name = threading.current_thread().name.encode("ascii", "replace")[:OS_NAME_BYTES]
    try:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_bytes(name)
    except OSError:
        pass
