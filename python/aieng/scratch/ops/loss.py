"""Negative log-likelihood over class indices, averaged over the batch (cross-entropy is this
after log-softmax)."""

import numpy as np

from aieng.scratch.function import Function
from aieng.scratch.node import FunctionNode


class NLLLoss(Function):
    saved_inputs = (1,)  # the targets; the gradient does not depend on the log-probabilities

    @staticmethod
    def forward(ctx: FunctionNode, log_probs: np.ndarray, target: np.ndarray) -> np.ndarray:
        rows = np.arange(log_probs.shape[0])  # log_probs (N, C), target (N,)
        return -log_probs[rows, target].mean()

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        (target,) = ctx.saved_arrays
        n = target.shape[0]
        grad_log_probs = np.zeros(ctx.input_shapes[0], dtype=grad.dtype)
        grad_log_probs[np.arange(n), target] = -grad / n
        return grad_log_probs, None
