"""Linear layers and the methods that hold their weights.

A `Linear` layer knows its shape — one input size and one or more output blocks (q|k|v and
gate|up are fused: one layer, several checkpoint tensors) — and asks its `LinearMethod` to create
the parameters and to apply them. The dense method holds a float (out, in) weight; a quantized
method (INT4) holds packed integers and scales with another layout. Each parameter carries a
`weight_loader(param, tensor, shard_id)` that places one checkpoint tensor (or one shard of a
fused layer) along the dimension its method says, converting the dtype only where the method
says, so the checkpoint loader itself knows nothing about fusing, packing or sharding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

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
    """A float (out, in) weight: y = x W^T + b. Checkpoint shards stack along dim 0."""

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        total = sum(output_sizes)
        # Left uninitialised: every weight is filled by the loader.
        weight = nn.Parameter(torch.empty(total, input_size, dtype=dtype))
        layer.register_parameter("weight", fused_output_param(weight, output_sizes, dim=0))
        if bias:
            b = nn.Parameter(torch.empty(total, dtype=dtype))
            layer.register_parameter("bias", fused_output_param(b, output_sizes, dim=0))
        else:
            layer.register_parameter("bias", None)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


def fused_output_param(
    param: nn.Parameter,
    output_sizes: list[int],
    dim: int,
    pack_factor: int = 1,
    convert_dtype: bool = True,
) -> nn.Parameter:
    """Give `param` a weight loader that puts shard i of a fused layer at its block of rows
    (`dim` is the output dimension in this parameter's layout; `pack_factor` output columns
    share one stored element, as in packed INT4). A tensor without a shard id is the whole fused
    layer, as checkpoints that store it fused (Phi-3's qkv_proj and gate_up_proj) have it."""
    starts = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        destination = param.data
        if len(output_sizes) > 1 and shard_id is not None:
            start, size = starts[shard_id] // pack_factor, output_sizes[shard_id] // pack_factor
            destination = destination.narrow(dim, start, size)
        copy_into(destination, loaded, convert_dtype)

    return set_weight_attrs(param, weight_loader=load, output_dim=dim, num_shards=len(output_sizes))


# Chooses each linear layer's method from its name (e.g. "model.layers.0.mlp.down_proj"), so a
# quantized checkpoint can keep some layers dense (an `ignore` list, the LM head).
LinearMethodChooser = Callable[[str], LinearMethod]


def dense_everywhere(prefix: str) -> LinearMethod:
    return DenseLinearMethod()


class Linear(nn.Module):
    """y = x W^T (+ b), with W held by the method `methods` chooses for this layer's `prefix`
    (its name in the checkpoint). `output_sizes` lists the blocks of a fused projection (one
    block for a plain layer)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: int | list[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
        methods: LinearMethodChooser = dense_everywhere,
        prefix: str = "",
    ):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = output_sizes if isinstance(output_sizes, list) else [output_sizes]
        self.prefix = prefix
        self.method = methods(prefix)
        self.method.create_weights(self, input_size, self.output_sizes, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
