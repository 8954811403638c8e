"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as Hugging Face's norms do.

Llama casts the normalised input back to its dtype and then multiplies by the weight; OLMo 2
multiplies in float32 and casts the product (`weight_in_float32`), which differs in bfloat16.
Gemma stores the weight as an offset from one and multiplies by (1 + w) in float32, then casts
(`unit_offset`); its weights start at zero.

On an NVIDIA GPU the Llama and OLMo 2 forms run as one fused kernel (`aieng.kernels.fused`,
chosen by `aieng.kernels.fused_dispatch`), as does a pre-norm decoder's residual add with the
norm after it (`RMSNorm.add_and_norm`); everywhere else, and for Gemma's form, the torch ops
below."""

import torch
from torch import nn

from aieng.distributed.parallel_state import get_tp_world_size, tp_all_reduce
from aieng.kernels.fused_dispatch import fused_add_rms_norm
from aieng.kernels.reference import rms_norm, weighted_norm
from aieng.layers.linear import WeightLoadError, copy_into


class RMSNorm(nn.Module):
    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype | None = None,
        weight_in_float32: bool = False,
        unit_offset: bool = False,
    ):
        super().__init__()
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        self.unit_offset = unit_offset
        initial = torch.zeros if unit_offset else torch.ones  # the identity either way
        self.weight = nn.Parameter(initial(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.unit_offset:
            fused = fused_add_rms_norm(x, None, self.weight, self.eps, self.weight_in_float32)
            if fused is not None:
                return fused[1]
        return rms_norm(x, self.weight, self.eps, self.weight_in_float32, self.unit_offset)

    def add_and_norm(
        self, x: torch.Tensor, branch: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x + branch, this norm of it): a pre-norm decoder's residual add and the norm of
        the next sublayer's input. The fused kernel writes the sum into `branch` (a sublayer's
        fresh output, handed over; x + branch rounds as branch + x); torch adds out of place."""
        if not self.unit_offset:
            fused = fused_add_rms_norm(branch, x, self.weight, self.eps, self.weight_in_float32)
            if fused is not None:
                return fused
        summed = x + branch
        return summed, self(summed)


class SplitRMSNorm(nn.Module):
    """RMSNorm over a vector whose elements are split across tensor-parallel ranks (OLMo 2 norms
    q and k over all heads; each rank holds some heads). The sum of squares is all-reduced, and
    divided by this rank's size times the ranks: a KV head replicated on r ranks is counted r
    times in both. The weight is this rank's `part` (start, size) of the checkpoint's."""

    def __init__(
        self,
        full_size: int,
        part: tuple[int, int],
        eps: float,
        dtype: torch.dtype | None = None,
        weight_in_float32: bool = False,
    ):
        super().__init__()
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        self.full_size, (self.start, size) = full_size, part
        self.tp_size = get_tp_world_size()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        if list(loaded.shape) != [self.full_size]:
            raise WeightLoadError(f"has shape {list(loaded.shape)}, expected [{self.full_size}]")
        copy_into(param.data, loaded[self.start : self.start + param.shape[0]], convert=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = tp_all_reduce(x32.pow(2).sum(-1, keepdim=True), self.tp_size)
        mean = squares / (x.shape[-1] * self.tp_size)
        x32 = x32 * torch.rsqrt(mean + self.eps)
        return weighted_norm(x32, x.dtype, self.weight, self.weight_in_float32, False)
