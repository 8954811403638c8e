"""The differentiable operations, each a `Function`: forward over arrays, backward rule."""

from aieng.scratch.ops.arithmetic import Add, Div, Mul, Neg, Pow, Sub
from aieng.scratch.ops.loss import NLLLoss
from aieng.scratch.ops.matmul import MatMul
from aieng.scratch.ops.reduction import Mean, Sum
from aieng.scratch.ops.shape import Permute, Reshape
from aieng.scratch.ops.softmax import LogSoftmax, Softmax
from aieng.scratch.ops.unary import Exp, Log, ReLU, Tanh

__all__ = [
    "Add",
    "Div",
    "Exp",
    "Log",
    "LogSoftmax",
    "MatMul",
    "Mean",
    "Mul",
    "NLLLoss",
    "Neg",
    "Permute",
    "Pow",
    "ReLU",
    "Reshape",
    "Softmax",
    "Sub",
    "Sum",
    "Tanh",
]
