"""Linear layers and the methods that hold their weights.

A `Linear` layer knows its shape — one input size and one or more output blocks (q|k|v and
gate|up are fused: one layer, several checkpoint tensors) — and asks its `LinearMethod` to create
the parameters and to apply them. The dense method holds a float (out, in) weight; a quantized
method (INT4) holds packed integers and scales with another layout. Each parameter carries a
`weight_loader(param, tensor, shard_id)` that places one checkpoint tensor (or one shard of a
fused layer) along the dimension its method says, converting the dtype only where the method
says, so the checkpoint loader itself knows nothing about fusing, packing or sharding. Under
tensor parallelism the layer holds this rank's share (`aieng.layers.parallel`) and the loaders
cut it from the full checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from aieng.distributed.parallel_state import get_tp_rank, get_tp_world_size, tp_all_reduce
from aieng.kernels.cpu_dense import DENSE_MAX_M, dense_gemv, passes_dense_check
from aieng.layers.parallel import LinearShard, replicated

WeightLoader = Callable[[nn.Parameter, torch.Tensor, int | None], None]


class WeightLoadError(ValueError):
    """A checkpoint tensor that cannot go into its parameter; the loader adds file and name."""


def check_loadable(param: torch.Tensor, loaded: torch.Tensor, convert: bool) -> None:
    """Refuse a tensor of the wrong kind: integers for a float parameter (or the reverse), a
    dtype change where the method does not convert, or NaN/Inf values."""
    if param.dtype.is_floating_point != loaded.dtype.is_floating_point:
        raise WeightLoadError(f"has dtype {loaded.dtype}, expected a tensor like {param.dtype}")
    if not convert and loaded.dtype != param.dtype:
        raise WeightLoadError(f"has dtype {loaded.dtype}, expected {param.dtype} (not converted)")
    if loaded.dtype.is_floating_point and not bool(torch.isfinite(loaded).all()):
        raise WeightLoadError("holds NaN or infinite values")


def copy_into(destination: torch.Tensor, loaded: torch.Tensor, convert: bool) -> None:
    if tuple(loaded.shape) != tuple(destination.shape):
        raise WeightLoadError(f"has shape {list(loaded.shape)}, expected {list(destination.shape)}")
    check_loadable(destination, loaded, convert)
    with torch.no_grad():
        destination.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
    """The whole tensor into the whole parameter, converting float dtypes."""
    copy_into(param.data, loaded, convert=True)


def set_weight_attrs(param: nn.Parameter, **attrs) -> nn.Parameter:
    for name, value in attrs.items():
        setattr(param, name, value)
    return param


class LinearMethod:
    """How a linear layer's weights are stored and multiplied."""

    def create_weights(
        self,
        layer: Linear,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype | None,
    ) -> None:
        raise NotImplementedError

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Called once all checkpoint tensors are placed: repack them for compute."""


class DenseLinearMethod(LinearMethod):
    """A float (out, in) weight: y = x W^T + b. Checkpoint shards stack along dim 0. On the CPU,
    batches of up to DENSE_MAX_M rows go through aieng's dense GEMV once it passed its check
    for the layer (`aieng.kernels.cpu_dense`)."""

    gemv = False

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        total = sum(output_sizes)
        # Left uninitialised: every weight is filled by the loader.
        weight = nn.Parameter(torch.empty(total, input_size, dtype=dtype))
        layer.register_parameter("weight", sharded_param(weight, layer, 0, input_dim=1))
        if bias:
            b = nn.Parameter(torch.empty(total, dtype=dtype))
            layer.register_parameter("bias", sharded_param(b, layer, 0))
        else:
            layer.register_parameter("bias", None)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.gemv = passes_dense_check(layer.weight, layer.prefix)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        # The kernel has no backward: only where no gradient is wanted (the engine's steps).
        if self.gemv and x.numel() <= DENSE_MAX_M * x.shape[-1] and not torch.is_grad_enabled():
            y = dense_gemv(x, layer.weight)
            return y if layer.bias is None else y + layer.bias
        return F.linear(x, layer.weight, layer.bias)


def sharded_param(
    param: nn.Parameter,
    layer: Linear,
    output_dim: int | None,
    output_pack: int = 1,
    input_dim: int | None = None,
    input_pack: int = 1,
    convert_dtype: bool = True,
) -> nn.Parameter:
    """Give `param` (this rank's share of one of `layer`'s tensors) a weight loader that takes
    the checkpoint's tensor — one block of a fused layer (shard id i), or the whole fused layer
    (no shard id: Phi-3's stored qkv_proj and gate_up_proj) — checks its full shape, and copies
    this rank's rows of each block (`layer.shard`) to the block's place here, and for a
    row-parallel layer only this rank's input columns. `output_dim`/`input_dim` are the
    dimensions of this parameter's layout (None: it has none, e.g. a bias has no input dim);
    `output_pack`/`input_pack` output columns/input columns share one stored element (packed
    INT4 integers; a group's scale)."""
    shard = layer.shard
    full_sizes, full_input = layer.full_output_sizes, layer.full_input_size
    local_starts = [
        sum(size for _, size in shard.output_slices[:i]) for i in range(len(full_sizes))
    ]
    split_output = output_dim is not None and shard.output_sharded(full_sizes)
    split_input = input_dim is not None and shard.input_sharded(full_input)
    if split_output:
        for start, size in shard.output_slices:
            _check_aligned(layer, "output rows", start, size, output_pack)
    if split_input:
        _check_aligned(layer, "input columns", *shard.input_slice, input_pack)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        blocks = range(len(full_sizes)) if shard_id is None or len(full_sizes) == 1 else [shard_id]
        expected = list(param.shape)
        if output_dim is not None:
            expected[output_dim] = sum(full_sizes[b] for b in blocks) // output_pack
        if split_input:
            expected[input_dim] = -(-full_input // input_pack)
        if list(loaded.shape) != expected:
            raise WeightLoadError(f"has shape {list(loaded.shape)}, expected {expected}")
        if split_input:
            start, size = shard.input_slice
            loaded = loaded.narrow(input_dim, start // input_pack, size // input_pack)
        if output_dim is None:
            copy_into(param.data, loaded, convert_dtype)
            return
        base = 0
        for b in blocks:
            start, size = (s // output_pack for s in shard.output_slices[b])
            full = full_sizes[b] // output_pack
            held = max(0, min(size, full - start))  # a padded vocabulary share holds fewer
            destination = param.data.narrow(output_dim, local_starts[b] // output_pack, size)
            if held < size:
                with torch.no_grad():
                    destination.narrow(output_dim, held, size - held).zero_()
            source = loaded.narrow(output_dim, base + start, held)
            copy_into(destination.narrow(output_dim, 0, held), source, convert_dtype)
            base += full

    return set_weight_attrs(
        param, weight_loader=load, output_dim=output_dim or 0, num_shards=len(full_sizes)
    )


def _check_aligned(layer: Linear, what: str, start: int, size: int, pack: int) -> None:
    if start % pack or size % pack:
        raise ValueError(
            f"{layer.prefix or 'a linear layer'}: tensor_parallel_size "
            f"{get_tp_world_size()} gives this rank {what} [{start}, {start + size}), which do "
            f"not align to the {pack} the stored tensor packs or groups together"
        )


# Chooses each linear layer's method from its name (e.g. "model.layers.0.mlp.down_proj"), so a
# quantized checkpoint can keep some layers dense (an `ignore` list, the LM head).
LinearMethodChooser = Callable[[str], LinearMethod]


def dense_everywhere(prefix: str) -> LinearMethod:
    return DenseLinearMethod()


class Linear(nn.Module):
    """y = x W^T (+ b), with W held by the method `methods` chooses for this layer's `prefix`
    (its name in the checkpoint). `output_sizes` lists the blocks of a fused projection (one
    block for a plain layer). `shard` is this tensor-parallel rank's part (aieng.layers.parallel;
    None: the whole layer): `input_size` and `output_sizes` become this rank's, the checkpoint's
    are kept as `full_input_size` and `full_output_sizes`. A layer whose input is split returns
    partial sums, all-reduced here when `shard.reduce`; its bias is held by rank 0 alone (zero on
    the others), so that the sum adds it once."""

    def __init__(
        self,
        input_size: int,
        output_sizes: int | list[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        methods: LinearMethodChooser = dense_everywhere,
        prefix: str = "",
        shard: LinearShard | None = None,
    ):
        super().__init__()
        full_sizes = output_sizes if isinstance(output_sizes, list) else [output_sizes]
        self.full_input_size, self.full_output_sizes = input_size, full_sizes
        self.shard = shard or replicated(input_size, full_sizes)
        self.input_size = self.shard.input_slice[1]
        self.output_sizes = [size for _, size in self.shard.output_slices]
        self.prefix = prefix
        self.tp_size = get_tp_world_size()  # the group this layer was cut for
        self.method = methods(prefix)
        self.method.create_weights(self, self.input_size, self.output_sizes, bias, dtype)
        partial = self.shard.input_sharded(input_size)
        if partial and get_tp_rank() != 0 and self.bias is not None:
            _zero_after_loading(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return tp_all_reduce(y, self.tp_size) if self.shard.reduce else y


def _zero_after_loading(param: nn.Parameter) -> None:
    """The checkpoint's tensor is still checked and placed, then zeroed."""
    load = param.weight_loader

    def load_then_zero(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        load(param, loaded, shard_id)
        with torch.no_grad():
            param.data.zero_()

    param.weight_loader = load_then_zero
