"""The INT4 linear method on NVIDIA GPUs: aieng's fused dequantize-matmul kernels
(`aieng.kernels.int4`: a GEMV for decode batches, a tensor-core GEMM for prefill).

It loads and unpacks a checkpoint exactly as `QuantizedLinearMethod` does (whose uint8 nibble
bytes are already the CUDA layout's `qweight`), then adds the float16 (scale, zero) pairs.

Start-up check: every kernel each path (gemv, gemm) can dispatch — the GEMV's row tiles (M = 1,
2, 3-4, 5-8, 9-16, as `launch_for` names them), its passes of 16 rows, the GEMM — runs on each
layer's weight at the least and the most rows that reach it, against x @ W^T in float32 over the
layout's own weights, per output row within `check_bound`. The first layer's layout is compared
with the checkpoint's dequantization as `QuantizedLinearMethod` holds it (`dequantize`: its
integers, zero points and float32 scales, not the layout's), so that a conversion bug cannot hide
behind a reference built from the converted weights (tests/test_cuda_int4.py checks each
checkpoint format's unpacking against its writer's own dequantization). On a CUDA device the
same checks run first in a child process, once per process for each device, dtype and weight
shape (q/k/v, o, gate/up, down: each its own grid): a kernel that faults there on any shape is
turned off for that shape without running here. A path with a kernel that
cannot run or disagrees is turned off with a warning naming the kernel, and a layer with neither
keeps the dequantize reference. On any other device it is the torch method unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from aieng.config.quantization import WeightScheme
from aieng.kernels.check_child import screen_in_child
from aieng.kernels.errors import KernelError
from aieng.kernels.int4 import (
    GEMM_DTYPES,
    SCALE_TOLERANCE,
    Int4Weights,
    choose_path,
    dequantize_weights,
    from_packed,
    int4_matmul,
    launch_for,
    repack,
)
from aieng.kernels.self_check import RowBound, passes_check
from aieng.layers.linear import Linear
from aieng.quantization.linear_method import QuantizedLinearMethod, dequantize

logger = logging.getLogger(__name__)

# Check rows: every kernel a path dispatches for 1..CHECK_MAX_M rows (the GEMV's row tiles, the
# GEMM, the GEMV's passes of 16 rows when it serves a prefill alone) is checked at the least and
# the most rows that reach it.
CHECK_MAX_M = 128
CHILD_CHECK_SEED = 0

Int4Matmul = Callable[[torch.Tensor, Int4Weights, str], torch.Tensor]

# Kernels that could not be compiled, loaded or launched in this process, and why: found (and
# logged) at the first layer, then off for every other layer without another try.
_CANNOT_RUN: dict[str, str] = {}
# (device, dtype, N, K, group size) -> the kernels that passed their check in a child process
# (`check_child`): screened once per process for each weight shape, at its first layer.
_SCREENED: dict[tuple[torch.device, torch.dtype, int, int, int], frozenset[str]] = {}
# (device, dtype) -> why the first layer's layout differs from its checkpoint's dequantization
# (None: it does not); every layer's kernels are off after a difference.
_LAYOUT_CHECKED: dict[tuple[torch.device, torch.dtype], str | None] = {}


def on_nvidia_gpu(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.cuda is not None


def check_bound(dtype: torch.dtype) -> RowBound:
    """Each output row against x @ W^T in float32 over the layout's own weights: the output
    rounded once to `dtype`, and the weights dequantized in `dtype` on the way (the GEMM stages
    them for the tensor cores)."""
    return RowBound.rounding(dtype, output=1, inner=1)


def variant_rows(path: str, dtype: torch.dtype, weights: Int4Weights) -> dict[str, tuple[int, ...]]:
    """Each kernel `path` dispatches (as `choose_path` and `launch_for` choose, with `path` the
    one that passed) for 1..CHECK_MAX_M rows -> the least and the most rows that reach it."""
    rows: dict[str, list[int]] = {}
    only = {"gemv": path == "gemv", "gemm": path == "gemm"}
    for m in range(1, CHECK_MAX_M + 1):
        if choose_path(m, dtype, **only) == path:
            rows.setdefault(launch_for(path, m, weights, dtype).kernel, []).append(m)
    return {kernel: tuple(dict.fromkeys((ms[0], ms[-1]))) for kernel, ms in rows.items()}


def variant_checks(
    weights: Int4Weights,
    dtype: torch.dtype,
    matmul: Int4Matmul,
    reference_weight: torch.Tensor,
    where: str,
) -> Iterator[tuple[str, str, Callable[[], bool]]]:
    """(path, kernel, its check) for every kernel each path can dispatch: x @ W^T by `matmul`
    against x @ reference_weight^T in float32, per row within `check_bound`, at each M of
    `variant_rows`."""
    paths = ("gemv", "gemm") if dtype in GEMM_DTYPES else ("gemv",)  # tensor cores: 16-bit
    for path in paths:
        for kernel, ms in variant_rows(path, dtype, weights).items():

            def check(path: str = path, kernel: str = kernel, ms: tuple[int, ...] = ms) -> bool:
                for m in ms:
                    generator = torch.Generator().manual_seed(m)
                    x = torch.randn(m, weights.in_features, generator=generator)
                    x = x.to(device=weights.qweight.device, dtype=dtype)

                    def run(x: torch.Tensor = x) -> torch.Tensor:
                        return matmul(x, weights, path)

                    def reference(x: torch.Tensor = x) -> torch.Tensor:
                        return F.linear(x.float(), reference_weight)

                    label = f"{where} (M = {m})"
                    if not passes_check(kernel, run, reference, check_bound(dtype), label):
                        return False
                return True

            yield path, kernel, check


def int4_child_checks(
    device: torch.device, dtype: torch.dtype, n: int, k: int, group_size: int
) -> Iterator[tuple[str, Callable[[], bool]]]:
    """The check suite a child process runs (`check_child`): every variant on a random weight
    of shape (n, k) in groups of `group_size`."""
    generator = torch.Generator().manual_seed(CHILD_CHECK_SEED)
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    scales = torch.rand(n, k // group_size, generator=generator) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group_size), generator=generator).float()
    packed = repack(q, scales, zeros)
    weights = Int4Weights(packed.qweight.to(device), packed.scale_zero.to(device), group_size)
    reference = dequantize_weights(weights)
    where = f"INT4 check on a random ({n}, {k}) weight"
    for _, kernel, check in variant_checks(weights, dtype, int4_matmul, reference, where):
        yield kernel, check


def screened_kernels(
    device: torch.device, dtype: torch.dtype, weights: Int4Weights
) -> frozenset[str] | None:
    """On a CUDA device, the kernels that passed their checks in a child process on `weights`'
    shape (run once per process for each device, dtype and shape: a kernel faulting on one
    shape's grid must not reach the engine through another layer); None elsewhere (nothing to
    screen: the checks run here)."""
    if device.type != "cuda":
        return None
    shape = (weights.out_features, weights.in_features, weights.group_size)
    key = (device, dtype, *shape)
    if key not in _SCREENED:
        _SCREENED[key] = frozenset(
            screen_in_child(
                int4_child_checks, (device, dtype, *shape), label=f"INT4 {shape[0]}x{shape[1]}"
            ).passed
        )
    return _SCREENED[key]


def layout_disagreement(layer: Linear, weights: Int4Weights) -> str | None:
    """Why the layout's weights (float16 scales and zeros) differ from the checkpoint's
    dequantization of `layer` beyond rounding its scales to float16, or None: each weight
    within SCALE_TOLERANCE of its own magnitude (a wrong nibble, zero point or scale moves it
    by at least a fifteenth of it)."""
    want = dequantize(layer).to(weights.qweight.device)
    got = dequantize_weights(weights)
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, the checkpoint's {tuple(want.shape)}"
    bad = ~((got - want).abs() <= SCALE_TOLERANCE * want.abs())  # NaN counts as bad
    if bool(bad.any()):
        worst = int(bad.view(-1).nonzero()[0])
        row, col = divmod(worst, want.shape[1])
        return (
            f"weight ({row}, {col}) is {float(got.view(-1)[worst]):.6g} in the layout, "
            f"{float(want.view(-1)[worst]):.6g} in the checkpoint"
        )
    return None


def remembering_failures(matmul: Int4Matmul) -> Int4Matmul:
    """`matmul`, noting in _CANNOT_RUN the kernel of a launch that raises KernelError (a failed
    compile, load or launch), so that no other layer tries it again."""

    def run(x: torch.Tensor, weights: Int4Weights, path: str) -> torch.Tensor:
        try:
            return matmul(x, weights, path)
        except KernelError as error:
            _CANNOT_RUN[launch_for(path, x.shape[0], weights, x.dtype).kernel] = str(error)
            raise

    return run


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
        key = (device, self.dtype)
        if key not in _LAYOUT_CHECKED:  # the first layer: its layout against its checkpoint
            _LAYOUT_CHECKED[key] = why = layout_disagreement(layer, weights)
            if why is not None:
                logger.warning(
                    "%s: the CUDA INT4 layout differs from the checkpoint's dequantization (%s); "
                    "the CUDA INT4 kernels are off for every layer",
                    self.prefix,
                    why,
                )
        if _LAYOUT_CHECKED[key] is not None:
            return
        self.paths = self._checked_paths(weights, screened_kernels(device, self.dtype, weights))
        if self.paths:
            layer.int4_weights = weights
            self.kernel = "cuda_int4"

    def _try_int4pack(self, layer: Linear, q: torch.Tensor) -> None:
        if not self.runs_on(layer.qvalues.device):  # where the CUDA kernels run, they replace it
            super()._try_int4pack(layer, q)

    def _checked_paths(
        self, weights: Int4Weights, screened: frozenset[str] | None
    ) -> tuple[str, ...]:
        """The paths every kernel of which passes its check on this layer's weight (and, where
        `screened` is given, passed in the child process first)."""
        reference = dequantize_weights(weights)
        failed: set[str] = set()
        matmul = remembering_failures(self.matmul)
        for path, kernel, check in variant_checks(
            weights, self.dtype, matmul, reference, self.prefix
        ):
            if path in failed:
                continue
            if kernel in _CANNOT_RUN or (screened is not None and kernel not in screened):
                failed.add(path)
                continue
            if not check():
                failed.add(path)
        paths = ("gemv", "gemm") if self.dtype in GEMM_DTYPES else ("gemv",)
        return tuple(path for path in paths if path not in failed)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.kernel != "cuda_int4":
            return super().apply(layer, x)
        rows = x.numel() // x.shape[-1]
        path = choose_path(rows, x.dtype, "gemv" in self.paths, "gemm" in self.paths)
        if path is None:
            return super().apply(layer, x)
        y = self.matmul(x, layer.int4_weights, path)
        return y if layer.bias is None else y + layer.bias
