"""A miniature reverse-mode automatic differentiation engine over numpy, written to understand
the compute layer torch provides to the rest of aieng (docs/scratch.md). Nothing in the engine
imports it.

    from aieng.scratch import MLP, Adam, Tensor, cross_entropy
"""

from aieng.scratch.data import spirals
from aieng.scratch.errors import GraphFreedError, InPlaceOnGraphError, SavedTensorModifiedError
from aieng.scratch.function import Function
from aieng.scratch.functional import cross_entropy, nll_loss
from aieng.scratch.grad_mode import is_grad_enabled, no_grad
from aieng.scratch.nn import MLP, Linear
from aieng.scratch.optim import SGD, Adam, Optimizer
from aieng.scratch.tensor import Tensor, apply_function

__all__ = [
    "MLP",
    "SGD",
    "Adam",
    "Function",
    "GraphFreedError",
    "InPlaceOnGraphError",
    "Linear",
    "Optimizer",
    "SavedTensorModifiedError",
    "Tensor",
    "apply_function",
    "cross_entropy",
    "is_grad_enabled",
    "nll_loss",
    "no_grad",
    "spirals",
]
