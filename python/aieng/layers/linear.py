"""Dense linear layers. Fused projections (q|k|v, gate|up) are one weight whose row blocks the
loader fills from the checkpoint's separate tensors; `shard_sizes` says where each block goes."""

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int | list[int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.shard_sizes = out_features if isinstance(out_features, list) else [out_features]
        out_total = sum(self.shard_sizes)
        # Left uninitialised: every weight is filled by the loader.
        self.weight = nn.Parameter(torch.empty(out_total, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_total, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
