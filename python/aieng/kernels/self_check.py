"""The start-up check every selected kernel passes before it is used: run it once on small
random inputs, compare with its pure-PyTorch reference, and turn it off with a warning naming it
when it cannot run (compile, load or launch failure) or when it disagrees."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (NaN or Inf in `got` gives inf)."""
    got64, want64 = got.double(), want.double()
    if got64.shape != want64.shape:
        return float("inf")
    if not bool(torch.isfinite(got64).all()):
        return float("inf")
    return float((got64 - want64).norm() / want64.norm().clamp_min(1e-300))


def passes_check(
    name: str,
    run: Callable[[], torch.Tensor],
    reference: Callable[[], torch.Tensor],
    tolerance: float,
    where: str = "",
) -> bool:
    """True when `run()` (the kernel) matches `reference()` within `tolerance` relative error;
    otherwise logs a warning naming the kernel (and `where`, e.g. the layer) and returns False.
    Any exception from the kernel (an NVRTC error, a failed launch) counts as a failure."""
    prefix = f"{where}: " if where else ""
    try:
        got = run()
    except Exception as error:  # whatever stops a kernel turns it off
        logger.warning("%skernel %s cannot run (%s); it is turned off", prefix, name, error)
        return False
    error = relative_error(got, reference())
    if not error <= tolerance:
        logger.warning(
            "%skernel %s differs from its reference (relative error %.2e > %.1e); it is turned off",
            prefix,
            name,
            error,
            tolerance,
        )
        return False
    return True
