"""Load a compiled cubin on a CUDA device and launch its kernels on torch's current stream.

Kernels are looked up by their `extern "C"` names. Arguments map to C types one way only:
a tensor -> its data pointer (`T*`), None -> a null pointer, a Python int -> `int` (32-bit,
range-checked), a Python float -> `float`; any other width goes as a ctypes value
(`ctypes.c_int64(n)`, `ctypes.c_double(x)`). Every driver call is checked, and a failure is a
CudaCallError naming the kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from aieng.kernels.compiler import CompiledModule, compile_kernel_source
from aieng.kernels.errors import CudaCallError, KernelError

Dim3 = int | tuple[int, ...]
KernelArg = torch.Tensor | int | float | None | ctypes._SimpleCData
_DEFAULT_SHARED_LIMIT = 48 * 1024  # dynamic shared memory allowed without opting in


def _driver() -> ModuleType:
    try:
        from cuda.bindings import driver
    except ImportError as error:
        raise KernelError(f"cuda.bindings is not importable ({error})") from error
    return driver


def _check(result: Any, call: str, kernel: str) -> None:
    driver = _driver()
    if result != driver.CUresult.CUDA_SUCCESS:
        raise CudaCallError(call, result, kernel)


def dim3(dims: Dim3, what: str) -> tuple[int, int, int]:
    """An int or up to three ints -> (x, y, z), each >= 0 and within CUDA's limits."""
    values = (dims,) if isinstance(dims, int) else tuple(dims)
    if not 1 <= len(values) <= 3 or any(not isinstance(v, int) or v < 0 for v in values):
        raise KernelError(f"{what} must be one to three non-negative ints, got {dims!r}")
    x, y, z = (*values, 1, 1)[:3]
    limits = (2**31 - 1, 65535, 65535) if what == "grid" else (1024, 1024, 64)
    if x > limits[0] or y > limits[1] or z > limits[2]:
        raise KernelError(f"{what} {dims!r} exceeds CUDA's limits {limits}")
    if what == "block" and x * y * z > 1024:
        raise KernelError(f"block {dims!r} has more than 1024 threads")
    return x, y, z


def pack_args(args: Sequence[KernelArg]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Kernel arguments -> (values, ctypes types), as cuLaunchKernel takes them."""
    values: list[Any] = []
    types: list[Any] = []
    for index, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            values.append(arg.data_ptr())
            types.append(ctypes.c_void_p)
        elif arg is None:
            values.append(0)
            types.append(ctypes.c_void_p)
        elif isinstance(arg, bool):
            raise KernelError(f"argument {index}: pass an int for a bool flag, got {arg!r}")
        elif isinstance(arg, int):
            if not -(2**31) <= arg < 2**31:
                raise KernelError(f"argument {index} = {arg} overflows int; pass ctypes.c_int64")
            values.append(arg)
            types.append(ctypes.c_int)
        elif isinstance(arg, float):
            values.append(arg)
            types.append(ctypes.c_float)
        elif isinstance(arg, ctypes._SimpleCData):
            values.append(arg.value)
            types.append(type(arg))
        else:
            raise KernelError(f"argument {index} has unsupported type {type(arg).__name__}")
    return tuple(values), tuple(types)


def arg_kind(c_type: Any) -> str:
    """A ctypes type -> the parameter kind PTX gives it ("b64", "b32", "f32", ...)."""
    bits = 8 * ctypes.sizeof(c_type)
    return f"f{bits}" if c_type in (ctypes.c_float, ctypes.c_double) else f"b{bits}"


def check_arguments(kernel: str, parameters: tuple[str, ...], types: Sequence[Any]) -> None:
    """KernelError unless the packed argument types match the kernel's parameter kinds (from
    its PTX): a wrong count, order or width would otherwise be copied into the kernel silently."""
    given = tuple(arg_kind(t) for t in types)
    if given != parameters:
        raise KernelError(
            f"{kernel} takes {len(parameters)} arguments ({', '.join(parameters)}), "
            f"got {len(given)} ({', '.join(given)})"
        )


class KernelModule:
    """A compiled module loaded into one device's primary context (the one torch uses)."""

    def __init__(self, compiled: CompiledModule, device: int | None = None):
        self.compiled = compiled
        self.device = torch.cuda.current_device() if device is None else device
        self._functions: dict[str, Any] = {}
        self._shared_optin: dict[str, int] = {}
        self._context = self._make_current(compiled.source)
        driver = _driver()
        result, self._module = driver.cuModuleLoadData(compiled.cubin)
        _check(result, "cuModuleLoadData", compiled.source)

    def _make_current(self, kernel: str) -> Any:
        driver = _driver()
        _check(driver.cuInit(0)[0], "cuInit", kernel)
        result, device = driver.cuDeviceGet(self.device)
        _check(result, "cuDeviceGet", kernel)
        result, context = driver.cuDevicePrimaryCtxRetain(device)
        _check(result, "cuDevicePrimaryCtxRetain", kernel)
        _check(driver.cuCtxSetCurrent(context)[0], "cuCtxSetCurrent", kernel)
        return context

    def function(self, kernel: str) -> Any:
        """The CUfunction of an `extern "C"` kernel of this module."""
        if kernel not in self._functions:
            result, function = _driver().cuModuleGetFunction(self._module, kernel.encode())
            _check(result, f"cuModuleGetFunction (not in {self.compiled.source}?)", kernel)
            self._functions[kernel] = function
        return self._functions[kernel]

    def launch(
        self,
        kernel: str,
        grid: Dim3,
        block: Dim3,
        args: Sequence[KernelArg],
        shared_mem: int = 0,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Launch `kernel` asynchronously on `stream` (default: torch's current stream of this
        module's device). An empty grid launches nothing."""
        driver = _driver()
        grid3, block3 = dim3(grid, "grid"), dim3(block, "block")
        if 0 in grid3:
            return
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.device != torch.device("cuda", self.device):
                raise KernelError(f"{kernel}: a tensor argument is on {arg.device}, not cuda")
        function = self.function(kernel)
        if shared_mem > max(_DEFAULT_SHARED_LIMIT, self._shared_optin.get(kernel, 0)):
            attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(function, attribute, shared_mem)[0], "opt-in", kernel)
            self._shared_optin[kernel] = shared_mem
        stream = stream or torch.cuda.current_stream(self.device)
        handle = driver.CUstream(stream.cuda_stream)
        params = pack_args(args)
        if (parameters := self.compiled.parameters.get(kernel)) is not None:
            check_arguments(kernel, parameters, params[1])
        (result,) = driver.cuLaunchKernel(function, *grid3, *block3, shared_mem, handle, params, 0)
        if result == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:  # a thread torch never used
            self._make_current(kernel)
            (result,) = driver.cuLaunchKernel(
                function, *grid3, *block3, shared_mem, handle, params, 0
            )
        _check(result, "cuLaunchKernel", kernel)

    def max_active_ctas(self, kernel: str, threads: int, shared_mem: int = 0) -> int:
        """CTAs of `kernel` (`threads` threads, `shared_mem` bytes of dynamic shared memory)
        that one SM of this device holds at once: the driver's occupancy calculator."""
        driver = _driver()
        function = self.function(kernel)
        query = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor
        result, ctas = query(function, threads, shared_mem)
        if result == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:  # a thread torch never used
            self._make_current(kernel)
            result, ctas = query(function, threads, shared_mem)
        _check(result, "cuOccupancyMaxActiveBlocksPerMultiprocessor", kernel)
        return int(ctas)


_MODULES: dict[tuple[str, tuple[str, ...], int], KernelModule] = {}


def load_module(name: str, options: Sequence[str] = (), device: int | None = None) -> KernelModule:
    """`cuda/<name>.cu` compiled for `device` (default: the current one) and loaded there; one
    module per (source, options, device) per process."""
    device = torch.cuda.current_device() if device is None else device
    key = (name, tuple(options), device)
    if key not in _MODULES:
        major, minor = torch.cuda.get_device_capability(device)
        compiled = compile_kernel_source(name, major * 10 + minor, options)
        _MODULES[key] = KernelModule(compiled, device)
    return _MODULES[key]
