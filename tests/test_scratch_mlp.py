"""The two-layer network trained twice from the same initial weights on the same mini-batches of
a spiral set generated here — once by aieng.scratch, once by torch — in float64: the losses
agree to 1e-9 at every step, the trained weights agree, and the final accuracy is reported."""

import numpy as np
import pytest
import torch

from aieng.scratch import MLP, SGD, Adam, Tensor, cross_entropy, no_grad, spirals

BATCH = 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A network this small gains nothing from threads, and on a busy machine torch's thread
    pool's hand-offs cost more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batches(n: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Row indices of `steps` mini-batches: shuffled epochs, cut into batches."""
    order = np.concatenate([rng.permutation(n) for _ in range(steps * BATCH // n + 1)])
    return [order[i * BATCH : (i + 1) * BATCH] for i in range(steps)]


def torch_copy(model: MLP, activation: str) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for layer in model.layers:
        linear = torch.nn.Linear(*reversed(layer.weight.shape), dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(layer.weight.data))
            linear.bias.copy_(torch.from_numpy(layer.bias.data))
        layers += [linear, torch.nn.Tanh() if activation == "tanh" else torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(axis=1) == labels).mean())


@pytest.mark.parametrize(
    ("activation", "optimizer", "options", "steps"),
    [
        ("tanh", "Adam", {"lr": 0.02}, 400),
        ("relu", "SGD", {"lr": 0.1, "momentum": 0.9}, 200),
    ],
)
def test_scratch_and_torch_train_the_same_mlp_to_the_same_losses(
    activation, optimizer, options, steps, record_property
):
    rng = np.random.default_rng(0)
    points, labels = spirals(per_class=100, classes=2, rng=rng)
    model = MLP((2, 64, 2), rng, activation=activation)
    reference = torch_copy(model, activation)
    opt = {"Adam": Adam, "SGD": SGD}[optimizer](model.parameters(), **options)
    topt = getattr(torch.optim, optimizer)(reference.parameters(), **options)
    tpoints, tlabels = torch.from_numpy(points), torch.from_numpy(labels)

    losses = []
    for rows in batches(len(points), steps, rng):
        opt.zero_grad()
        loss = cross_entropy(model(Tensor(points[rows])), labels[rows])
        loss.backward()
        opt.step()

        topt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(reference(tpoints[rows]), tlabels[rows])
        tloss.backward()
        topt.step()

        assert abs(loss.item() - tloss.item()) <= 1e-9, (len(losses), loss.item(), tloss.item())
        losses.append(loss.item())

    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(ours.data, theirs.detach().numpy(), rtol=1e-9, atol=1e-9)
    with no_grad():
        ours_acc = accuracy(model(Tensor(points)).data, labels)
    with torch.no_grad():
        theirs_acc = accuracy(reference(tpoints).numpy(), labels)
    record_property("final_accuracy", ours_acc)
    print(f"\n{activation}/{optimizer}: final loss {losses[-1]:.4f}, accuracy {ours_acc:.3f}")
    assert ours_acc == theirs_acc
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20])  # it learnt
    assert ours_acc >= 0.9
