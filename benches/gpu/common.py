"""What the GPU benches share: the one timer and copy-bandwidth peer, the smoke timer that stands
in for them on the CPU (so that a smoke run goes through every call the device run makes), the
results writer and the error a bench raises when its kernel path is not the one it claims.

`CudaTimer`: CUDA events around `inner` back-to-back calls queued behind a sleep kernel (the
events time the GPU's work, not Python's launch overhead), after warm-up; the median of `reps`.
`SmokeTimer`: one call, no warm-up; its figures mean nothing and are never recorded.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"
NO_GPU = "no GPU visible (needs an NVIDIA GPU; torch.cuda.is_available() is False)"


@dataclass(frozen=True)
class CudaTimer:
    inner: int = 10
    reps: int = 15
    warmup: int = 3

    def time_ms(self, run: Callable[[], object]) -> float:
        """Median milliseconds of one `run()` on the current CUDA stream."""
        for _ in range(self.warmup):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(4_000_000)  # ~2 ms of cycles: Python queues the calls meanwhile
            start.record()
            for _ in range(self.inner):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / self.inner)
        return statistics.median(times)

    def scaled(self, inner: int, reps: int) -> CudaTimer:
        return CudaTimer(inner, reps, self.warmup)


@dataclass(frozen=True)
class SmokeTimer:
    """The CPU smoke run's timer: runs `run` once; the milliseconds are the host's wall time."""

    def time_ms(self, run: Callable[[], object]) -> float:
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3

    def scaled(self, inner: int, reps: int) -> SmokeTimer:
        return self


Timer = CudaTimer | SmokeTimer


def copy_bandwidth(timer: Timer, device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of `nbytes` (1 GiB: beyond any L2), GB/s counting bytes read and
    written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer.scaled(inner=5, reps=15).time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def write_results(name: str, result: dict, table: str, out: Path | None, record: bool) -> None:
    """`name`.json and `name`.md into `out` and, when `record` (a device run), benches/results/."""
    folders = [out] if out is not None else []
    if record:
        folders.append(RESULTS)
    for folder in dict.fromkeys(folders):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps(result, indent=1))
        (folder / f"{name}.md").write_text(table)


class PathMismatch(RuntimeError):
    """A bench's kernel path is not the one it claims (a fallback, a skipped capture)."""


# The benches' acceptance bound: a row's relative error against the float32 reference. The
# kernels compute in float32 and round their output once (a relative 2^-11 in float16, 2^-8 in
# bfloat16 per element); the bounds leave ten times that. The engine's own start-up bounds are
# aieng.kernels.self_check's; these only decide whether a bench's figures belong to a correct
# kernel.
ROW_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}


class WrongOutput(RuntimeError):
    """A kernel's output is not its reference's."""


def check_rows(got: torch.Tensor, want: torch.Tensor, tolerance: float, label: str) -> float:
    """The largest relative error of one row (the last dimension: an output vector, one token's
    head) of `got` against `want`; WrongOutput naming the row beyond `tolerance`. Row by row,
    one wrong token or head shows where a norm over the whole output would hide it."""
    if got.shape != want.shape:
        raise WrongOutput(f"{label}: output shape {tuple(got.shape)}, want {tuple(want.shape)}")
    got64, want64 = got.double(), want.double()
    errors = (got64 - want64).norm(dim=-1) / want64.norm(dim=-1).clamp_min(1e-30)
    errors = torch.where(torch.isfinite(got64).all(dim=-1), errors, torch.inf)
    worst = float(errors.max())
    if not worst <= tolerance:
        index = tuple(int(i) for i in torch.unravel_index(errors.argmax(), errors.shape))
        raise WrongOutput(
            f"{label}: row {index} has relative error {worst:.2e} > {tolerance:.1e} against "
            "the float32 reference"
        )
    return worst
