"""Softmax and log-softmax along one axis, shifted by the maximum so exp cannot overflow."""

import numpy as np

from aieng.scratch.function import Function
from aieng.scratch.node import FunctionNode
from aieng.scratch.ops.grad_shapes import normalize_axes


def _shifted(a: np.ndarray, axis: int) -> np.ndarray:
    return a - a.max(axis=axis, keepdims=True)


class Softmax(Function):
    saves_output = True

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, axis: int) -> np.ndarray:
        (ctx.axis,) = normalize_axes(axis, a.ndim)
        e = np.exp(_shifted(a, ctx.axis))
        return e / e.sum(axis=ctx.axis, keepdims=True)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        (out,) = ctx.saved_arrays
        return (out * (grad - (grad * out).sum(axis=ctx.axis, keepdims=True)),)


class LogSoftmax(Function):
    saves_output = True

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, axis: int) -> np.ndarray:
        (ctx.axis,) = normalize_axes(axis, a.ndim)
        shifted = _shifted(a, ctx.axis)
        return shifted - np.log(np.exp(shifted).sum(axis=ctx.axis, keepdims=True))

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        (out,) = ctx.saved_arrays
        return (grad - np.exp(out) * grad.sum(axis=ctx.axis, keepdims=True),)
