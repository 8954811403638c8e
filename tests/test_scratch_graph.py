"""The behaviour of aieng.scratch's graph: the three lessons (gradients accumulate, the walk is
topological, an in-place change to a saved tensor is caught by its version counter), no_grad,
freeing the graph after backward, a graph too deep for recursion, and clear errors for bad
input. Torch is the reference wherever it has the same behaviour."""

import ast
import gc
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from aieng.scratch import (
    MLP,
    SGD,
    Adam,
    Function,
    GraphFreedError,
    InPlaceOnGraphError,
    SavedTensorModifiedError,
    Tensor,
    apply_function,
    cross_entropy,
    is_grad_enabled,
    no_grad,
)
from aieng.scratch.engine import topological_order

X = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])


def leaf(name: str = "x", data: np.ndarray = X) -> Tensor:
    return Tensor(data, requires_grad=True, name=name)


# ------------------------------------------------------------------ lesson 1: accumulation


def test_a_tensor_used_twice_gets_both_gradients():
    x, t = leaf(), torch.tensor(X, requires_grad=True)
    (x * x + x).sum().backward()
    (t * t + t).sum().backward()
    np.testing.assert_allclose(x.grad.data, 2 * X + 1)
    np.testing.assert_allclose(x.grad.data, t.grad.numpy())


def test_gradients_accumulate_across_backward_calls_until_zero_grad():
    x = leaf()
    opt = SGD([x], lr=0.1)
    for _ in range(3):
        (x * 2).sum().backward()
    np.testing.assert_allclose(x.grad.data, np.full(X.shape, 6.0))
    opt.zero_grad()
    assert x.grad is None
    (x * 2).sum().backward()
    np.testing.assert_allclose(x.grad.data, np.full(X.shape, 2.0))


def test_grad_is_a_copy_no_two_leaves_share():
    a, b = leaf("a"), leaf("b")
    (a + b).sum().backward()  # AddBackward hands the same array to both
    a.grad.data[...] = 0
    np.testing.assert_allclose(b.grad.data, np.ones(X.shape))


# ------------------------------------------------------------------ lesson 2: topological order


class CountingIdentity(Function):
    """The identity, counting how often its backward runs and what gradient it got."""

    calls: list[np.ndarray] = []  # noqa: RUF012

    @staticmethod
    def forward(ctx, a):
        return a.copy()

    @staticmethod
    def backward(ctx, grad):
        CountingIdentity.calls.append(grad)
        return (grad,)


def test_a_diamond_runs_each_node_once_with_the_sum_of_its_gradients():
    CountingIdentity.calls = []
    x = leaf()
    y = apply_function(CountingIdentity, x)  # y feeds two paths that meet again in z
    z = (y * 2 + y.exp()).sum()
    z.backward()
    assert len(CountingIdentity.calls) == 1
    np.testing.assert_allclose(CountingIdentity.calls[0], 2 + np.exp(X))
    np.testing.assert_allclose(x.grad.data, 2 + np.exp(X))


def test_a_deep_diamond_lattice_matches_torch():
    """Every level is used by two nodes of the next: 2**20 paths, each node visited once."""
    x, t = leaf(), torch.tensor(X, requires_grad=True)
    a, b = x, t
    for _ in range(20):
        a = (a * 0.5).tanh() + (a * 0.25).exp() * 0.5
        b = (b * 0.5).tanh() + (b * 0.25).exp() * 0.5
    a.sum().backward()
    b.sum().backward()
    np.testing.assert_allclose(x.grad.data, t.grad.numpy(), rtol=1e-12)


def test_the_order_puts_every_node_after_those_that_feed_it():
    x = leaf()
    y = x * 2
    z = (y.exp() + y * 3) * y
    order = topological_order(z.grad_fn)
    position = {node: i for i, node in enumerate(order)}
    assert order[0] is z.grad_fn and len(order) == len(set(order))
    for node in order:
        for child in node.next_nodes:
            if child is not None:
                assert position[child] > position[node]


# ------------------------------------------------------------------ lesson 3: version counters


def test_in_place_ops_bump_the_version_as_torch_does():
    x, t = Tensor(X), torch.tensor(X)
    for ours, theirs in [(x, t), (x.reshape(-1), t.reshape(-1))]:
        ours.add_(1.0)
        theirs.add_(1.0)
        ours.mul_(2.0)
        theirs.mul_(2.0)
        assert x.version == t._version
    ours, theirs = x.detach(), t.detach()  # a detached tensor shares the counter too
    ours.zero_()
    theirs.zero_()
    assert x.version == t._version == 5
    np.testing.assert_array_equal(x.data, t.numpy())


def test_changing_a_saved_input_in_place_fails_backward_naming_it():
    w, x = leaf("w"), Tensor(X, name="x")
    loss = (w * x).sum()  # MulBackward saved x (for w's gradient) at version 0
    x.add_(1.0)
    with pytest.raises(SavedTensorModifiedError, match=r"tensor 'x' of shape \(2, 3\)") as err:
        loss.backward()
    assert "saved by MulBackward, is at version 1; expected version 0" in str(err.value)
    assert w.grad is None  # raised before any gradient was written
    tw, tx = torch.tensor(X, requires_grad=True), torch.tensor(X)
    tloss = (tw * tx).sum()
    tx.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        tloss.backward()


def test_changing_a_saved_output_in_place_fails_backward():
    x = leaf()
    y = x.exp()  # ExpBackward saved its output y
    loss = y.sum()
    with no_grad():
        y.mul_(2.0)
    with pytest.raises(SavedTensorModifiedError, match="the output of ExpBackward"):
        loss.backward()


def test_changing_a_view_changes_the_base_and_is_caught():
    w, x = leaf("w"), Tensor(X, name="x")
    loss = (w * x).sum()
    view = x.reshape(-1)
    view.add_(1.0)  # writes x's buffer
    assert x.version == 1
    with pytest.raises(SavedTensorModifiedError, match="tensor 'x'"):
        loss.backward()


def test_an_optimizer_step_between_forward_and_backward_is_caught():
    rng = np.random.default_rng(0)
    model = MLP((2, 4, 2), rng)
    opt = Adam(model.parameters(), lr=0.01)
    x, target = Tensor(rng.normal(size=(3, 2))), np.array([0, 1, 1])
    cross_entropy(model(x), target).backward()
    loss = cross_entropy(model(x), target)
    opt.step()  # changes the weights loss's graph saved
    with pytest.raises(SavedTensorModifiedError, match=r"a view of tensor 'layers\.1\.weight'"):
        loss.backward()


def test_changing_a_tensor_no_node_saved_is_harmless():
    w, x = leaf("w"), Tensor(X)
    loss = (w + x).sum()  # AddBackward saves nothing
    x.add_(1.0)
    loss.backward()
    np.testing.assert_allclose(w.grad.data, np.ones(X.shape))


def test_in_place_on_a_tensor_that_requires_grad_needs_no_grad():
    w = leaf("w")
    with pytest.raises(InPlaceOnGraphError, match=r"tensor 'w'.*no_grad"):
        w.add_(1.0)
    y = w * 2
    with pytest.raises(InPlaceOnGraphError, match="the output of MulBackward"):
        y.mul_(2.0)
    with no_grad():
        w.add_(1.0)
    np.testing.assert_allclose(w.data, X + 1)
    assert w.version == 1
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        torch.tensor(X, requires_grad=True).add_(1.0)


# ------------------------------------------------------------------ no_grad


def test_no_grad_records_no_graph_and_restores_the_mode():
    x = leaf()
    with no_grad():
        assert not is_grad_enabled()
        y = (x * 2).exp()
        with no_grad():
            pass
        assert not is_grad_enabled()
    assert is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()
    with pytest.raises(KeyError), no_grad():
        raise KeyError("x")
    assert is_grad_enabled()


def test_no_grad_is_a_decorator_and_is_per_thread():
    @no_grad()
    def doubled(t):
        return t * 2

    assert not doubled(leaf()).requires_grad
    seen = []
    with no_grad():
        thread = threading.Thread(target=lambda: seen.append(is_grad_enabled()))
        thread.start()
        thread.join()
    assert seen == [True]


def test_results_of_inputs_that_need_no_grad_record_nothing():
    y = Tensor(X) * Tensor(X)
    assert not y.requires_grad and y.grad_fn is None
    z = leaf() * Tensor(X)
    assert z.requires_grad and z.grad_fn.needs_input_grad == (True, False)


# ------------------------------------------------------------------ freeing the graph


def test_a_second_backward_raises_unless_the_graph_was_retained():
    x = leaf()
    loss = (x.exp() * x).sum()
    loss.backward()
    with pytest.raises(GraphFreedError, match=r"second time.*retain_graph=True"):
        loss.backward()
    with pytest.raises(GraphFreedError):
        (loss * 2).backward()  # the new node is fine, the old ones are freed

    x2, t = leaf(), torch.tensor(X, requires_grad=True)
    loss2, tloss = (x2.exp() * x2).sum(), (t.exp() * t).sum()
    for _ in range(2):
        loss2.backward(retain_graph=True)
        tloss.backward(retain_graph=True)
    np.testing.assert_allclose(x2.grad.data, t.grad.numpy(), rtol=1e-12)
    loss2.backward()
    with pytest.raises(GraphFreedError):
        loss2.backward()


def test_backward_frees_the_saved_arrays():
    x = leaf()
    y = x.exp()
    loss = (y * y).sum()
    saved = weakref.ref(y.data)
    del y
    gc.collect()
    assert saved() is not None  # the graph holds it for backward
    loss.backward()
    gc.collect()
    assert saved() is None
    assert loss.grad_fn.saved is None


def test_a_graph_of_100000_nodes_needs_no_recursion():
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # far below the depth of the graph
    try:
        x = leaf("x", np.array([1.0, 2.0]))
        y = x
        for _ in range(100_000):
            y = y + x
        loss = y.sum()
        assert len(topological_order(loss.grad_fn)) == 100_000 + 2  # adds, sum, accumulator
        loss.backward()
        del y, loss
        gc.collect()
    finally:
        sys.setrecursionlimit(limit)
    np.testing.assert_allclose(x.grad.data, [100_001.0, 100_001.0])


# ------------------------------------------------------------------ bad input


def test_bad_input_raises_typed_errors():
    x = leaf()
    with pytest.raises(RuntimeError, match="one-element"):
        (x * 2).backward()
    with pytest.raises(ValueError, match="grad has shape"):
        (x * 2).backward(np.ones(3))
    with pytest.raises(TypeError, match="floating-point"):
        Tensor([1, 2], requires_grad=True)
    with pytest.raises(TypeError, match="holds real numbers"):
        Tensor({"a": 1})
    with pytest.raises(TypeError, match="holds real numbers"):
        Tensor(["a", "b"])
    with pytest.raises(TypeError, match="cannot combine"):
        x + "1"
    with pytest.raises(TypeError, match="constant number"):
        x ** Tensor(2.0)
    with pytest.raises(ValueError):
        x @ leaf("w")  # (2, 3) @ (2, 3)
    with pytest.raises(ValueError, match="scalars"):
        x @ Tensor(2.0)
    with pytest.raises(ValueError, match="out of range"):
        x.sum(axis=2)
    with pytest.raises(ValueError, match="repeated axis"):
        x.mean(axis=(0, -2))
    with pytest.raises(ValueError, match="permutation"):
        x.permute(0, 0)
    with pytest.raises(ValueError, match="out of range"):
        x.transpose(0, 2)


def test_bad_targets_and_optimizer_arguments_raise_typed_errors():
    logits = leaf()
    with pytest.raises(TypeError, match="class indices"):
        cross_entropy(logits, np.array([0.0, 1.0]))
    with pytest.raises(IndexError, match="target 3 is out of range for 3 classes"):
        cross_entropy(logits, np.array([0, 3]))
    with pytest.raises(IndexError, match="target -1"):
        cross_entropy(logits, np.array([-1, 0]))
    with pytest.raises(ValueError, match="expected 2 targets"):
        cross_entropy(logits, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"\(batch, classes\)"):
        cross_entropy(logits.reshape(-1), np.array([0]))
    with pytest.raises(ValueError, match="no parameters"):
        SGD([], lr=0.1)
    with pytest.raises(ValueError, match="leaf tensors"):
        SGD([logits * 2], lr=0.1)
    with pytest.raises(ValueError, match="learning rate"):
        Adam([logits], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        Adam([logits], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="sizes"):
        MLP((2,), np.random.default_rng(0))


# ------------------------------------------------------------------ self-contained


def test_the_package_imports_only_numpy_the_standard_library_and_itself():
    package = Path(__file__).resolve().parent.parent / "python" / "aieng" / "scratch"
    outside = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if not (
                    name == "aieng.scratch"
                    or name.startswith("aieng.scratch.")
                    or top == "numpy"
                    or top in sys.stdlib_module_names
                    or top == "__future__"
                ):
                    outside.add((path.name, name))
    assert outside == set()
