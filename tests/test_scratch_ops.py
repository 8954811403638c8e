"""Every operator of aieng.scratch against torch's autograd, in float64: the forward value and the
gradient of each input for a random upstream gradient, over shapes drawn by hypothesis
(broadcasting in both directions included); and a few gradients against central finite
differences, which hold without torch."""

import operator
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aieng.scratch import MLP, Tensor, cross_entropy, nll_loss

RTOL, ATOL = 1e-10, 1e-12
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False, allow_subnormal=False)


def arrays(shape: tuple[int, ...], low: float = -3.0, high: float = 3.0) -> st.SearchStrategy:
    return hnp.arrays(np.float64, shape, elements=floats(low, high))


shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4)
nonscalar_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)
broadcast_pairs = hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4)
seeds = st.integers(0, 2**32 - 1)


def assert_matches_torch(
    scratch_fn: Callable[..., Tensor],
    torch_fn: Callable[..., torch.Tensor],
    inputs: list[np.ndarray],
    seed: int,
) -> None:
    """Same value, and the same gradient for every input given the same upstream gradient."""
    ours = [Tensor(a, requires_grad=True) for a in inputs]
    theirs = [torch.tensor(a, requires_grad=True) for a in inputs]
    out, ref = scratch_fn(*ours), torch_fn(*theirs)
    np.testing.assert_allclose(out.data, ref.detach().numpy(), rtol=RTOL, atol=ATOL)
    upstream = np.random.default_rng(seed).normal(size=ref.shape)
    out.backward(upstream)
    ref.backward(torch.tensor(upstream))
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.grad is not None and mine.grad.shape == mine.shape
        np.testing.assert_allclose(mine.grad.data, reference.grad.numpy(), rtol=RTOL, atol=ATOL)


BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}


@pytest.mark.parametrize("op", sorted(BINARY))
@PROPERTY
@given(data=st.data(), pair=broadcast_pairs, seed=seeds)
def test_binary_ops_with_broadcasting_match_torch(op, data, pair, seed):
    a_shape, b_shape = pair.input_shapes
    a = data.draw(arrays(a_shape))
    b = data.draw(arrays(b_shape, 0.5, 3.0)) if op == "div" else data.draw(arrays(b_shape))
    assert_matches_torch(BINARY[op], BINARY[op], [a, b], seed)


@pytest.mark.parametrize("op", sorted(BINARY))
@PROPERTY
@given(data=st.data(), shape=shapes, c=floats(0.5, 3.0), seed=seeds)
def test_python_numbers_on_either_side_match_torch(op, data, shape, c, seed):
    a = data.draw(arrays(shape, 0.5, 3.0))
    fn = BINARY[op]
    assert_matches_torch(lambda x: fn(x, c), lambda x: fn(x, c), [a], seed)
    assert_matches_torch(lambda x: fn(c, x), lambda x: fn(c, x), [a], seed)


UNARY = {
    "neg": (lambda x: -x, torch.neg, (-3.0, 3.0)),
    "exp": (Tensor.exp, torch.exp, (-3.0, 3.0)),
    "log": (Tensor.log, torch.log, (0.1, 5.0)),
    "tanh": (Tensor.tanh, torch.tanh, (-3.0, 3.0)),
    "relu": (Tensor.relu, torch.relu, (-3.0, 3.0)),
}


@pytest.mark.parametrize("op", sorted(UNARY))
@PROPERTY
@given(data=st.data(), shape=shapes, seed=seeds)
def test_unary_ops_match_torch(op, data, shape, seed):
    ours, theirs, (low, high) = UNARY[op]
    assert_matches_torch(ours, theirs, [data.draw(arrays(shape, low, high))], seed)


@PROPERTY
@given(
    data=st.data(),
    shape=shapes,
    exponent=st.sampled_from([0, 1, 2, 3, 0.5, -1, -1.5, 2.7]),
    seed=seeds,
)
def test_pow_by_a_constant_matches_torch(data, shape, exponent, seed):
    integral = float(exponent).is_integer() and exponent >= 0
    a = data.draw(arrays(shape, -3.0, 3.0) if integral else arrays(shape, 0.2, 3.0))
    assert_matches_torch(lambda x: x**exponent, lambda x: x**exponent, [a], seed)


@st.composite
def matmul_shapes(draw):
    """Operand shapes for matmul: 1-D, 2-D, or with broadcasting batch axes, in every pairing."""
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    batch = draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=3))
    kind_a, kind_b = (
        draw(st.sampled_from(["1d", "2d", "nd"])),
        draw(st.sampled_from(["1d", "2d", "nd"])),
    )
    a = {"1d": (k,), "2d": (m, k), "nd": (*batch.input_shapes[0], m, k)}[kind_a]
    b = {"1d": (k,), "2d": (k, n), "nd": (*batch.input_shapes[1], k, n)}[kind_b]
    return a, b


@PROPERTY
@given(data=st.data(), pair=matmul_shapes(), seed=seeds)
def test_matmul_matches_torch(data, pair, seed):
    a, b = (data.draw(arrays(shape)) for shape in pair)
    assert_matches_torch(lambda x, y: x @ y, torch.matmul, [a, b], seed)


@st.composite
def reductions(draw):
    shape = draw(shapes)
    axis = draw(
        st.none()
        | (st.integers(-len(shape), len(shape) - 1) if shape else st.nothing())
        | (hnp.valid_tuple_axes(len(shape), min_size=1) if shape else st.nothing())
    )
    return shape, axis, draw(st.booleans())


@pytest.mark.parametrize("op", ["sum", "mean"])
@PROPERTY
@given(data=st.data(), reduction=reductions(), seed=seeds)
def test_sum_and_mean_over_axes_match_torch(op, data, reduction, seed):
    shape, axis, keepdims = reduction
    a = data.draw(arrays(shape))

    def theirs(x):
        if axis is None:  # torch reduces everything only without a dim, and then drops them all
            full = getattr(torch, op)(x)
            return full.reshape((1,) * x.ndim) if keepdims else full
        return getattr(torch, op)(x, dim=axis, keepdim=keepdims)

    assert_matches_torch(lambda x: getattr(x, op)(axis=axis, keepdims=keepdims), theirs, [a], seed)


@st.composite
def reshapes(draw):
    shape = draw(shapes)
    size = int(np.prod(shape))
    target = draw(
        st.sampled_from([(size,), (-1,), tuple(reversed(shape)), (1, size), (size, 1, 1)])
    )
    return shape, target


@PROPERTY
@given(data=st.data(), case=reshapes(), seed=seeds)
def test_reshape_matches_torch(data, case, seed):
    shape, target = case
    a = data.draw(arrays(shape))
    assert_matches_torch(lambda x: x.reshape(target), lambda x: x.reshape(target), [a], seed)


@PROPERTY
@given(data=st.data(), shape=nonscalar_shapes, seed=seeds)
def test_permute_transpose_and_T_match_torch(data, shape, seed):
    a = data.draw(arrays(shape))
    axes = data.draw(st.permutations(range(len(shape))))
    d0, d1 = data.draw(st.integers(0, len(shape) - 1)), data.draw(st.integers(-len(shape), -1))
    assert_matches_torch(lambda x: x.permute(*axes), lambda x: x.permute(*axes), [a], seed)
    assert_matches_torch(lambda x: x.transpose(d0, d1), lambda x: x.transpose(d0, d1), [a], seed)
    if len(shape) == 2:
        assert_matches_torch(lambda x: x.T, lambda x: x.T, [a], seed)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@PROPERTY
@given(data=st.data(), shape=nonscalar_shapes, seed=seeds)
def test_softmax_and_log_softmax_along_an_axis_match_torch(op, data, shape, seed):
    a = data.draw(arrays(shape, -10.0, 10.0))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    ours = lambda x: getattr(x, op)(axis=axis)  # noqa: E731
    theirs = lambda x: getattr(torch, op)(x, dim=axis)  # noqa: E731
    assert_matches_torch(ours, theirs, [a], seed)


@st.composite
def classification_batches(draw):
    n, classes = draw(st.integers(1, 6)), draw(st.integers(2, 5))
    logits = draw(arrays((n, classes), -8.0, 8.0))
    target = np.array(draw(st.lists(st.integers(0, classes - 1), min_size=n, max_size=n)))
    return logits, target


@PROPERTY
@given(batch=classification_batches(), seed=seeds)
def test_cross_entropy_and_nll_match_torch(batch, seed):
    logits, target = batch
    t = torch.tensor(target)
    assert_matches_torch(
        lambda x: cross_entropy(x, target),
        lambda x: torch.nn.functional.cross_entropy(x, t),
        [logits],
        seed,
    )
    assert_matches_torch(
        lambda x: nll_loss(x, target), lambda x: torch.nn.functional.nll_loss(x, t), [logits], seed
    )


@PROPERTY
@given(data=st.data(), rows=st.integers(1, 5), seed=seeds)
def test_a_composite_expression_matches_torch(data, rows, seed):
    """A tensor used on several paths, broadcasting, views and reductions in one graph."""
    x, w = data.draw(arrays((rows, 3))), data.draw(arrays((4, 3)))
    b = data.draw(arrays((4,)))

    def ours(x, w, b):
        h = (x @ w.T + b).tanh()  # (rows, 4)
        y = h * (-(h * h)).exp() / (1 + h.mean(axis=1, keepdims=True) ** 2)
        return y.reshape(-1) * x.sum() - x.reshape(-1).mean()

    def theirs(x, w, b):
        h = (x @ w.T + b).tanh()
        y = h * (-(h * h)).exp() / (1 + h.mean(dim=1, keepdim=True) ** 2)
        return y.reshape(-1) * x.sum() - x.reshape(-1).mean()

    assert_matches_torch(ours, theirs, [x, w, b], seed)


# ------------------------------------------------------------------ finite differences


def numerical_grad(f: Callable[[np.ndarray], float], x: np.ndarray, eps: float = 1e-6):
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[index] = eps
        grad[index] = (f(x + step) - f(x - step)) / (2 * eps)
    return grad


def assert_matches_finite_differences(fn: Callable[[Tensor], Tensor], x: np.ndarray) -> None:
    leaf = Tensor(x, requires_grad=True)
    fn(leaf).backward()
    numeric = numerical_grad(lambda v: fn(Tensor(v)).item(), x)
    np.testing.assert_allclose(leaf.grad.data, numeric, rtol=1e-6, atol=1e-8)


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 5))
    target = np.array([0, 2, 1, 4])
    assert_matches_finite_differences(lambda x: ((x @ w) ** 2).sum(), rng.normal(size=(4, 3)))
    assert_matches_finite_differences(
        lambda x: cross_entropy(x.tanh() * 3, target), rng.normal(size=(4, 5))
    )
    assert_matches_finite_differences(
        lambda x: (x.softmax(axis=0) / (x.exp() + 1)).log().mean(), rng.normal(size=(2, 3))
    )
    assert_matches_finite_differences(
        lambda x: (x.reshape(3, 2).T - x.mean(axis=0)).relu().sum(), rng.normal(size=(2, 3))
    )


def test_the_mlp_loss_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    model = MLP((2, 8, 3), rng)
    x, target = rng.normal(size=(5, 2)), np.array([0, 1, 2, 1, 0])
    weight = model.layers[0].weight
    cross_entropy(model(Tensor(x)), target).backward()

    def loss_at(value):
        saved = weight.data.copy()
        weight.data[...] = value
        try:
            return cross_entropy(model(Tensor(x)), target).item()
        finally:
            weight.data[...] = saved

    numeric = numerical_grad(loss_at, weight.data.copy())
    np.testing.assert_allclose(weight.grad.data, numeric, rtol=1e-6, atol=1e-8)
