"""aieng.scratch's SGD and Adam follow torch.optim step for step: the same parameters from the
same start on the same objective, in float64, after every step."""

import numpy as np
import pytest
import torch

from aieng.scratch import SGD, Adam, Tensor

STEPS = 25
rng = np.random.default_rng(0)
A, B = rng.normal(size=(5, 3)), rng.normal(size=5)
W0, V0 = rng.normal(size=(3,)), rng.normal(size=(2, 3))


def objective(w, v, const, tanh):
    """A least-squares term and a non-convex one; `const` and `tanh` are the library's."""
    residual = const(A) @ w - const(B)
    return (residual * residual).sum() + tanh(v @ w).sum() * 0.5 + (v * v).mean()


CONFIGS = [
    (SGD, torch.optim.SGD, {"lr": 0.05}),
    (SGD, torch.optim.SGD, {"lr": 0.03, "momentum": 0.9}),
    (SGD, torch.optim.SGD, {"lr": 0.03, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1}),
    (SGD, torch.optim.SGD, {"lr": 0.02, "momentum": 0.9, "nesterov": True}),
    (Adam, torch.optim.Adam, {"lr": 0.1}),
    (Adam, torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
]


@pytest.mark.parametrize(("ours", "theirs", "options"), CONFIGS)
def test_the_optimizer_follows_torch_step_for_step(ours, theirs, options):
    w, v = Tensor(W0, requires_grad=True), Tensor(V0, requires_grad=True)
    tw, tv = torch.tensor(W0, requires_grad=True), torch.tensor(V0, requires_grad=True)
    opt, topt = ours([w, v], **options), theirs([tw, tv], **options)
    for _ in range(STEPS):
        opt.zero_grad()
        topt.zero_grad()
        objective(w, v, Tensor, Tensor.tanh).backward()
        objective(tw, tv, torch.tensor, torch.tanh).backward()
        opt.step()
        topt.step()
        np.testing.assert_allclose(w.data, tw.detach().numpy(), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(v.data, tv.detach().numpy(), rtol=1e-12, atol=1e-13)
    assert w.version == tw._version == STEPS  # one in-place update per step


def test_a_parameter_without_a_gradient_is_left_alone():
    w, unused = Tensor(W0, requires_grad=True), Tensor(V0, requires_grad=True)
    opt = Adam([w, unused], lr=0.1)
    (w * w).sum().backward()
    opt.step()
    np.testing.assert_array_equal(unused.data, V0)
    assert unused.version == 0 and w.version == 1
