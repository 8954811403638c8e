"""`Function`: one differentiable operation, as a forward over numpy arrays and a backward rule.

A subclass declares what backward needs (`saved_inputs`, `saves_output`) instead of saving it in
forward: `Tensor` saves those, with their versions, only when it records the graph."""

from typing import Any, ClassVar

import numpy as np

from aieng.scratch.node import FunctionNode


class Function:
    saved_inputs: ClassVar[tuple[int, ...]] = ()  # indices of the inputs backward reads
    saves_output: ClassVar[bool] = False  # backward reads the result
    is_view: ClassVar[bool] = False  # the result may share the first input's buffer

    @staticmethod
    def forward(ctx: FunctionNode, *inputs: np.ndarray, **constants: Any) -> np.ndarray:
        raise NotImplementedError

    @staticmethod
    def backward(ctx: FunctionNode, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        """The gradient for each input (None where `ctx.needs_input_grad` is False), each of
        that input's shape, given the gradient of the result."""
        raise NotImplementedError
