"""The start-up check every selected kernel passes before it is used: run it on random inputs,
compare with its pure-PyTorch reference, and turn it off with a warning naming it when it cannot
run (compile, load or launch failure) or when it disagrees.

The CUDA kernels are held to a per-row bound (`RowBound`): a row is one output vector — a
token's hidden state, one (token, head) of attention, one cache slot's head — and each of its
elements must lie within

    relative * |want| + of_row * max|want row|

of the reference: `relative` for the output's own rounding to its dtype, `of_row` for what the
kernel rounds inside (a product held in bfloat16, a dequantized weight). A wrong element, a
dropped token or a swapped dimension moves one row by far more than that, where a norm over the
whole output would average it away (tests/test_check_fault_injection.py proves each). The CPU
kernels, whose activations are quantized to int8 on the fly, keep a relative norm tolerance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# The least `of_row` of a float32 output: sums of thousands of float32 products (and the INT4
# GEMV's 16 * sum((1 + q/16) x) - (16 + z) * sum(x), which cancels) round at ~1e-5 of the row.
FLOAT32_FLOOR = 2.0**-14

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class RowBound:
    """|got - want| <= relative * |want| + of_row * max|want row|, element by element."""

    relative: float
    of_row: float

    @classmethod
    def rounding(cls, dtype: torch.dtype, output: float = 1.0, inner: float = 0.0) -> RowBound:
        """`output` roundings of each element to `dtype`, and `inner` roundings' worth of the
        row's scale for what the kernel holds in `dtype` on the way (both in units of the
        dtype's machine epsilon); never below FLOAT32_FLOOR of the row."""
        eps = torch.finfo(dtype).eps
        return cls(output * eps, max(inner * eps, FLOAT32_FLOOR))


def row_excess(got: torch.Tensor, want: torch.Tensor, bound: RowBound) -> torch.Tensor:
    """Per row (every index but the last), the largest |got - want| over what `bound` allows
    there, in float64: <= 1 passes; inf for a NaN, an Inf or a different shape."""
    if got.shape != want.shape:
        return torch.full((1,), float("inf"), dtype=torch.float64)
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    if got64.dim() == 0:
        got64, want64 = got64.view(1), want64.view(1)
    magnitude = want64.abs()
    allowed = bound.relative * magnitude + bound.of_row * magnitude.amax(-1, keepdim=True)
    error = (got64 - want64).abs()
    ratio = torch.where(error == 0, torch.zeros_like(error), error / allowed.clamp_min(1e-300))
    ratio = torch.where(torch.isfinite(got64), ratio, torch.full_like(ratio, float("inf")))
    return ratio.amax(-1).flatten()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (NaN or Inf in `got` gives inf)."""
    got64, want64 = got.double(), want.double()
    if got64.shape != want64.shape:
        return float("inf")
    if not bool(torch.isfinite(got64).all()):
        return float("inf")
    return float((got64 - want64).norm() / want64.norm().clamp_min(1e-300))


Bound = float | RowBound | Sequence[RowBound]


def disagreement(got: Outputs, want: Outputs, bound: Bound) -> str | None:
    """Why `got` is not `want` within `bound` (a float: a relative norm tolerance; a RowBound:
    per row, of every output; one RowBound per output), or None when it is."""
    gots = got if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    if len(gots) != len(wants):
        return f"{len(gots)} outputs, the reference has {len(wants)}"
    if isinstance(bound, float | int):
        error = max(relative_error(g, w) for g, w in zip(gots, wants, strict=True))
        if error <= bound:
            return None
        return f"relative error {error:.2e} > {bound:.1e}"
    bounds = (bound,) * len(gots) if isinstance(bound, RowBound) else tuple(bound)
    if len(bounds) != len(gots):
        raise ValueError(f"{len(bounds)} bounds for {len(gots)} outputs")
    for index, (g, w, b) in enumerate(zip(gots, wants, bounds, strict=True)):
        excess = row_excess(g, w, b)
        worst = int(excess.argmax())
        if not float(excess[worst]) <= 1.0:
            which = f"output {index} " if len(gots) > 1 else ""
            shape = f"shape {tuple(g.shape)} vs {tuple(w.shape)}" if g.shape != w.shape else ""
            return shape or (
                f"{which}row {worst} is {float(excess[worst]):.3g} times its bound "
                f"({b.relative:.1e} of each element + {b.of_row:.1e} of the row's largest)"
            )
    return None


def passes_check(
    name: str,
    run: Callable[[], Outputs],
    reference: Callable[[], Outputs],
    bound: Bound,
    where: str = "",
) -> bool:
    """True when `run()` (the kernel) matches `reference()` within `bound` (see
    `disagreement`); otherwise logs a warning naming the kernel (and `where`, e.g. the layer)
    and returns False. Any exception from the kernel (an NVRTC error, a failed launch) counts
    as a failure."""
    prefix = f"{where}: " if where else ""
    try:
        got = run()
    except Exception as error:  # whatever stops a kernel turns it off
        logger.warning("%skernel %s cannot run (%s); it is turned off", prefix, name, error)
        return False
    why = disagreement(got, reference(), bound)
    if why is not None:
        logger.warning(
            "%skernel %s differs from its reference (%s); it is turned off", prefix, name, why
        )
        return False
    return True
