"""Matrix product with numpy's rules: 1-D operands are promoted to a row (left) or a column
(right) and the added axis dropped; leading (batch) axes broadcast."""

import numpy as np

from aieng.scratch.function import Function
from aieng.scratch.node import FunctionNode
from aieng.scratch.ops.grad_shapes import unbroadcast


def _swap_last(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


class MatMul(Function):
    saved_inputs = (0, 1)

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if a.ndim == 0 or b.ndim == 0:
            raise ValueError("matmul needs operands of at least one dimension, not scalars")
        return np.matmul(a, b)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        a, b = ctx.saved_arrays
        need_a, need_b = ctx.needs_input_grad
        a2 = a[None, :] if a.ndim == 1 else a  # (..., m, k)
        b2 = b[:, None] if b.ndim == 1 else b  # (..., k, n)
        g2 = grad[..., None] if b.ndim == 1 else grad
        g2 = np.expand_dims(g2, -2) if a.ndim == 1 else g2  # (..., m, n)
        grad_a = grad_b = None
        if need_a:
            grad_a = unbroadcast(g2 @ _swap_last(b2), a2.shape).reshape(a.shape)
        if need_b:
            grad_b = unbroadcast(_swap_last(a2) @ g2, b2.shape).reshape(b.shape)
        return grad_a, grad_b
