"""Reshape and permute: views of the input's buffer (so they share its version counter)."""

import numpy as np

from aieng.scratch.function import Function
from aieng.scratch.node import FunctionNode


class Reshape(Function):
    is_view = True

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return a.reshape(shape)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        return (grad.reshape(ctx.input_shapes[0]),)


class Permute(Function):
    is_view = True

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        if sorted(axes) != list(range(a.ndim)):
            raise ValueError(f"{axes} is not a permutation of the {a.ndim} axes")
        ctx.axes = axes
        return np.transpose(a, axes)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        return (np.transpose(grad, np.argsort(ctx.axes)),)
