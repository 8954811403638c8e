"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as Hugging Face's Llama does.

Llama casts the normalised input back to its dtype and then multiplies by the weight; OLMo 2
multiplies in float32 and casts the product (`weight_in_float32`), which differs in bfloat16."""

import torch
from torch import nn


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float32: bool = False
) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float32:
        return (weight * x32).to(x.dtype)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype | None = None,
        weight_in_float32: bool = False,
    ):
        super().__init__()
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.weight_in_float32)
