"""Shape bookkeeping for gradients: undoing broadcasting and reductions."""

import numpy as np


def unbroadcast(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum `grad` over the axes broadcasting added or stretched, back to `shape`."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad


def normalize_axes(axis: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    """The reduced axes as sorted non-negative indices; None means every axis."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        if not isinstance(a, int) or isinstance(a, bool):
            raise TypeError(f"an axis must be an int, got {a!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a tensor of {ndim} dimensions")
    normalized = tuple(sorted(a % ndim for a in axes))
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"repeated axis in {axis!r}")
    return normalized


def expand_reduced(
    grad: np.ndarray, axes: tuple[int, ...], keepdims: bool, shape: tuple[int, ...]
) -> np.ndarray:
    """Spread the gradient of a reduction over `axes` back over the input's `shape`."""
    if not keepdims:
        grad = np.expand_dims(grad, axes)
    return np.broadcast_to(grad, shape)
