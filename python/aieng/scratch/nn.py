"""A fully connected network: Linear layers (torch's layout and initialization) with an
activation between them."""

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from aieng.scratch.tensor import Tensor


class Linear:
    """y = x @ weight.T + bias; weight (out, in), both drawn from U(-1/sqrt(in), 1/sqrt(in))."""

    def __init__(
        self, in_features: int, out_features: int, rng: np.random.Generator, name: str = "linear"
    ) -> None:
        bound = 1 / np.sqrt(in_features)
        self.weight = Tensor(
            rng.uniform(-bound, bound, (out_features, in_features)),
            requires_grad=True,
            name=f"{name}.weight",
        )
        self.bias = Tensor(
            rng.uniform(-bound, bound, out_features), requires_grad=True, name=f"{name}.bias"
        )

    def __call__(self, x: Tensor) -> Tensor:
        return x @ self.weight.T + self.bias  # (N, in) @ (in, out) + (out,)

    def parameters(self) -> list[Tensor]:
        return [self.weight, self.bias]


class MLP:
    """Linear layers of the given sizes (e.g. (2, 64, 2)), `activation` between them."""

    ACTIVATIONS = ("tanh", "relu")

    def __init__(
        self, sizes: Sequence[int], rng: np.random.Generator, activation: str = "tanh"
    ) -> None:
        if len(sizes) < 2 or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"sizes must be two or more positive ints, got {sizes!r}")
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"activation must be one of {self.ACTIVATIONS}, not {activation!r}")
        self.activation = activation
        self.layers = [
            Linear(n_in, n_out, rng, name=f"layers.{i}")
            for i, (n_in, n_out) in enumerate(pairwise(sizes))
        ]

    def __call__(self, x: Tensor) -> Tensor:
        *hidden, last = self.layers
        for layer in hidden:
            x = getattr(layer(x), self.activation)()
        return last(x)

    def parameters(self) -> list[Tensor]:
        return [p for layer in self.layers for p in layer.parameters()]
