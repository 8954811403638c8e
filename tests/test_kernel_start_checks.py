"""The start-up checks' child process (`aieng.kernels.check_child`), on the CPU: a check that
aborts, segfaults, raises or hangs in the child turns off only its kernel, by name, with a
warning; the checks after it still run (in a new child); the parent then runs only what passed
there, and the child's warnings reach the parent's log. Then the checks against the kernels'
own source built for the host: every INT4 variant the dispatch can choose is launched and
passes, and the attention kernels pass the per-row bounds on split, long and windowed steps."""

from __future__ import annotations

import logging

import pytest
import torch
from start_check_suites import CALLS, broken_suite, suite
from test_cuda_attention_on_host import CASES, run_step
from test_cuda_int4 import quantized_layer_from
from test_cuda_kernels_on_host import COMPILER, HostKernels, host_kernels  # noqa: F401 (fixture)

from aieng.attention.cuda_self_check import RequestSpec, bounds, cuda_attention_checks
from aieng.config.quantization import WeightScheme
from aieng.kernels.check_child import (
    DEFAULT_CHILD_TIMEOUT_S,
    checked_names,
    child_timeout_s,
    screen_in_child,
)
from aieng.kernels.fused import fused_checks
from aieng.kernels.int4 import (
    DTYPE_NAMES,
    GEMM_DTYPES,
    GEMV_TILES,
    Int4Weights,
    kernel_args,
    launch_for,
)
from aieng.kernels.self_check import disagreement
from aieng.layers.linear import Linear
from aieng.quantization.cuda_int4 import (
    CHECK_MAX_M,
    CudaInt4LinearMethod,
    int4_child_checks,
    variant_rows,
)

KINDS = ("pass", "abort", "fail", "segfault", "raise", "pass2", "hang")


def test_faulting_checks_cost_their_kernels_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    CALLS.clear()
    with caplog.at_level(logging.WARNING):
        passed = checked_names(suite, KINDS[:-1], isolate=True, timeout_s=60)
    assert passed == {"kernel_pass", "kernel_pass2"}  # pass2 ran in a third child
    assert CALLS == ["kernel_pass", "kernel_pass2"]  # the parent ran only what passed there
    for kind, why in (("abort", "died of signal SIGABRT"), ("segfault", "died of signal SIGSEGV")):
        assert f"kernel kernel_{kind} {why} during its start-up check" in caplog.text
    assert "kernel kernel_raise: its check raised RuntimeError('injected')" in caplog.text
    record = next(r for r in caplog.records if "differs (child)" in r.getMessage())
    assert record.name == "aieng.kernels.self_check"  # forwarded under the child's logger


def test_screening_names_why_each_kernel_is_off() -> None:
    screening = screen_in_child(suite, KINDS, timeout_s=5)
    assert screening.passed == ["kernel_pass", "kernel_pass2"] and screening.error is None
    assert screening.failed == {
        "kernel_abort": "died of signal SIGABRT during its check",
        "kernel_fail": "failed its check",
        "kernel_segfault": "died of signal SIGSEGV during its check",
        "kernel_raise": "failed its check",
        "kernel_hang": "did not finish within 5 s during its check",
    }


def test_without_isolation_everything_runs_here() -> None:
    CALLS.clear()
    assert checked_names(suite, ("pass", "fail", "pass"), isolate=False) == {"kernel_pass"}
    assert CALLS == ["kernel_pass", "kernel_fail", "kernel_pass"]


def test_a_suite_that_cannot_start_turns_everything_off(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        screening = screen_in_child(broken_suite, (), timeout_s=60, label="test")
    assert screening.passed == [] and "cannot even list the kernels" in (screening.error or "")
    assert "the test start-up checks could not run in a child process" in caplog.text


# --- the checks against the kernels' own source, built for the host (tests/cuda_host/) --------


# Three of the host tests' steps (an INT8 window, a mixed step, two query tiles), and two that
# split more than twice: a 4k context, and a split with a window.
SOME_CASES = ("decode int8 window, group 3", "prefill int8 window, two query tiles", "mixed step")
EXTRA_CASES = {
    "decode 4k, many splits": (2, 1, 64, 16, None, torch.bfloat16, False, (132, 4), [(4095, 1)]),
    "decode split with a window of 1000": (
        4, 4, 64, 32, 1000, torch.float16, False, (132, 4), [(2999, 1), (10, 1)]),
}  # fmt: skip


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or clang++)")
@pytest.mark.parametrize("case", [*SOME_CASES, *EXTRA_CASES])
def test_host_built_attention_kernels_pass_the_start_up_bounds(
    host_kernels: HostKernels,  # noqa: F811 (the fixture)
    case: str,
) -> None:
    """The kernels as built, on the backend's own launches, within the start-up check's per-row
    bounds (a step with prefills: the prefill bound; decodes only: the decode one)."""
    heads, kv_heads, head_dim, block_size, window, dtype, int8, sms, requests = {
        **CASES,
        **EXTRA_CASES,
    }[case]
    specs = [RequestSpec(cached, new) for cached, new in requests]
    got, want, splits = run_step(
        host_kernels, specs, heads, kv_heads, head_dim, block_size, window, dtype, int8, *sms
    )
    if case in EXTRA_CASES:
        assert splits > 2
    kind = "decode" if all(new == 1 for _, new in requests) else "prefill"
    assert disagreement(got, want, bounds(dtype)[kind]) is None


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or clang++)")
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_int4_method_checks_every_variant_of_the_host_built_kernels(
    host_kernels: HostKernels,  # noqa: F811 (the fixture)
    dtype: torch.dtype,
) -> None:
    """The INT4 method's start-up check launches every kernel its dispatch can choose — each
    GEMV row tile, its passes of 16 rows, the GEMM — here the host build of int4_gemv.cu and
    int4_gemm.cu, and they all pass their per-row bound."""
    launched: list[tuple[str, int]] = []

    def host_matmul(x: torch.Tensor, weights, path: str) -> torch.Tensor:
        m, n = x.shape[0], weights.out_features
        launch = launch_for(path, m, weights, x.dtype)
        y = torch.full((m, n), float("nan"), dtype=x.dtype)
        args = kernel_args(x.contiguous(), weights, y)
        host_kernels.launch(launch.kernel, launch.grid, launch.block, args)
        launched.append((launch.kernel, m))
        return y

    method = CudaInt4LinearMethod(
        WeightScheme("compressed-tensors", 4, 64, False), "layer", matmul=host_matmul,
        runs_on=lambda device: True,
    )  # fmt: skip
    layer = Linear(256, 40, dtype=dtype, methods=lambda prefix: method)
    quantized_layer_from(layer, method, 64)
    names = DTYPE_NAMES[dtype]
    gemv = {f"int4_gemv_{names}_m{tile}" for tile in GEMV_TILES[dtype]}
    gemm = {f"int4_gemm_{names}"} if dtype in GEMM_DTYPES else set()
    assert {kernel for kernel, _ in launched} == gemv | gemm
    assert {m for kernel, m in launched if kernel.endswith("_m16")} == {9, CHECK_MAX_M}
    assert method.paths == (("gemv", "gemm") if gemm else ("gemv",))
    assert method.kernel == "cuda_int4"


def test_variant_rows_name_each_dispatched_kernel() -> None:
    weights = Int4Weights(torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(64, 4, 2), 64)
    assert variant_rows("gemv", torch.float16, weights) == {
        "int4_gemv_f16_m8": (1, 8), "int4_gemv_f16_m16": (9, CHECK_MAX_M),
    }  # fmt: skip
    assert variant_rows("gemv", torch.float32, weights) == {
        "int4_gemv_f32_m1": (1,), "int4_gemv_f32_m2": (2,), "int4_gemv_f32_m4": (3, 4),
        "int4_gemv_f32_m8": (5, 8), "int4_gemv_f32_m16": (9, CHECK_MAX_M),
    }  # fmt: skip
    per_row = Int4Weights(weights.qweight, torch.zeros(64, 1, 2), 256)  # one group: _g128
    assert variant_rows("gemv", torch.bfloat16, per_row) == {
        "int4_gemv_bf16_m8_g128": (1, 8), "int4_gemv_bf16_m16_g128": (9, CHECK_MAX_M),
    }  # fmt: skip
    assert variant_rows("gemm", torch.float16, weights) == {"int4_gemm_f16": (1, CHECK_MAX_M)}


def test_the_engines_suites_run_in_a_child(caplog: pytest.LogCaptureFixture) -> None:
    """The fused, INT4 and attention suites, pickled to a child as a CUDA device's would be
    (here on the CPU, where no launch can succeed): each kernel is reported by name from the
    child; the attention backend cannot even be built there, which the screening says."""
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING):
        fused = screen_in_child(fused_checks, (cpu, torch.bfloat16), timeout_s=300)
        int4 = screen_in_child(int4_child_checks, (cpu, torch.float16, 64, 256, 64), 300)
        shape = (8, 2, 128, torch.bfloat16, False, (None,), (16,))
        attention = screen_in_child(cuda_attention_checks, (cpu, *shape), 300)
    assert "KernelError" in (attention.error or "") and attention.passed == []
    assert fused.passed == [] and set(fused.failed) == {
        "add_rms_norm_bf16", "rope_kv_write_bf16", "silu_and_mul_bf16",
    }  # fmt: skip
    assert int4.passed == [] and set(int4.failed) == {
        *(f"int4_gemv_f16_m{tile}" for tile in GEMV_TILES[torch.float16]), "int4_gemm_f16",
    }  # fmt: skip
    for name in (*fused.failed, *int4.failed):
        assert f"kernel {name} cannot run" in caplog.text


def test_the_child_timeout_comes_from_the_environment(monkeypatch) -> None:
    """A device run bounds a hung check by its part's time (benches/gpu/run.sh exports
    AIENG_CHECK_TIMEOUT_S); a bad value is an error, not a silent default."""
    monkeypatch.delenv("AIENG_CHECK_TIMEOUT_S", raising=False)
    assert child_timeout_s() == DEFAULT_CHILD_TIMEOUT_S
    monkeypatch.setenv("AIENG_CHECK_TIMEOUT_S", "45")
    assert child_timeout_s() == 45.0
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv("AIENG_CHECK_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="AIENG_CHECK_TIMEOUT_S"):
            child_timeout_s()
    monkeypatch.setenv("AIENG_CHECK_TIMEOUT_S", "4")  # the default of a screening
    screening = screen_in_child(suite, ("pass", "hang"))
    assert screening.passed == ["kernel_pass"]
    assert screening.failed == {"kernel_hang": "did not finish within 4 s during its check"}
