"""Choosing each linear layer's method from the checkpoint's quantization config."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn

from aieng.config.quantization import QuantizationConfig
from aieng.kernels.cpu_int8 import cpu_isa
from aieng.layers.linear import DenseLinearMethod, Linear, LinearMethod, LinearMethodChooser
from aieng.quantization.cpu_int8 import CpuQuantizedLinearMethod
from aieng.quantization.cuda_int4 import CudaInt4LinearMethod


def checkpoint_layer_names(prefix: str, packed_modules: Mapping[str, tuple[str, int]]) -> list[str]:
    """Our layer name -> the checkpoint's layer names it is made of (several for a fused
    layer: "model.layers.0.self_attn.qkv_proj" -> its q_proj, k_proj and v_proj)."""
    head, _, last = prefix.rpartition(".")
    parts = sorted(
        (shard, original) for original, (fused, shard) in packed_modules.items() if fused == last
    )
    if not parts:
        return [prefix]
    return [f"{head}.{original}" if head else original for _, original in parts]


def quantized_linear_methods(
    quantization: QuantizationConfig | None,
    packed_modules: Mapping[str, tuple[str, int]],
    use_kernels: bool = True,
    device: str | torch.device = "cpu",
    cpu_kernel: str = "auto",
) -> LinearMethodChooser:
    """A chooser giving each layer the quantized method its checkpoint names call for, or the
    dense one (an `ignore`d layer, the LM head, or no quantization at all), for weights on
    `device`. `cpu_kernel`: EngineArgs.cpu_quant_kernel."""
    on_cuda = torch.device(device).type == "cuda"

    def choose(prefix: str) -> LinearMethod:
        if quantization is None:
            return DenseLinearMethod()
        scheme = quantization.scheme_for(checkpoint_layer_names(prefix, packed_modules))
        if scheme is None:
            return DenseLinearMethod()
        # 4-bit layers on an NVIDIA GPU: the CUDA kernels (checked at load); elsewhere the CPU
        # method (the Rust int8 kernels, torch's int4pack or the dequantize reference).
        if scheme.bits == 4 and on_cuda:
            return CudaInt4LinearMethod(scheme, prefix, use_kernels)
        return CpuQuantizedLinearMethod(scheme, prefix, use_kernels, cpu_kernel)

    return choose


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every linear method its chance to repack what the loader placed."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)


def describe_linear_kernels(model: nn.Module) -> str:
    """e.g. "42 int8x2 (avx512vnni), 2 dense" — how many layers use each compute path (the int8
    kernels' with the instruction set they run on)."""
    counts: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, Linear):
            kernel = getattr(module.method, "kernel", "dense")
            counts[f"{kernel} ({cpu_isa()})" if kernel in ("int8", "int8x2") else kernel] += 1
    return ", ".join(f"{count} {kernel}" for kernel, count in counts.most_common())
