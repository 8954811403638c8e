"""Sum and mean over some axes (or all), with or without keeping the reduced axes."""

import numpy as np

from aieng.scratch.function import Function
from aieng.scratch.node import FunctionNode
from aieng.scratch.ops.grad_shapes import expand_reduced, normalize_axes


class Sum(Function):
    @staticmethod
    def forward(
        ctx: FunctionNode, a: np.ndarray, axis: int | tuple[int, ...] | None, keepdims: bool
    ) -> np.ndarray:
        ctx.axes, ctx.keepdims = normalize_axes(axis, a.ndim), keepdims
        return np.sum(a, axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        return (expand_reduced(grad, ctx.axes, ctx.keepdims, ctx.input_shapes[0]),)


class Mean(Function):
    @staticmethod
    def forward(
        ctx: FunctionNode, a: np.ndarray, axis: int | tuple[int, ...] | None, keepdims: bool
    ) -> np.ndarray:
        ctx.axes, ctx.keepdims = normalize_axes(axis, a.ndim), keepdims
        ctx.count = int(np.prod([a.shape[i] for i in ctx.axes]))
        return np.mean(a, axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        spread = expand_reduced(grad, ctx.axes, ctx.keepdims, ctx.input_shapes[0])
        return (spread / ctx.count,)
