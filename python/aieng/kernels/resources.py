"""ptxas's resource report (`--ptxas-options=-v`), parsed per kernel.

NVRTC's program log then holds, per function,

    ptxas info    : Compiling entry function 'name' for 'sm_90'
    ptxas info    : Function properties for name
    ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]

which says whether a kernel fits its register budget and whether it spills to local memory.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass(frozen=True)
class KernelResources:
    """What ptxas allotted one function."""

    registers: int = 0  # per thread
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack_bytes: int = 0  # local-memory stack frame per thread
    shared_bytes: int = 0  # static shared memory per block

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """NVRTC's log -> {function name: resources}, for entry kernels and any non-inlined device
    function ptxas reports (a spill there is a spill of the kernel that calls it)."""
    fields: dict[str, dict[str, int]] = {}
    entry = properties = None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            entry = match.group(1)
            fields.setdefault(entry, {})
        elif match := _PROPERTIES.search(line):
            properties = match.group(1)
            fields.setdefault(properties, {})
        elif (match := _FRAME.search(line)) and properties is not None:
            stack, stores, loads = map(int, match.groups())
            fields[properties].update(stack_bytes=stack, spill_stores=stores, spill_loads=loads)
        elif (match := _USED.search(line)) and entry is not None:
            fields[entry]["registers"] = int(match.group(1))
            if smem := _SMEM.search(line):
                fields[entry]["shared_bytes"] = int(smem.group(1))
    return {name: KernelResources(**values) for name, values in fields.items()}
