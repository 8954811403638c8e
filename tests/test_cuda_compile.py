"""CI checks of the CUDA kernels without a GPU: every `cuda/*.cu` compiles with NVRTC for sm_80
and sm_90, no kernel spills to local memory or exceeds its register budget (ptxas's report),
and the compile cache and launch-argument logic behave. NVRTC is one of aieng's dependencies
on Linux: if it cannot be imported these tests fail, they do not skip."""

from __future__ import annotations

import ctypes
import fnmatch
from pathlib import Path

import pytest
import torch

try:
    from cuda.bindings import nvrtc  # noqa: F401
except ImportError as error:  # pragma: no cover - a broken install
    pytest.fail(
        f"NVRTC (cuda.bindings.nvrtc) is not importable ({error}); install aieng's dependencies "
        "(cuda-bindings, nvidia-cuda-nvrtc): the CUDA kernels cannot be checked without it",
        pytrace=False,
    )

from aieng.kernels import (
    KernelCompileError,
    KernelError,
    compile_kernel_source,
    cuda_source_dir,
    parse_ptxas_report,
)
from aieng.kernels import compiler as compiler_module
from aieng.kernels.launch import dim3, pack_args

ARCHS = (80, 90)

# Register budget per kernel (fnmatch pattern on its extern "C" name): a kernel over its budget,
# or one that matches no pattern, fails. Adding a kernel is one line here.
REGISTER_BUDGETS: dict[str, int] = {
    "int4_gemv_*": 168,  # M_TILE 16: 16 rows of float32 accumulators and dot products
    "int4_gemm_*": 128,
    "paged_decode_*_g[12]": 96,  # acc: 8 floats per query head of the CTA
    "paged_decode_*_g4": 128,
    "paged_decode_*_g8": 160,
    "paged_decode_reduce_*": 40,
    "paged_prefill_*_d64": 128,  # O: D / 2 floats, Q fragments: D / 4 registers
    "paged_prefill_*_d128": 192,
}

SOURCES = sorted(path.name for path in cuda_source_dir().glob("*.cu"))


def test_the_kernel_sources_are_found() -> None:
    assert {"paged_attention_decode.cu", "paged_attention_prefill.cu"} <= set(SOURCES)


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AIENG_CACHE_DIR", str(tmp_path))
    return tmp_path / "kernels"


def budget_of(kernel: str) -> int | None:
    for pattern, budget in REGISTER_BUDGETS.items():
        if fnmatch.fnmatchcase(kernel, pattern):
            return budget
    return None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_compiles_without_spills_within_budget(source: str, arch: int) -> None:
    module = compile_kernel_source(source, arch, use_cache=False)
    assert module.cubin and module.resources, module.log
    for name, resources in module.resources.items():
        assert not resources.spills, f"{name} spills on sm_{arch}: {resources}"
        assert resources.stack_bytes == 0, f"{name} uses a local stack on sm_{arch}: {resources}"
    kernels = [name for name in module.resources if f"'{name}'" in module.log]
    for name in kernels:
        budget = budget_of(name)
        assert budget is not None, f"{name} has no register budget in REGISTER_BUDGETS"
        registers = module.resources[name].registers
        assert registers <= budget, f"{name}: {registers} registers on sm_{arch} > {budget}"


def test_every_budget_names_a_shipped_kernel() -> None:
    names = [n for s in SOURCES for n in compile_kernel_source(s, 90).resources]
    for pattern in REGISTER_BUDGETS:
        assert fnmatch.filter(names, pattern), f"budget {pattern!r} matches no kernel"


PROBE = """
#include "probe.cuh"
extern "C" __global__ void __launch_bounds__(64) probe(float* out, int n) {
  if (threadIdx.x < n) out[threadIdx.x] = SCALE * threadIdx.x;
}
"""


def write_probe(folder: Path, scale: str = "2.0f") -> Path:
    (folder / "probe.cuh").write_text(f"#define SCALE {scale}\n")
    path = folder / "probe.cu"
    path.write_text(PROBE)
    return path


def test_compile_is_cached_by_source_headers_arch_and_options(
    tmp_path: Path, kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_probe(tmp_path)
    first = compile_kernel_source(path, 90)
    assert first.resources["probe"].registers > 0
    assert len(list(kernel_cache.glob("probe-sm90-*.cubin"))) == 1

    def no_compile(*args: object) -> None:
        raise AssertionError("compiled again instead of reading the cache")

    with monkeypatch.context() as patch:
        patch.setattr(compiler_module, "_nvrtc_compile", no_compile)
        again = compile_kernel_source(path, 90)
    assert again.cubin == first.cubin and again.resources == first.resources
    assert again.key == first.key

    keys = {first.key}
    keys.add(compile_kernel_source(path, 80).key)
    keys.add(compile_kernel_source(path, 90, ["-DEXTRA=1"]).key)
    write_probe(tmp_path, scale="3.0f")  # only the header changes
    keys.add(compile_kernel_source(path, 90).key)
    assert len(keys) == 4
    assert len(list(kernel_cache.glob("probe-*.cubin"))) == 4


def test_corrupt_cache_entry_is_recompiled(tmp_path: Path, kernel_cache: Path) -> None:
    path = write_probe(tmp_path)
    first = compile_kernel_source(path, 90)
    (cubin,) = kernel_cache.glob("probe-sm90-*.cubin")
    cubin.write_bytes(b"truncated")
    assert compile_kernel_source(path, 90).cubin == first.cubin


def test_compile_error_carries_the_log(tmp_path: Path) -> None:
    path = tmp_path / "broken.cu"
    path.write_text('extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(KernelCompileError, match="undefined_name") as raised:
        compile_kernel_source(path, 90)
    assert raised.value.arch == 90 and "broken.cu" in raised.value.log


def test_missing_header_and_old_arch_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "lonely.cu"
    path.write_text('#include "absent.cuh"\n')
    with pytest.raises(KernelError, match=r"absent\.cuh"):
        compile_kernel_source(path, 90)
    with pytest.raises(KernelError, match="sm_80 or newer"):
        compile_kernel_source(write_probe(tmp_path), 75)


def test_ptxas_report_parsing() -> None:
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'decode' for 'sm_90'
ptxas info    : Function properties for decode
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 4352 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'reduce' for 'sm_90'
ptxas info    : Function properties for reduce
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 20 registers, used 0 barriers, 376 bytes cmem[0]
"""
    report = parse_ptxas_report(log)
    decode, reduce = report["decode"], report["reduce"]
    assert (decode.registers, decode.shared_bytes, decode.stack_bytes) == (96, 4352, 16)
    assert (decode.spill_stores, decode.spill_loads, decode.spills) == (8, 12, True)
    assert (reduce.registers, reduce.shared_bytes, reduce.spills) == (20, 0, False)


def test_launch_arguments_pack_to_c_types() -> None:
    tensor = torch.zeros(4)
    values, types = pack_args([tensor, None, 7, 0.5, ctypes.c_int64(2**40)])
    assert values == (tensor.data_ptr(), 0, 7, 0.5, 2**40)
    assert types == (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64)
    with pytest.raises(KernelError, match="overflows int"):
        pack_args([2**31])
    with pytest.raises(KernelError, match="bool"):
        pack_args([True])
    with pytest.raises(KernelError, match="unsupported type"):
        pack_args(["x"])


def test_launch_dimensions_are_checked() -> None:
    assert dim3(5, "grid") == (5, 1, 1)
    assert dim3((2, 3), "grid") == (2, 3, 1)
    assert dim3((32, 4), "block") == (32, 4, 1)
    with pytest.raises(KernelError, match="1024 threads"):
        dim3((64, 32), "block")
    with pytest.raises(KernelError, match="limits"):
        dim3((1, 70000), "grid")
    with pytest.raises(KernelError, match="non-negative"):
        dim3((-1,), "grid")
