"""Elementwise arithmetic with numpy broadcasting in both directions: each input's gradient is
summed back to that input's shape."""

import numpy as np

from aieng.scratch.function import Function
from aieng.scratch.node import FunctionNode
from aieng.scratch.ops.grad_shapes import unbroadcast


class Add(Function):
    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        a_shape, b_shape = ctx.input_shapes
        need_a, need_b = ctx.needs_input_grad
        return (
            unbroadcast(grad, a_shape) if need_a else None,
            unbroadcast(grad, b_shape) if need_b else None,
        )


class Sub(Function):
    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a - b

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        a_shape, b_shape = ctx.input_shapes
        need_a, need_b = ctx.needs_input_grad
        return (
            unbroadcast(grad, a_shape) if need_a else None,
            unbroadcast(-grad, b_shape) if need_b else None,
        )


class Mul(Function):
    saved_inputs = (0, 1)

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a * b

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        a, b = ctx.saved_arrays
        need_a, need_b = ctx.needs_input_grad
        return (
            unbroadcast(grad * b, a.shape) if need_a else None,
            unbroadcast(grad * a, b.shape) if need_b else None,
        )


class Div(Function):
    saved_inputs = (0, 1)

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a / b

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        a, b = ctx.saved_arrays
        need_a, need_b = ctx.needs_input_grad
        return (
            unbroadcast(grad / b, a.shape) if need_a else None,
            unbroadcast(-grad * a / (b * b), b.shape) if need_b else None,
        )


class Neg(Function):
    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray) -> np.ndarray:
        return -a

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        return (-grad,)


class Pow(Function):
    """`a ** exponent` for a constant exponent."""

    saved_inputs = (0,)

    @staticmethod
    def forward(ctx: FunctionNode, a: np.ndarray, exponent: float) -> np.ndarray:
        ctx.exponent = exponent
        return a**exponent

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        (a,) = ctx.saved_arrays
        if ctx.exponent == 0:  # d/da a**0 is 0 everywhere, 0 ** -1 included
            return (np.zeros_like(grad),)
        return (grad * ctx.exponent * a ** (ctx.exponent - 1),)
