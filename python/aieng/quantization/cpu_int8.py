"""The quantized linear method on the CPU with a choice of kernel (`EngineArgs.cpu_quant_kernel`):

- `int8` — aieng's int8 dot-product kernels (`aieng.kernels.cpu_int8`): the activations are
  quantized to int8 per block of 32 and multiplied with the 4- or 8-bit weights (W4A8, W8A8);
- `int8x2` — the same kernels with a second int8 term per activation (about 15 bits, two dot
  products per weight byte): bfloat16's accuracy or better, the speed of the weights' bandwidth
  at decode;
- `int4pack` — torch's INT4 kernel with bf16 activations (W4A16, 4-bit layers only);
- `dequant` — the float32 reference;
- `auto` — the first of int8, int8x2, int4pack that passes its check at load, else dequant.
  W4A8 is the fastest (one dot product per weight: a 128-token prefill in about half int8x2's
  time, and the same weight bytes read at decode) and llama.cpp's own default does the same
  (Q4_0 weights times activations rounded to 8 bits per block of 32). Its accuracy contract is
  held by perplexity, not by greedy tokens: on the bundled model W4A8 stays within +0.5% of
  W4A8x2's held-out perplexity (tests/test_cpu_kernels.py; benches/bench_quantization_quality.py
  measured +0.003%). Rounding each activation to 1/254 of its block's largest does move the
  greedy tokens of the tiny random HF-parity checkpoints (their logits are nearly flat) further
  from transformers' than the INT4 closeness rule allows: those tests name int8x2.

Every kernel is run once per layer at load on random inputs (a decode-sized and a prefill-sized
batch) against `dequantize(layer)`; one that cannot run or disagrees steps aside with a warning
naming the layer, and the next in line is tried.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from aieng.config.engine_args import CPU_QUANT_KERNELS
from aieng.config.quantization import WeightScheme
from aieng.kernels.cpu_int8 import (
    GEMV_MAX_M,
    cpu_int8_available,
    int8_matmul,
    pack_int8_weights,
)
from aieng.kernels.self_check import passes_check
from aieng.layers.linear import Linear
from aieng.quantization.linear_method import QuantizedLinearMethod, dequantize

logger = logging.getLogger(__name__)

# Relative error against the float32 reference beyond which a kernel steps aside: the
# activations' int8 rounding alone gives ~6e-3 on random inputs (int8x2: ~3e-5).
INT8_TOLERANCE = 2e-2
CHECK_ROWS = (3, GEMV_MAX_M + 21)  # a decode-sized and a prefill-sized batch


class CpuQuantizedLinearMethod(QuantizedLinearMethod):
    """`QuantizedLinearMethod` on the CPU with the kernel `choice` asks for (see the module)."""

    def __init__(
        self, scheme: WeightScheme, prefix: str = "", use_kernel: bool = True, choice: str = "auto"
    ):
        if choice not in CPU_QUANT_KERNELS:
            raise ValueError(
                f"cpu_quant_kernel must be one of {', '.join(CPU_QUANT_KERNELS)}, got {choice!r}"
            )
        super().__init__(scheme, prefix, use_kernel and choice != "dequant")
        self.choice = choice

    def process_weights_after_loading(self, layer: Linear) -> None:
        super().process_weights_after_loading(layer)  # 4-bit: tries the kernels below
        if self.use_kernel and self.scheme.bits == 8 and self.kernel == "dequant":
            self._try_int8(layer, layer.qvalues)

    def _try_int4pack(self, layer: Linear, q: torch.Tensor) -> None:
        if self._try_int8(layer, q):
            return
        if self.choice in ("auto", "int4pack"):
            super()._try_int4pack(layer, q)

    def _try_int8(self, layer: Linear, q: torch.Tensor) -> bool:
        if self.choice == "auto":  # the accurate second term where W4A8 fails its check
            return any(self._try_int8_kernel(layer, q, kernel) for kernel in ("int8", "int8x2"))
        return self._try_int8_kernel(layer, q, self.choice)

    def _try_int8_kernel(self, layer: Linear, q: torch.Tensor, kernel: str) -> bool:
        if kernel not in ("int8", "int8x2") or not cpu_int8_available():
            return False
        if layer.scales.device.type != "cpu":
            return False
        try:
            weights = pack_int8_weights(q, layer.scales, layer.zeros, self.scheme.bits)
        except ValueError as error:
            logger.warning("%s: the CPU int8 kernel cannot take it (%s)", self.prefix, error)
            return False
        reference = dequantize(layer)
        generator = torch.Generator().manual_seed(0)
        split = kernel == "int8x2"
        for rows in CHECK_ROWS:
            x = torch.randn(rows, weights.in_features, generator=generator)
            if not passes_check(
                f"{kernel} (W{self.scheme.bits}A{16 if split else 8})",
                lambda x=x: int8_matmul(x, weights, split=split),
                lambda x=x: F.linear(x, reference),
                INT8_TOLERANCE,
                self.prefix,
            ):
                return False
        layer.int8_weights = weights
        # The kernel's layout is the only copy of the weight from here on (`dequantize` reads
        # it back): the reference's integers and float32 scales and zeros are dropped.
        layer.qvalues = layer.qvalues.new_empty(0)
        layer.scales = layer.scales.new_empty(0)
        layer.zeros = layer.zeros.new_empty(0)
        self.kernel = kernel
        return True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.kernel not in ("int8", "int8x2"):
            return super().apply(layer, x)
        y = int8_matmul(x, layer.int8_weights, split=self.kernel == "int8x2")
        return y if layer.bias is None else y + layer.bias
