"""The INT4 linear method on NVIDIA GPUs: aieng's fused dequantize-matmul kernels
(`aieng.kernels.int4`: a GEMV for decode batches, a tensor-core GEMM for prefill).

It loads and unpacks a checkpoint exactly as `QuantizedLinearMethod` does (whose uint8 nibble
bytes are already the CUDA layout's `qweight`), then adds the float16 (scale, zero) pairs. Each
path (gemv, gemm) runs once per layer on small random inputs against `dequantize(layer)` before
the layer uses it; a path that cannot run or disagrees is turned off with a warning naming its
kernel, and a layer with neither keeps the dequantize reference. On any other device it is the
torch method unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from aieng.kernels.errors import KernelError
from aieng.kernels.int4 import (
    GEMM_DTYPES,
    GEMV_MAX_M,
    Int4Weights,
    choose_path,
    from_packed,
    int4_matmul,
    launch_for,
)
from aieng.kernels.self_check import passes_check
from aieng.layers.linear import Linear
from aieng.quantization.config import WeightScheme
from aieng.quantization.linear_method import QuantizedLinearMethod, dequantize

logger = logging.getLogger(__name__)

# Relative error against the float32 reference beyond which a path is turned off: the float16
# scales alone give ~3e-4, float16 rounding of x, W and y ~1e-3, bfloat16 ~8e-3.
TOLERANCES = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
CHECK_ROWS = {"gemv": 3, "gemm": GEMV_MAX_M + 21}  # an M that takes each path, not a tile size

Int4Matmul = Callable[[torch.Tensor, Int4Weights, str], torch.Tensor]

# Kernels that could not be compiled, loaded or launched in this process, and why: found (and
# logged) at the first layer, then off for every other layer without another try.
_CANNOT_RUN: dict[str, str] = {}


def on_nvidia_gpu(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.cuda is not None


class CudaInt4LinearMethod(QuantizedLinearMethod):
    """`QuantizedLinearMethod` plus the CUDA INT4 kernels for 4-bit layers on NVIDIA GPUs.
    `matmul` and `runs_on` are the kernel entry point and the device test (a test injects a
    failing kernel through them)."""

    def __init__(
        self,
        scheme: WeightScheme,
        prefix: str = "",
        use_kernel: bool = True,
        matmul: Int4Matmul = int4_matmul,
        runs_on: Callable[[torch.device], bool] = on_nvidia_gpu,
    ):
        super().__init__(scheme, prefix, use_kernel)
        self.matmul = matmul
        self.runs_on = runs_on
        self.paths: tuple[str, ...] = ()  # the kernels that passed their check
        self.dtype = torch.get_default_dtype()

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        super().create_weights(layer, input_size, output_sizes, bias, dtype)
        self.dtype = dtype or torch.get_default_dtype()

    def process_weights_after_loading(self, layer: Linear) -> None:
        super().process_weights_after_loading(layer)
        device = layer.qvalues.device
        if not (self.use_kernel and self.scheme.bits == 4 and self.kernel == "dequant"):
            return
        if not self.runs_on(device):
            return
        try:
            weights = from_packed(layer.qvalues, layer.scales, layer.zeros)
        except KernelError as error:
            logger.warning("%s: %s; the CUDA INT4 kernels are off for it", self.prefix, error)
            return
        self.paths = tuple(path for path in ("gemv", "gemm") if self._check(layer, weights, path))
        if self.paths:
            layer.int4_weights = weights
            self.kernel = "cuda_int4"

    def _try_int4pack(self, layer: Linear, q: torch.Tensor) -> None:
        if not self.runs_on(layer.qvalues.device):  # where the CUDA kernels run, they replace it
            super()._try_int4pack(layer, q)

    def _check(self, layer: Linear, weights: Int4Weights, path: str) -> bool:
        if path == "gemm" and self.dtype not in GEMM_DTYPES:
            return False  # tensor cores take 16-bit activations only; gemv serves every M
        rows = CHECK_ROWS[path]
        generator = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, weights.in_features, generator=generator)
        x = x.to(device=weights.qweight.device, dtype=self.dtype)
        kernel = launch_for(path, rows, weights, self.dtype).kernel
        if kernel in _CANNOT_RUN:
            return False

        def run() -> torch.Tensor:
            try:
                return self.matmul(x, weights, path)
            except KernelError as error:
                _CANNOT_RUN[kernel] = str(error)
                raise

        return passes_check(
            kernel,
            run,
            lambda: F.linear(x.float(), dequantize(layer)),
            TOLERANCES.get(self.dtype, 2e-2),
            self.prefix,
        )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.kernel != "cuda_int4":
            return super().apply(layer, x)
        rows = x.numel() // x.shape[-1]
        path = choose_path(rows, x.dtype, "gemv" in self.paths, "gemm" in self.paths)
        if path is None:
            return super().apply(layer, x)
        y = self.matmul(x, layer.int4_weights, path)
        return y if layer.bias is None else y + layer.bias
