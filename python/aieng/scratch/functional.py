"""Losses over class indices, with their input checks (torch.nn.functional's names)."""

import numpy as np

from aieng.scratch.ops import NLLLoss
from aieng.scratch.tensor import Tensor, apply_function


def nll_loss(log_probs: Tensor, target: Tensor | np.ndarray) -> Tensor:
    """Mean over the batch of -log_probs[i, target[i]]; log_probs (N, C), target (N,) ints."""
    if log_probs.ndim != 2:
        raise ValueError(f"expected (batch, classes) scores, got shape {log_probs.shape}")
    n, classes = log_probs.shape
    if n == 0:
        raise ValueError("the batch is empty")
    target = target if isinstance(target, Tensor) else Tensor(target)
    if not np.issubdtype(target.dtype, np.integer):
        raise TypeError(f"targets are class indices (integers), not {target.dtype}")
    if target.shape != (n,):
        raise ValueError(f"expected {n} targets for {n} rows, got shape {target.shape}")
    outside = (target.data < 0) | (target.data >= classes)
    if outside.any():
        bad = int(target.data[outside][0])
        raise IndexError(f"target {bad} is out of range for {classes} classes")
    return apply_function(NLLLoss, log_probs, target)


def cross_entropy(logits: Tensor, target: Tensor | np.ndarray) -> Tensor:
    """Mean cross-entropy of (N, C) unnormalized scores against N class indices."""
    if logits.ndim != 2:
        raise ValueError(f"expected (batch, classes) scores, got shape {logits.shape}")
    return nll_loss(logits.log_softmax(axis=1), target)
