"""`Tensor`: a numpy array with what reverse-mode differentiation needs — whether it requires a
gradient, the gradient (`grad`, on leaves), the node that made it (`grad_fn`, on results), and a
version counter that every in-place change bumps."""

from __future__ import annotations

import weakref
from typing import Any, TypeAlias

import numpy as np

from aieng.scratch.engine import run_backward
from aieng.scratch.errors import InPlaceOnGraphError
from aieng.scratch.function import Function
from aieng.scratch.grad_mode import is_grad_enabled
from aieng.scratch.node import AccumulateGrad, FunctionNode, Node, SavedTensor, VersionCounter
from aieng.scratch.ops import (
    Add,
    Div,
    Exp,
    Log,
    LogSoftmax,
    MatMul,
    Mean,
    Mul,
    Neg,
    Permute,
    Pow,
    ReLU,
    Reshape,
    Softmax,
    Sub,
    Sum,
    Tanh,
)

Operand: TypeAlias = "Tensor | np.ndarray | float | int"
Axis: TypeAlias = "int | tuple[int, ...] | None"


class Tensor:
    __slots__ = (
        "__weakref__",
        "_accumulator",
        "_base",
        "_version",
        "data",
        "grad",
        "grad_fn",
        "name",
        "requires_grad",
    )
    __array_ufunc__ = None  # `ndarray * Tensor` calls Tensor.__rmul__

    def __init__(
        self,
        data: Any,
        requires_grad: bool = False,
        name: str | None = None,
        dtype: Any = None,
    ) -> None:
        """A leaf over a copy of `data` (an array, a nested list, a number, or a Tensor)."""
        array = np.array(data.data if isinstance(data, Tensor) else data, dtype=dtype)
        if array.dtype.kind not in "biuf":  # bool, signed, unsigned, floating
            raise TypeError(f"a Tensor holds real numbers, not {array.dtype} ({data!r:.40})")
        if requires_grad and not np.issubdtype(array.dtype, np.floating):
            raise TypeError(f"only floating-point tensors can require grad, not {array.dtype}")
        self._init(array, VersionCounter(), name)
        self.requires_grad = requires_grad

    @classmethod
    def _wrap(cls, array: np.ndarray, version: VersionCounter) -> Tensor:
        tensor = cls.__new__(cls)
        tensor._init(array, version, None)
        tensor.requires_grad = False
        return tensor

    def _init(self, array: np.ndarray, version: VersionCounter, name: str | None) -> None:
        self.data = array
        self.grad: Tensor | None = None
        self.grad_fn: FunctionNode | None = None
        self.name = name
        self._version = version
        self._base: Tensor | None = None  # the tensor whose buffer this one views
        self._accumulator: weakref.ref[AccumulateGrad] | None = None

    # -------------------------------------------------------------- description

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def is_leaf(self) -> bool:
        return self.grad_fn is None

    @property
    def version(self) -> int:
        """How many in-place changes its buffer has had (torch's `_version`)."""
        return self._version.value

    def numpy(self) -> np.ndarray:
        return self.data

    def item(self) -> float:
        return self.data.item()

    def detach(self) -> Tensor:
        """The same buffer (and version counter), outside the graph."""
        view = Tensor._wrap(self.data, self._version)
        view._base = self if self._base is None else self._base
        return view

    def describe(self) -> str:
        """How an error names it: its name, shape, the node that made it, what it views."""
        who = f"tensor '{self.name}'" if self.name else "a tensor"
        made_by = f", the output of {self.grad_fn.name}" if self.grad_fn else ""
        of_base = f", a view of {self._base.describe()}" if self._base is not None else ""
        return f"{who} of shape {self.shape}{made_by}{of_base}"

    def __repr__(self) -> str:
        extra = f", name={self.name!r}" if self.name else ""
        if self.grad_fn is not None:
            extra += f", grad_fn=<{self.grad_fn.name}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return f"Tensor({self.data!r}{extra})"

    def __len__(self) -> int:
        return len(self.data)

    def __bool__(self) -> bool:
        return bool(self.data)

    # -------------------------------------------------------------- operators

    def __add__(self, other: Operand) -> Tensor:
        return apply_function(Add, self, lift(other, self))

    def __radd__(self, other: Operand) -> Tensor:
        return apply_function(Add, lift(other, self), self)

    def __sub__(self, other: Operand) -> Tensor:
        return apply_function(Sub, self, lift(other, self))

    def __rsub__(self, other: Operand) -> Tensor:
        return apply_function(Sub, lift(other, self), self)

    def __mul__(self, other: Operand) -> Tensor:
        return apply_function(Mul, self, lift(other, self))

    def __rmul__(self, other: Operand) -> Tensor:
        return apply_function(Mul, lift(other, self), self)

    def __truediv__(self, other: Operand) -> Tensor:
        return apply_function(Div, self, lift(other, self))

    def __rtruediv__(self, other: Operand) -> Tensor:
        return apply_function(Div, lift(other, self), self)

    def __neg__(self) -> Tensor:
        return apply_function(Neg, self)

    def __pow__(self, exponent: float) -> Tensor:
        if isinstance(exponent, bool) or not isinstance(exponent, (int, float, np.number)):
            raise TypeError(f"the exponent must be a constant number, not {exponent!r}")
        return apply_function(Pow, self, exponent=float(exponent))

    def __matmul__(self, other: Operand) -> Tensor:
        return apply_function(MatMul, self, lift(other, self))

    def __rmatmul__(self, other: Operand) -> Tensor:
        return apply_function(MatMul, lift(other, self), self)

    def sum(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return apply_function(Sum, self, axis=axis, keepdims=keepdims)

    def mean(self, axis: Axis = None, keepdims: bool = False) -> Tensor:
        return apply_function(Mean, self, axis=axis, keepdims=keepdims)

    def reshape(self, *shape: int | tuple[int, ...]) -> Tensor:
        flat = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return apply_function(Reshape, self, shape=tuple(flat))

    def permute(self, *axes: int) -> Tensor:
        return apply_function(Permute, self, axes=tuple(axes))

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        """Swap two axes (torch's transpose)."""
        for dim in (dim0, dim1):
            if not -self.ndim <= dim < self.ndim:
                raise ValueError(
                    f"axis {dim} is out of range for a tensor of {self.ndim} dimensions"
                )
        axes = list(range(self.ndim))
        axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
        return self.permute(*axes)

    @property
    def T(self) -> Tensor:
        return self.permute(*reversed(range(self.ndim)))

    def exp(self) -> Tensor:
        return apply_function(Exp, self)

    def log(self) -> Tensor:
        return apply_function(Log, self)

    def tanh(self) -> Tensor:
        return apply_function(Tanh, self)

    def relu(self) -> Tensor:
        return apply_function(ReLU, self)

    def softmax(self, axis: int) -> Tensor:
        return apply_function(Softmax, self, axis=axis)

    def log_softmax(self, axis: int) -> Tensor:
        return apply_function(LogSoftmax, self, axis=axis)

    # -------------------------------------------------------------- in place

    def add_(self, other: Operand, alpha: float = 1.0) -> Tensor:
        value = as_array(other)
        return self._modify(lambda d: np.add(d, value if alpha == 1 else alpha * value, out=d))

    def sub_(self, other: Operand, alpha: float = 1.0) -> Tensor:
        return self.add_(other, alpha=-alpha)

    def mul_(self, other: Operand) -> Tensor:
        value = as_array(other)
        return self._modify(lambda d: np.multiply(d, value, out=d))

    def zero_(self) -> Tensor:
        return self._modify(lambda d: d.fill(0))

    def _modify(self, change: Any) -> Tensor:
        if self.requires_grad and is_grad_enabled():
            raise InPlaceOnGraphError(
                f"{self.describe()} requires grad, and scratch does not record in-place "
                f"operations: change it under no_grad() (as an optimizer step does) or use the "
                f"out-of-place operator"
            )
        change(self.data)
        self._version.bump()
        return self

    # -------------------------------------------------------------- backward

    def backward(self, grad: Operand | None = None, retain_graph: bool = False) -> None:
        """Add d(self)/d(leaf), times `grad`, to the `.grad` of every leaf that requires grad.
        `grad` defaults to 1 for a one-element tensor. The graph's saved tensors are freed
        unless `retain_graph`."""
        root = self._grad_node()
        if root is None:
            raise RuntimeError(
                f"backward() on {self.describe()} that does not require grad: no graph was "
                f"recorded (none of its inputs requires grad, or it was made under no_grad())"
            )
        if grad is None:
            if self.size != 1:
                raise RuntimeError(
                    f"backward() without grad= needs a one-element tensor, not shape {self.shape}"
                )
            seed = np.ones_like(self.data)
        else:
            seed = np.asarray(as_array(grad), dtype=self.dtype)
            if seed.shape != self.shape:
                raise ValueError(f"grad has shape {seed.shape}, the tensor {self.shape}")
        run_backward(root, seed, retain_graph)

    def _grad_node(self) -> Node | None:
        """Where a gradient for this tensor goes: its grad_fn, the accumulator of a leaf that
        requires grad (one per leaf while a graph holds it), or nowhere."""
        if self.grad_fn is not None:
            return self.grad_fn
        if not self.requires_grad:
            return None
        accumulator = self._accumulator() if self._accumulator is not None else None
        if accumulator is None:
            accumulator = AccumulateGrad(self)
            self._accumulator = weakref.ref(accumulator)
        return accumulator

    def _accumulate_grad(self, grad: np.ndarray) -> None:
        grad = np.asarray(grad, dtype=self.dtype)
        if grad.shape != self.shape:
            raise RuntimeError(f"gradient of shape {grad.shape} for {self.describe()}")
        total = grad.copy() if self.grad is None else self.grad.data + grad
        self.grad = Tensor._wrap(total, VersionCounter())


def as_array(value: Operand) -> np.ndarray:
    return value.data if isinstance(value, Tensor) else np.asarray(value)


def lift(value: Operand, like: Tensor) -> Tensor:
    """`value` as a Tensor; a Python number takes `like`'s dtype where it fits (as in torch)."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (bool, int, float)):
        dtype = np.result_type(like.dtype, value)
        return Tensor._wrap(np.asarray(value, dtype=dtype), VersionCounter())
    if isinstance(value, (np.ndarray, np.number)):
        return Tensor(value)
    raise TypeError(f"cannot combine a Tensor with {type(value).__name__}")


def apply_function(function: type[Function], *inputs: Tensor, **constants: Any) -> Tensor:
    """Run `function` forward and, when grad mode is on and an input requires grad, record its
    node: the nodes its inputs came from and the tensors its backward reads, with versions."""
    ctx = FunctionNode(
        function.__name__ + "Backward", function.backward, tuple(t.shape for t in inputs)
    )
    data = np.asarray(function.forward(ctx, *(t.data for t in inputs), **constants))
    first = inputs[0]
    shares_buffer = function.is_view and np.may_share_memory(data, first.data)
    out = Tensor._wrap(data, first._version if shares_buffer else VersionCounter())
    if shares_buffer:
        out._base = first if first._base is None else first._base
    if is_grad_enabled() and any(t.requires_grad for t in inputs):
        ctx.next_nodes = tuple(t._grad_node() for t in inputs)
        kept = [inputs[i] for i in function.saved_inputs]
        saved = [SavedTensor(t.data, t._version, t, t._base) for t in kept]
        if function.saves_output:
            saved.append(SavedTensor(data, out._version, out))
        ctx.saved = tuple(saved)
        out.grad_fn = ctx
        out.requires_grad = True
    return out
