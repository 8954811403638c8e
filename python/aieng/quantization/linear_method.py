"""The linear method of weight-only quantized layers (INT4 / INT8 weights, float activations).

Loading happens in two steps. `create_weights` registers the checkpoint format's own tensors
(compressed-tensors `weight_packed`/`weight_scale`/`weight_zero_point`/`weight_shape`, AutoAWQ
`qweight`/`qzeros`/`scales`, GPTQ `qweight`/`qzeros`/`scales`/`g_idx`) with weight loaders that
check every shape and never cast a packed tensor. `process_weights_after_loading` then unpacks
them once into integers q in [0, 2^b), per-group scales s and zero points z — the weight is
w = (q - z) * s for every format — and repacks those into aieng's compute layout, dropping the
checkpoint tensors:

- `int4pack` (4-bit on the CPU): the weight stays packed, two nibbles a byte, and is dequantized
  inside torch's CPU INT4 matmul (`_weight_int4pack_mm_for_cpu`, AVX-512/AVX2 code); scales and
  zeros are held as bf16 pairs (s, (8 - z) * s) per group, and the activations go in as bf16 —
  the "A16" of W4A16. Only bf16 activations have a vectorised kernel in torch; fp32 inputs take
  a scalar path 25-70x slower (fp16 slower still; benches/bench_int4_matmul.py).
- `dequant` (the reference, any device, 8-bit, or whenever the kernel fails its check): the
  integers stay packed in uint8 (4-bit: two a byte), the weight is dequantized in float32 on each
  call and multiplied in the activations' dtype.

Before a layer uses `int4pack` it is run once on random inputs against `dequant`; a mismatch
turns the kernel off for that layer with a warning naming it. A layer the kernel takes over
keeps only the kernel's packed weight and bf16 pairs (0.53 bytes per weight at group 128).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aieng.config.quantization import QuantizationConfigError, WeightScheme
from aieng.distributed.parallel_state import get_tp_world_size
from aieng.layers.linear import (
    Linear,
    LinearMethod,
    WeightLoadError,
    copy_into,
    set_weight_attrs,
    sharded_param,
)
from aieng.quantization.packing import AWQ_PACK_ORDER, pack_factor, unpack_int32

logger = logging.getLogger(__name__)

KERNEL_GROUP_SIZES = (256, 128, 64, 32)  # group sizes torch's CPU INT4 kernel takes
# The kernel's relative error against the float32 reference on random inputs, beyond which it is
# turned off: bf16 activations and scales give ~3e-3.
KERNEL_TOLERANCE = 2e-2


@dataclass(frozen=True)
class _Tensor:
    """One checkpoint tensor of a quantized layer, described for `create_weights`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    output_dim: int | None  # the dimension fused shards stack along; None: shared by all shards
    pack: int = 1  # output columns per stored element along output_dim
    input_dim: int | None = None  # the dimension a row-parallel rank's input columns cut
    input_pack: int = 1  # input columns per stored element along input_dim


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


class QuantizedLinearMethod(LinearMethod):
    """Weight-only quantized y = x W^T (+ b) for one layer's `WeightScheme`."""

    def __init__(self, scheme: WeightScheme, prefix: str = "", use_kernel: bool = True):
        self.scheme = scheme
        self.prefix = prefix
        self.use_kernel = use_kernel
        self.kernel = "dequant"  # set by process_weights_after_loading

    # --- the checkpoint's tensors -------------------------------------------------------------

    def _tensors(self, input_size: int, output_size: int) -> list[_Tensor]:
        s = self.scheme
        factor = pack_factor(s.bits)
        groups = 1 if s.group_size is None else input_size // s.group_size
        # Along the input, a tensor stored per group is cut group by group; channel-wise scales
        # (one group) are whole on every rank.
        g_dim = None if s.group_size is None else 1
        g = s.group_size or 1
        if s.format == "compressed-tensors":
            packed = (output_size, -(-input_size // factor))
            tensors = [
                _Tensor("weight_packed", packed, torch.int32, 0, 1, 1, factor),
                _Tensor("weight_scale", (output_size, groups), torch.float32, 0, 1, g_dim, g),
                _Tensor("weight_shape", (2,), torch.int64, None),
            ]
            if not s.symmetric:
                shape = (-(-output_size // factor), groups)
                tensors.append(
                    _Tensor("weight_zero_point", shape, torch.int32, 0, factor, g_dim, g)
                )
            return tensors
        g_dim = None if s.group_size is None else 0
        zeros = _Tensor("qzeros", (groups, output_size // factor), torch.int32, 1, factor, g_dim, g)
        scales = _Tensor("scales", (groups, output_size), torch.float32, 1, 1, g_dim, g)
        if s.format == "awq":
            qweight = (input_size, output_size // factor)
            return [_Tensor("qweight", qweight, torch.int32, 1, factor, 0, 1), zeros, scales]
        return [  # gptq
            _Tensor("qweight", (input_size // factor, output_size), torch.int32, 1, 1, 0, factor),
            zeros,
            scales,
            _Tensor("g_idx", (input_size,), torch.int32, None),
        ]

    def _check_shape(self, layer: Linear, input_size: int, output_sizes: list[int]) -> None:
        s, where = self.scheme, f"{self.prefix or 'a linear layer'} ({self.scheme.describe()})"
        factor = pack_factor(s.bits)
        if layer.shard.input_sharded(layer.full_input_size):
            # A row-parallel rank's columns must be whole groups and whole packed words.
            unit = math.lcm(s.group_size or 1, 1 if s.format == "awq" else factor)
            if input_size % unit:
                raise QuantizationConfigError(
                    f"{where}: tensor_parallel_size {get_tp_world_size()} splits in_features "
                    f"{layer.full_input_size} into shards of {input_size} columns, not a multiple "
                    f"of {unit} (the quantization group size and packing)"
                )
        if s.group_size is not None and input_size % s.group_size:
            raise QuantizationConfigError(
                f"{where}: in_features {input_size} is not a multiple of group_size {s.group_size}"
            )
        if s.format == "gptq" and input_size % factor:
            raise QuantizationConfigError(
                f"{where}: in_features {input_size} is not a multiple of {factor}"
            )
        packs_output = s.format in ("awq", "gptq") or not s.symmetric
        if packs_output and any(size % factor for size in output_sizes):
            raise QuantizationConfigError(
                f"{where}: output sizes {output_sizes} are not multiples of {factor}, as the "
                f"format's packed tensors need"
            )

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        self._check_shape(layer, input_size, output_sizes)
        layer.quantized_names = []
        for spec in self._tensors(input_size, sum(output_sizes)):
            data = torch.zeros(spec.shape, dtype=spec.dtype)
            param = nn.Parameter(data, requires_grad=False)
            if spec.name == "weight_shape":
                param = self._shape_param(layer)
            elif spec.name == "g_idx":
                param = self._g_idx_param(data, layer)
            else:
                convert = spec.dtype.is_floating_point  # scales: any float dtype converts
                sharded_param(
                    param,
                    layer,
                    spec.output_dim or 0,
                    spec.pack,
                    spec.input_dim,
                    spec.input_pack,
                    convert,
                )
            layer.register_parameter(spec.name, param)
            layer.quantized_names.append(spec.name)
        if bias:
            b = nn.Parameter(torch.zeros(sum(output_sizes), dtype=dtype), requires_grad=False)
            layer.register_parameter("bias", sharded_param(b, layer, 0))
        else:
            layer.register_parameter("bias", None)

    def _shape_param(self, layer: Linear) -> nn.Parameter:
        """compressed-tensors' `weight_shape` ([out, in] of each shard, in the checkpoint: not
        this rank's share): checked, not kept."""
        param = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
        output_sizes, input_size = layer.full_output_sizes, layer.full_input_size

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
            rows = sum(output_sizes) if shard_id is None else output_sizes[shard_id]
            expected = [rows, input_size]
            if loaded.dtype.is_floating_point or loaded.tolist() != expected:
                raise WeightLoadError(f"= {loaded.tolist()}, expected {expected}")

        return set_weight_attrs(param, weight_loader=load, num_shards=len(output_sizes))

    def _g_idx_param(self, data: torch.Tensor, layer: Linear) -> nn.Parameter:
        """GPTQ's `g_idx` (group of each input channel, the checkpoint's whole input): must be
        the trivial one (no act-order); checked, not kept."""
        input_size, shards = layer.full_input_size, len(layer.full_output_sizes)
        group = self.scheme.group_size or input_size
        expected = torch.arange(input_size, dtype=torch.int32) // group
        data = data.new_empty(input_size)

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
            copy_into(param.data, loaded, convert=False)
            if not torch.equal(param.data, expected):
                raise WeightLoadError(
                    "is not in input order (act-order checkpoints are not supported)"
                )

        param = nn.Parameter(data, requires_grad=False)
        return set_weight_attrs(param, weight_loader=load, num_shards=shards)

    # --- the compute layout -------------------------------------------------------------------

    def unpack(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The checkpoint tensors -> (q (N, K) int32 in [0, 2^b), s (N, G) float32, z (N, G)
        float32), the weight being (q - z) * s group by group."""
        s, bits = self.scheme, self.scheme.bits
        n, k = sum(layer.output_sizes), layer.input_size
        if s.format == "compressed-tensors":
            q = unpack_int32(layer.weight_packed.data, bits, dim=1, size=k)
            scales = layer.weight_scale.data.float()
            if s.symmetric:
                zeros = torch.full_like(scales, float(1 << (bits - 1)))
            else:
                zeros = unpack_int32(layer.weight_zero_point.data, bits, dim=0, size=n).float()
            return q, scales, zeros
        if s.format == "awq":
            q = unpack_int32(layer.qweight.data, bits, dim=1, order=AWQ_PACK_ORDER).t()
            zeros = unpack_int32(layer.qzeros.data, bits, dim=1, order=AWQ_PACK_ORDER).t()
        else:
            q = unpack_int32(layer.qweight.data, bits, dim=0).t()
            zeros = unpack_int32(layer.qzeros.data, bits, dim=1).t() + s.zero_point_offset
        return q.contiguous(), layer.scales.data.float().t().contiguous(), zeros.float()

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scales, zeros = self.unpack(layer)
        for name in layer.quantized_names:
            delattr(layer, name)
        k = q.shape[1]
        device = scales.device
        layer.register_buffer("scales", scales.contiguous(), persistent=False)
        layer.register_buffer("zeros", zeros.contiguous(), persistent=False)
        if self.scheme.bits == 4:
            packed = (q[:, 0::2] | (q[:, 1::2] << 4)) if k % 2 == 0 else None
            if packed is None:
                packed = F.pad(q, (0, 1))
                packed = packed[:, 0::2] | (packed[:, 1::2] << 4)
            layer.register_buffer("qvalues", packed.to(torch.uint8), persistent=False)
        else:
            layer.register_buffer("qvalues", q.to(torch.uint8), persistent=False)
        self.kernel = "dequant"
        if self.use_kernel and self.scheme.bits == 4 and device.type == "cpu":
            self._try_int4pack(layer, q)

    def _try_int4pack(self, layer: Linear, q: torch.Tensor) -> None:
        k = q.shape[1]
        groups = layer.scales.shape[1]
        group_size = k // groups
        if not int4_kernel_available() or k % 2:
            return
        scales, zeros = layer.scales, layer.zeros
        if group_size not in KERNEL_GROUP_SIZES:
            # Channel-wise (or one large group): the same scale repeated over kernel-sized groups.
            fit = [g for g in KERNEL_GROUP_SIZES if group_size % g == 0]
            if not fit:
                return
            repeat = group_size // fit[0]
            group_size = fit[0]
            scales = scales.repeat_interleave(repeat, dim=1)
            zeros = zeros.repeat_interleave(repeat, dim=1)
        # The kernel takes whole tiles of 16 output rows: pad with zero-scale rows, cut after.
        pad = -q.shape[0] % 16
        if pad:
            q, scales, zeros = (F.pad(t, (0, 0, 0, pad)) for t in (q, scales, zeros))
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            pairs = torch.stack([scales.t(), ((8 - zeros) * scales).t()], dim=-1)
            pairs = pairs.to(torch.bfloat16).contiguous()
            x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
            got = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), packed, group_size, pairs
            ).float()[:, : q.shape[0] - pad]
        except RuntimeError as e:
            logger.warning("%s: the CPU INT4 kernel cannot run (%s); using dequant", self.prefix, e)
            return
        want = F.linear(x, dequantize(layer))
        error = float((got - want).norm() / want.norm().clamp_min(1e-30))
        if not error < KERNEL_TOLERANCE:
            logger.warning(
                "%s: the CPU INT4 kernel differs from its reference (relative error %.2e); "
                "it is turned off for this layer",
                self.prefix,
                error,
            )
            return
        layer.register_buffer("int4_packed", packed, persistent=False)
        layer.register_buffer("int4_scales_zeros", pairs, persistent=False)
        layer.int4_group_size = group_size
        layer.int4_padded_rows = pad
        # The kernel holds its own copy of the weight and its (scale, offset) pairs: the
        # reference's integers and float32 scales and zeros are dropped (12 bytes per group).
        layer.qvalues = layer.qvalues.new_empty(0)
        layer.scales = layer.scales.new_empty(0)
        layer.zeros = layer.zeros.new_empty(0)
        self.kernel = "int4pack"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int4pack":
            flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, layer.int4_packed, layer.int4_group_size, layer.int4_scales_zeros
            )
            if layer.int4_padded_rows:
                y = y[:, : y.shape[1] - layer.int4_padded_rows]
            y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
            return y if layer.bias is None else y + layer.bias
        return F.linear(x, dequantize(layer).to(x.dtype), layer.bias)


def dequantize(layer: Linear) -> torch.Tensor:
    """A processed quantized layer's weight as float32 (N, K): (q - z) * s, group by group,
    exactly as the checkpoint says — the reference each kernel is checked against at load. Once
    the kernel has taken a layer over, its weight as the kernel holds it (bf16 scales)."""
    scales, zeros = layer.scales, layer.zeros
    n, k = sum(layer.output_sizes), layer.input_size
    packed = layer.qvalues
    if packed.numel() == 0:  # the kernel holds the weight: unpack from its own copy instead
        return _dequantize_from_kernel(layer)
    if packed.shape[1] == k:
        q = packed.float()
    else:
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, -1)[:, :k].float()
    group_size = k // scales.shape[1]
    q = q.view(n, -1, group_size)
    return ((q - zeros[:, :, None]) * scales[:, :, None]).reshape(n, k)


def _dequantize_from_kernel(layer: Linear) -> torch.Tensor:
    """The weight a kernel layer multiplies by, as float32 (N, K). The int8 kernels read it
    back from their layout, (q - z) * s exactly. int4pack: (q - 8) * s + (8 - z) * s with its
    bf16 pairs; its integers live only in the kernel's (CPU-specific, blocked) layout: the
    kernel run on the identity with unit scales and zero offsets returns q - 8 exactly (small
    integers are exact in bf16)."""
    if hasattr(layer, "int8_weights"):
        return torch.from_numpy(layer.int8_weights.dequantize())
    n, k = sum(layer.output_sizes), layer.input_size
    pairs = layer.int4_scales_zeros  # (G, N + padding, 2)
    unit = torch.zeros_like(pairs)
    unit[..., 0] = 1
    eye = torch.eye(k, dtype=torch.bfloat16)
    centred = torch.ops.aten._weight_int4pack_mm_for_cpu(
        eye, layer.int4_packed, layer.int4_group_size, unit
    )
    centred = centred.float()[:, :n].t().reshape(n, pairs.shape[0], -1)  # q - 8, (N, G, g)
    scale = pairs[:, :n, 0].float().t()[:, :, None]
    offset = pairs[:, :n, 1].float().t()[:, :, None]
    return (centred * scale + offset).reshape(n, k)
