"""Elementwise functions. Those whose derivative is cheapest from their result save the result."""

import numpy as np

from aieng.scratch.function import Function
from aieng.scratch.node import FunctionNode


class Exp(Function):
    saves_output = True

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray) -> np.ndarray:
        return np.exp(a)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        (out,) = ctx.saved_arrays
        return (grad * out,)


class Log(Function):
    saved_inputs = (0,)

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray) -> np.ndarray:
        return np.log(a)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        (a,) = ctx.saved_arrays
        return (grad / a,)


class Tanh(Function):
    saves_output = True

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray) -> np.ndarray:
        return np.tanh(a)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        (out,) = ctx.saved_arrays
        return (grad * (1 - out * out),)


class ReLU(Function):
    saves_output = True

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray) -> np.ndarray:
        return np.maximum(a, 0)

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        (out,) = ctx.saved_arrays
        return (grad * (out > 0),)  # 0 at 0, as torch
