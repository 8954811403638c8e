"""Where a runner's GPU memory goes: the model's weights, the KV cache, the activation peak and
the CUDA context — logged once the runner is up and exported in the server's /metrics (GPU only).

Weights and KV cache are the bytes of the tensors themselves (each storage counted once, so
tied embeddings count once). The activation peak is the most memory torch's allocator has held
beyond those two so far (`torch.cuda.max_memory_allocated`): step activations, CUDA graph pools,
scratch buffers. The CUDA context (and whatever else the process holds outside torch's
allocator: cuBLAS workspaces, loaded kernels) is the process's memory as NVML reports it less
what torch has reserved; it needs `pynvml` (the `nvidia-ml-py` package), imported only here and
only when asked, and is None without it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuMemory:
    """Bytes on one GPU. `process` and `cuda_context` are None without NVML."""

    weights: int
    kv_cache: int
    activation_peak: int
    allocated: int  # torch's allocator, now
    reserved: int  # torch's allocator's cached segments
    used: int  # the whole device, every process (cudaMemGetInfo)
    total: int
    process: int | None = None  # this process, per NVML
    cuda_context: int | None = None  # process - reserved

    def gauges(self) -> dict[str, int]:
        """The figures that exist, by name (the /metrics label)."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def describe(self) -> str:
        def gib(value: int | None) -> str:
            return "n/a (no pynvml)" if value is None else f"{value / 2**30:.2f} GiB"

        return (
            f"GPU memory: weights {gib(self.weights)}, KV cache {gib(self.kv_cache)}, activation "
            f"peak {gib(self.activation_peak)}, CUDA context and other {gib(self.cuda_context)}; "
            f"device {gib(self.used)} used of {gib(self.total)}"
        )


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each counted once."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
    return sum(seen.values())


def kv_cache_tensors(kv_caches: Iterable[Iterable[torch.Tensor]]) -> list[torch.Tensor]:
    return [tensor for layer in kv_caches for tensor in layer]


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def nvml_process_bytes(device: torch.device) -> int | None:
    """This process's memory on `device` per NVML; None without pynvml or when NVML cannot say
    (a container's PID namespace, a driver that hides per-process usage)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            bus_id = torch.cuda.get_device_properties(device).pci_bus_id
            handle = pynvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id)
        except (AttributeError, pynvml.NVMLError):
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
    except pynvml.NVMLError as error:
        logger.debug("NVML: %s", error)
    return None


def gpu_memory_figures(runner: Any) -> GpuMemory | None:
    """The figures of a ModelRunner on a CUDA device; None on any other."""
    device = runner.device
    if device.type != "cuda":
        return None
    weights = tensor_bytes(model_tensors(runner.model))
    kv_cache = tensor_bytes(kv_cache_tensors(runner.kv_caches))
    peak = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    process = nvml_process_bytes(device)
    return GpuMemory(
        weights=weights,
        kv_cache=kv_cache,
        activation_peak=max(0, peak - weights - kv_cache),
        allocated=torch.cuda.memory_allocated(device),
        reserved=reserved,
        used=total - free,
        total=total,
        process=process,
        cuda_context=None if process is None else max(0, process - reserved),
    )


def log_gpu_memory(runner: Any) -> None:
    if (figures := gpu_memory_figures(runner)) is not None:
        logger.info(figures.describe())
