"""Compile a `cuda/*.cu` source with NVRTC into a cubin for one GPU architecture, with a disk cache.

A cubin (SASS for one architecture, not PTX) is what gets loaded: it runs on a driver of the
same CUDA major version as the NVRTC that built it, with no JIT at load time. The cache key is
the source and every header it includes, the architecture, the options and the NVRTC version,
so editing a kernel or upgrading NVRTC recompiles and nothing stale is ever loaded. Every
compile asks ptxas for its resource report (`--ptxas-options=-v`), parsed per kernel.

Cache folder: `$AIENG_CACHE_DIR/kernels` if AIENG_CACHE_DIR is set, else
`$XDG_CACHE_HOME/aieng/kernels` (default `~/.cache/aieng/kernels`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

from aieng.kernels.errors import CudaCallError, KernelCompileError, KernelError
from aieng.kernels.ptx import parse_ptx_parameters
from aieng.kernels.resources import KernelResources, parse_ptxas_report
from aieng.kernels.sources import read_with_headers, source_path

MIN_ARCH = 80  # mma.sync on bf16, cp.async: Ampere and newer
BASE_OPTIONS = ("-std=c++17", "--ptxas-options=-v")
CACHE_FORMAT = 2  # bumped when a cache entry's contents change (2: parameter kinds)


@dataclass(frozen=True)
class CompiledModule:
    """One source compiled for one architecture: the cubin and ptxas's report per kernel."""

    source: str  # file name, e.g. "paged_attention_decode.cu"
    arch: int  # e.g. 90 for sm_90
    cubin: bytes
    resources: dict[str, KernelResources] = field(default_factory=dict)
    log: str = ""
    key: str = ""  # the cache key (hex)
    # kernel -> kinds of its parameters ("b64" pointer or 64-bit int, "b32", "f32", ...)
    parameters: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _nvrtc() -> ModuleType:
    try:
        from cuda.bindings import nvrtc
    except ImportError as error:
        raise KernelError(
            "NVRTC is not importable: install cuda-bindings and nvidia-cuda-nvrtc "
            f"(aieng's dependencies) to compile CUDA kernels ({error})"
        ) from error
    return nvrtc


@cache
def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    result, major, minor = nvrtc.nvrtcVersion()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CudaCallError("nvrtcVersion", result, "NVRTC")
    return int(major), int(minor)


def device_arch() -> int:
    """The running GPU's architecture as an int (9.0 -> 90); KernelError without an NVIDIA GPU."""
    import torch

    if not torch.cuda.is_available() or torch.version.cuda is None:
        raise KernelError("no NVIDIA GPU: CUDA kernels need one to run")
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def cache_dir() -> Path:
    if root := os.environ.get("AIENG_CACHE_DIR"):
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "aieng" / "kernels"


def cache_key(
    text: str, headers: dict[str, str], arch: int, options: Sequence[str], version: tuple[int, int]
) -> str:
    """Hex digest of everything that decides the cubin."""
    digest = hashlib.sha256()
    parts = [text, *(f"{name}\0{body}" for name, body in sorted(headers.items()))]
    parts += [f"sm_{arch}", *options, f"nvrtc {version[0]}.{version[1]}", f"{CACHE_FORMAT=}"]
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0\1")
    return digest.hexdigest()


def compile_kernel_source(
    name: str | Path, arch: int | None = None, options: Sequence[str] = (), use_cache: bool = True
) -> CompiledModule:
    """Compile `cuda/<name>.cu` for sm_<arch> (default: the running GPU's). `options` are extra
    NVRTC options (e.g. "-DTILE=64"). Raises KernelCompileError with NVRTC's log on failure."""
    path = source_path(name)
    arch = device_arch() if arch is None else arch
    if arch < MIN_ARCH:
        raise KernelError(f"aieng's CUDA kernels need sm_{MIN_ARCH} or newer, not sm_{arch}")
    text, headers = read_with_headers(path)
    all_options = (*BASE_OPTIONS, f"--gpu-architecture=sm_{arch}", *options)
    key = cache_key(text, headers, arch, all_options, nvrtc_version())
    stem = f"{path.stem}-sm{arch}-{key[:24]}"
    if use_cache and (cached := _read_cache(stem, path.name, arch, key)) is not None:
        return cached
    cubin, ptx, log = _nvrtc_compile(path.name, text, headers, all_options, arch)
    parameters = parse_ptx_parameters(ptx)
    module = CompiledModule(path.name, arch, cubin, parse_ptxas_report(log), log, key, parameters)
    if use_cache:
        _write_cache(stem, module)
    return module


def _nvrtc_compile(
    filename: str, text: str, headers: dict[str, str], options: Sequence[str], arch: int
) -> tuple[bytes, str, str]:
    """-> (cubin, PTX, log)."""
    nvrtc = _nvrtc()
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS

    def check(call: str, result: object) -> None:
        if result != ok:
            raise CudaCallError(call, result, filename)

    names = sorted(headers)
    result, program = nvrtc.nvrtcCreateProgram(
        text.encode(),
        filename.encode(),
        len(names),
        [headers[n].encode() for n in names],
        [n.encode() for n in names],
    )
    check("nvrtcCreateProgram", result)
    try:
        encoded = [option.encode() for option in options]
        (compiled,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        result, size = nvrtc.nvrtcGetProgramLogSize(program)
        check("nvrtcGetProgramLogSize", result)
        buffer = b" " * size
        check("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(program, buffer)[0])
        log = buffer.rstrip(b"\0 ").decode(errors="replace")
        if compiled != ok:
            raise KernelCompileError(filename, arch, log)
        result, size = nvrtc.nvrtcGetCUBINSize(program)
        check("nvrtcGetCUBINSize", result)
        cubin = b" " * size
        check("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(program, cubin)[0])
        result, size = nvrtc.nvrtcGetPTXSize(program)
        check("nvrtcGetPTXSize", result)
        ptx = b" " * size
        check("nvrtcGetPTX", nvrtc.nvrtcGetPTX(program, ptx)[0])
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return cubin, ptx.rstrip(b"\0 ").decode(errors="replace"), log


def _read_cache(stem: str, source: str, arch: int, key: str) -> CompiledModule | None:
    folder = cache_dir()
    try:
        meta = json.loads((folder / f"{stem}.json").read_text())
        cubin = (folder / f"{stem}.cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or len(cubin) != meta.get("cubin_bytes"):
        return None
    resources = {n: KernelResources(**r) for n, r in meta["resources"].items()}
    parameters = {n: tuple(kinds) for n, kinds in meta.get("parameters", {}).items()}
    return CompiledModule(source, arch, cubin, resources, meta["log"], key, parameters)


def _write_cache(stem: str, module: CompiledModule) -> None:
    """Best effort (a read-only home still compiles); each file lands whole or not at all."""
    meta = {
        "key": module.key,
        "source": module.source,
        "arch": module.arch,
        "cubin_bytes": len(module.cubin),
        "resources": {n: r.to_dict() for n, r in module.resources.items()},
        "parameters": module.parameters,
        "log": module.log,
    }
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / f"{stem}.cubin", module.cubin)
        _write_atomic(folder / f"{stem}.json", json.dumps(meta, indent=1).encode())
    except OSError:
        pass


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
