"""SGD and Adam with torch's update rules (torch.optim's single-tensor paths), so a model trained
here follows torch's step for step. A step changes the parameters in place under no_grad(),
which bumps their version counters: a graph built before the step cannot be backpropagated
after it."""

from collections.abc import Iterable

import numpy as np

from aieng.scratch.grad_mode import no_grad
from aieng.scratch.tensor import Tensor


class Optimizer:
    def __init__(self, params: Iterable[Tensor], lr: float) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("the optimizer got no parameters")
        for p in self.params:
            if not isinstance(p, Tensor) or not p.requires_grad or not p.is_leaf:
                raise ValueError(f"parameters must be leaf tensors that require grad, not {p!r}")
        if not lr >= 0:
            raise ValueError(f"the learning rate must be >= 0, got {lr}")
        self.lr = lr

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        with no_grad():
            for index, p in enumerate(self.params):
                if p.grad is not None:
                    self._update(index, p, p.grad.data)

    def _update(self, index: int, param: Tensor, grad: np.ndarray) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        super().__init__(params, lr)
        if momentum < 0 or weight_decay < 0:
            raise ValueError("momentum and weight_decay must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and no dampening")
        self.momentum, self.dampening = momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self.buffers: list[np.ndarray | None] = [None] * len(self.params)

    def _update(self, index: int, param: Tensor, grad: np.ndarray) -> None:
        if self.weight_decay:
            grad = grad + self.weight_decay * param.data
        if self.momentum:
            buffer = self.buffers[index]
            if buffer is None:
                buffer = grad.copy()
            else:
                buffer = self.momentum * buffer + (1 - self.dampening) * grad
            self.buffers[index] = buffer
            grad = grad + self.momentum * buffer if self.nesterov else buffer
        param.add_(grad, alpha=-self.lr)


class Adam(Optimizer):
    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr)
        if not all(0 <= b < 1 for b in betas) or eps < 0 or weight_decay < 0:
            raise ValueError(f"need 0 <= betas < 1, eps >= 0, weight_decay >= 0; got {betas}")
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.steps = [0] * len(self.params)
        self.exp_avg = [np.zeros_like(p.data) for p in self.params]
        self.exp_avg_sq = [np.zeros_like(p.data) for p in self.params]

    def _update(self, index: int, param: Tensor, grad: np.ndarray) -> None:
        beta1, beta2 = self.betas
        if self.weight_decay:
            grad = grad + self.weight_decay * param.data
        self.steps[index] += 1
        step = self.steps[index]
        m = self.exp_avg[index]
        m += (1 - beta1) * (grad - m)
        v = self.exp_avg_sq[index]
        v *= beta2
        v += (1 - beta2) * grad * grad
        step_size = self.lr / (1 - beta1**step)
        denom = np.sqrt(v) / np.sqrt(1 - beta2**step) + self.eps
        param.add_(m / denom, alpha=-step_size)
