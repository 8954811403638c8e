"""Exceptions of the CUDA kernel layer: a failed NVRTC compile (carrying the compiler's log)
and a failed CUDA driver call (naming the kernel and the call)."""

from __future__ import annotations


class KernelError(RuntimeError):
    """Anything that stops a CUDA kernel from being compiled, loaded or launched."""


class KernelCompileError(KernelError):
    """NVRTC rejected a source; `log` is the compiler's whole output."""

    def __init__(self, source: str, arch: int, log: str):
        self.source = source
        self.arch = arch
        self.log = log
        super().__init__(f"NVRTC failed to compile {source} for sm_{arch}:\n{log.strip()}")


class CudaCallError(KernelError):
    """A CUDA driver (or NVRTC) call returned an error; `kernel` names what it was for."""

    def __init__(self, call: str, result: object, kernel: str):
        self.call = call
        self.result = result
        self.kernel = kernel
        super().__init__(f"{call} failed for {kernel}: {result}")
