"""The recorded graph: a node per operation, the tensors it saved for backward (with the version
each had when saved), and the leaf accumulators that receive the gradients.

A node knows the nodes its inputs came from (`next_nodes`), not the tensors themselves (only
weakly, to name them in an error): the graph keeps alive what backward needs — the saved arrays,
and each leaf through its accumulator — nothing else."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import numpy as np

from aieng.scratch.errors import GraphFreedError, SavedTensorModifiedError


class VersionCounter:
    """Counts the in-place changes to one buffer; a tensor and its views share one counter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class Described(Protocol):
    def describe(self) -> str: ...


class SavedTensor:
    """An array saved for backward, the counter of its buffer and the version it had then, and
    (weakly) the tensor it came from and the one that tensor views, to name them in an error."""

    __slots__ = ("base", "counter", "data", "source", "version")

    def __init__(
        self,
        data: np.ndarray,
        counter: VersionCounter,
        source: Described,
        base: Described | None = None,
    ) -> None:
        self.data = data
        self.counter = counter
        self.version = counter.value
        self.source = weakref.ref(source)
        self.base = None if base is None else weakref.ref(base)

    def label(self) -> str:
        source = self.source()
        if source is not None:
            return source.describe()
        base = None if self.base is None else self.base()
        of_base = f", a view of {base.describe()}" if base is not None else ""
        return f"a tensor of shape {self.data.shape}{of_base}"

    def check(self, node_name: str) -> None:
        if self.counter.value != self.version:
            raise SavedTensorModifiedError(
                f"one of the tensors needed for gradient computation has been modified by an "
                f"in-place operation: {self.label()}, saved by {node_name}, is at version "
                f"{self.counter.value}; expected version {self.version}. Compute it out of "
                f"place, or change a copy of it."
            )


class Node:
    """A vertex of the graph that backward() walks."""

    name: str
    next_nodes: tuple[Node | None, ...] = ()

    def check(self) -> None:
        """Raise now if apply() could not run (freed graph, modified saved tensor)."""

    def apply(self, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        raise NotImplementedError

    def release(self) -> None:
        """Free what only backward needed."""


class GradSink(Protocol):
    def _accumulate_grad(self, grad: np.ndarray) -> None: ...


class AccumulateGrad(Node):
    """The end of every path to a leaf that requires grad: adds the gradient to `leaf.grad`."""

    name = "AccumulateGrad"

    def __init__(self, leaf: GradSink) -> None:
        self.leaf = leaf

    def apply(self, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        self.leaf._accumulate_grad(grad)
        return ()


BackwardRule = Callable[["FunctionNode", np.ndarray], tuple["np.ndarray | None", ...]]


class FunctionNode(Node):
    """The record of one operation (torch's `ctx`): where its inputs came from, their shapes,
    what it saved, and any constants its forward set as attributes (an axis, an exponent)."""

    def __init__(self, name: str, backward: BackwardRule, input_shapes: tuple) -> None:
        self.name = name
        self.backward = backward
        self.input_shapes = input_shapes
        self.saved: tuple[SavedTensor, ...] | None = ()  # None once freed

    @property
    def needs_input_grad(self) -> tuple[bool, ...]:
        return tuple(node is not None for node in self.next_nodes)

    @property
    def saved_arrays(self) -> tuple[np.ndarray, ...]:
        if self.saved is None:
            raise self._freed_error()
        return tuple(saved.data for saved in self.saved)

    def check(self) -> None:
        if self.saved is None:
            raise self._freed_error()
        for saved in self.saved:
            saved.check(self.name)

    def apply(self, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        grads = self.backward(self, grad)
        for index, (g, shape) in enumerate(zip(grads, self.input_shapes, strict=True)):
            if g is not None and g.shape != shape:
                raise RuntimeError(
                    f"{self.name} returned a gradient of shape {g.shape} for input {index} of "
                    f"shape {shape}"
                )
        return grads

    def release(self) -> None:
        self.saved = None

    def _freed_error(self) -> GraphFreedError:
        return GraphFreedError(
            f"trying to backward through {self.name} a second time: the first backward() freed "
            f"the tensors it saved. Pass retain_graph=True to the first backward() to keep them."
        )
