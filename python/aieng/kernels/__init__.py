"""CUDA kernels for aieng: `cuda/*.cu` compiled at run time with NVRTC, cached on disk, launched
on torch's current stream.

    module = load_module("paged_attention_decode")          # compile (or cache hit) + load
    module.launch("kernel_name", grid, block, [out, x, n], shared_mem=0)

`compile_kernel_source(name, arch)` compiles without a GPU (CI checks every kernel's ptxas
report that way). Each kernel has a pure-PyTorch reference it is tested and self-checked against.
"""

from aieng.kernels.compiler import CompiledModule, compile_kernel_source, device_arch
from aieng.kernels.errors import CudaCallError, KernelCompileError, KernelError
from aieng.kernels.launch import KernelModule, load_module
from aieng.kernels.resources import KernelResources, parse_ptxas_report
from aieng.kernels.sources import cuda_source_dir

__all__ = [
    "CompiledModule",
    "CudaCallError",
    "KernelCompileError",
    "KernelError",
    "KernelModule",
    "KernelResources",
    "compile_kernel_source",
    "cuda_source_dir",
    "device_arch",
    "load_module",
    "parse_ptxas_report",
]
