"""How many CTAs of a kernel one SM holds at once, from the resources ptxas reported for it
(registers per thread, static shared memory per CTA) and the SM's limits: the arithmetic of
CUDA's occupancy calculator, for planning a grid without a GPU (on one, `KernelModule.
max_active_ctas` asks the driver, which also knows the launch's dynamic shared memory).

Registers are allotted per warp in units of 256 within each of an SM's four partitions (16,384
registers each), shared memory per CTA in units of 128 bytes plus 1 KB the system reserves.
"""

from __future__ import annotations

from dataclasses import dataclass

from aieng.kernels.errors import KernelError
from aieng.kernels.resources import KernelResources

REGISTER_GRANULE = 256  # registers per warp are allotted in multiples of this
PARTITIONS = 4  # an SM's register file is split between its four warp schedulers
SHARED_GRANULE = 128
SHARED_RESERVED = 1024  # bytes of shared memory the system keeps per CTA (sm_80 and newer)


@dataclass(frozen=True)
class SmLimits:
    """One SM of a compute capability (CUDA C++ Programming Guide, "Technical Specifications
    per Compute Capability")."""

    threads: int
    ctas: int
    registers: int
    shared_bytes: int  # the most shared memory its CTAs can use together


SM_LIMITS = {
    80: SmLimits(threads=2048, ctas=32, registers=65536, shared_bytes=167936),  # A100
    86: SmLimits(threads=1536, ctas=16, registers=65536, shared_bytes=102400),
    87: SmLimits(threads=2048, ctas=32, registers=65536, shared_bytes=167936),
    89: SmLimits(threads=1536, ctas=24, registers=65536, shared_bytes=102400),  # L40S, 4090
    90: SmLimits(threads=2048, ctas=32, registers=65536, shared_bytes=233472),  # H100, H200
}


def ctas_per_sm(
    resources: KernelResources, threads: int, arch: int, dynamic_shared: int = 0
) -> int:
    """CTAs of `threads` threads, with these resources, resident on one SM of sm_<arch>: the
    least of what threads, CTA slots, registers and shared memory allow (0: it cannot run)."""
    limits = SM_LIMITS.get(arch)
    if limits is None:
        raise KernelError(f"no SM limits known for sm_{arch} (known: {sorted(SM_LIMITS)})")
    if threads < 1 or resources.registers < 0 or dynamic_shared < 0:
        raise KernelError(f"bad occupancy query: {threads=}, {resources}, {dynamic_shared=}")
    warps = -(-threads // 32)
    per_warp = -(-max(resources.registers, 1) * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    warps_by_registers = PARTITIONS * (limits.registers // PARTITIONS // per_warp)
    shared = resources.shared_bytes + dynamic_shared + SHARED_RESERVED
    shared = -(-shared // SHARED_GRANULE) * SHARED_GRANULE
    return min(
        limits.threads // (warps * 32),
        limits.ctas,
        warps_by_registers // warps,
        limits.shared_bytes // shared,
    )
