"""Where the CUDA C++ sources live and what one source pulls in.

The kernels are `cuda/*.cu` at the repository root; the wheel ships the same folder inside the
package as `aieng/cuda/`, so an installed aieng and a source checkout (editable install) find
them alike. A source includes aieng's own headers with `#include "name.cuh"` only (no CUDA
toolkit headers: the host's toolkit may be missing or differ), and those headers are handed to
NVRTC by name, so what is hashed for the cache is exactly what is compiled.
"""

from __future__ import annotations

import re
from pathlib import Path

from aieng.kernels.errors import KernelError

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # python/aieng or site-packages/aieng
_CANDIDATES = (_PACKAGE_DIR / "cuda", _PACKAGE_DIR.parent.parent / "cuda")
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def cuda_source_dir() -> Path:
    """The folder of the `.cu` sources: the installed package's, else the checkout's."""
    for candidate in _CANDIDATES:
        if (candidate / "README.md").is_file():
            return candidate
    raise KernelError(f"no CUDA sources found (looked in {', '.join(map(str, _CANDIDATES))})")


def source_path(name: str | Path) -> Path:
    """'paged_attention_decode' or 'paged_attention_decode.cu' -> its file in the sources
    folder; a Path is taken as it is (a source outside the package, e.g. in a test)."""
    if isinstance(name, Path):
        path = name
    else:
        path = cuda_source_dir() / (name if name.endswith(".cu") else f"{name}.cu")
    if not path.is_file():
        raise KernelError(f"no CUDA source {path.name} in {path.parent}")
    return path


def read_with_headers(path: Path) -> tuple[str, dict[str, str]]:
    """A source's text and every header it includes with quotes, transitively, by name."""
    headers: dict[str, str] = {}
    pending = _LOCAL_INCLUDE.findall(text := path.read_text())
    while pending:
        name = pending.pop()
        if name in headers:
            continue
        header = path.parent / name
        if not header.is_file():
            raise KernelError(f"{path.name} includes {name!r}, which is not in {path.parent}")
        headers[name] = header.read_text()
        pending.extend(_LOCAL_INCLUDE.findall(headers[name]))
    return text, headers
