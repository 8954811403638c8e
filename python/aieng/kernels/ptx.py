"""Kernel parameter lists read from the PTX NVRTC produces beside the cubin.

A kernel's `.entry` lists its parameters' PTX types; reduced to kinds by size and class —
"b64" (a pointer or a 64-bit int), "b32" (a 32-bit int), "f32", "f64", "b16", "b8" — they let a
launch check that its arguments match the kernel before the driver copies them blindly.
"""

from __future__ import annotations

import re

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)", re.DOTALL)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)")


def ptx_kind(ptx_type: str) -> str:
    """'u64' / 's64' / 'b64' -> 'b64', 'f32' -> 'f32', ... (size, and float or not)."""
    size = ptx_type[1:]
    return f"f{size}" if ptx_type.startswith("f") else f"b{size}"


def parse_ptx_parameters(ptx: str) -> dict[str, tuple[str, ...]]:
    """PTX text -> {kernel name: the kinds of its parameters, in order}."""
    return {
        name: tuple(ptx_kind(t) for t in _PARAM.findall(params))
        for name, params in _ENTRY.findall(ptx)
    }
