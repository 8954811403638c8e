"""The host's memory as the engine sizes its CPU KV cache and a server checks a new version."""

from __future__ import annotations

import os


def available_ram() -> int:
    """MemAvailable from /proc/meminfo, else free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
