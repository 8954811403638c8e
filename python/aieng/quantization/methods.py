"""Choosing each linear layer's method from the checkpoint's quantization config."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch
from torch import nn

from aieng.layers.linear import DenseLinearMethod, Linear, LinearMethod, LinearMethodChooser
from aieng.quantization.config import QuantizationConfig
from aieng.quantization.cuda_int4 import CudaInt4LinearMethod
from aieng.quantization.linear_method import QuantizedLinearMethod


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
) -> LinearMethodChooser:
    """A chooser giving each layer the quantized method its checkpoint names call for, or the
    dense one (an `ignore`d layer, the LM head, or no quantization at all), for weights on
    `device`."""
    on_cuda = torch.device(device).type == "cuda"

    def choose(prefix: str) -> LinearMethod:
        if quantization is None:
            return DenseLinearMethod()
        scheme = quantization.scheme_for(checkpoint_layer_names(prefix, packed_modules))
        if scheme is None:
            return DenseLinearMethod()
        # 4-bit layers on an NVIDIA GPU: the CUDA kernels (checked at load).
        cuda_int4 = scheme.bits == 4 and on_cuda
        method = CudaInt4LinearMethod if cuda_int4 else QuantizedLinearMethod
        return method(scheme, prefix, use_kernels)

    return choose


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every linear method its chance to repack what the loader placed."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)


def describe_linear_kernels(model: nn.Module) -> str:
    """e.g. "42 int4pack, 2 dense" — how many layers use each compute path."""
    counts: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, Linear):
            counts[getattr(module.method, "kernel", "dense")] += 1
    return ", ".join(f"{count} {kernel}" for kernel, count in counts.most_common())
