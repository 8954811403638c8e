"""CI checks of the CUDA kernels without a GPU: every `cuda/*.cu` compiles with NVRTC for sm_80
and sm_90, no kernel spills to local memory or exceeds its register budget (ptxas's report),
and the compile cache and launch-argument logic behave. NVRTC is one of aieng's dependencies
on Linux: if it cannot be imported these tests fail, they do not skip."""

from __future__ import annotations

import ctypes
import fnmatch
import functools
from pathlib import Path

import numpy as np
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
    CompiledModule,
    KernelCompileError,
    KernelError,
    KernelResources,
    compile_kernel_source,
    cuda_source_dir,
    parse_ptxas_report,
)
from aieng.kernels import compiler as compiler_module
from aieng.kernels.launch import check_arguments, dim3, pack_args
from aieng.kernels.occupancy import ctas_per_sm
from aieng.kernels.paged_attention import (
    CACHE_ALIGNMENT,
    DECODE_THREADS,
    HEAD_DIMS,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    PREFILL_BLOCK_M,
    PagedCache,
    SplitPlan,
    attended_lengths,
    block_shift,
    choose_splits,
    decode_kernel_name,
    decode_launches,
    decode_reduce_kernel_name,
    decode_tile,
    heads_per_cta,
    instantiation_options,
    prefill_kernel_name,
    prefill_launch,
    prefill_tiles,
    q_is_aligned,
)

ARCHS = (80, 90)

# Register budget per kernel (fnmatch pattern on its extern "C" name): a kernel over its budget,
# or one that matches no pattern, fails. Adding a kernel is one line here.
REGISTER_BUDGETS: dict[str, int] = {
    "int4_gemv_*f16_m*": 128,  # tensor cores: 2 CTAs of 256 threads per SM (__launch_bounds__)
    "int4_gemv_f32_*": 168,  # M_TILE 16: 16 rows of float32 accumulators and dot products
    "int4_gemm_*": 128,
    "add_rms_norm_*": 48,
    "rope_kv_write_*": 64,
    "silu_and_mul_*": 48,
    # decode: K/V staged in shared memory (cp.async), 8 acc floats per head in registers; g8
    # is held to 128 by __launch_bounds__(128, 4) (4 CTAs per SM)
    "paged_decode_*_g[124]": 96,
    "paged_decode_*_g8": 128,
    "paged_decode_reduce_*": 40,
    "paged_prefill_*_d64": 160,  # O: D / 2 floats, Q fragments: D / 4 registers
    "paged_prefill_*_d128": 192,
}

SOURCES = sorted(path.name for path in cuda_source_dir().glob("*.cu"))


def test_the_kernel_sources_are_found() -> None:
    assert {"paged_attention_decode.cu", "paged_attention_prefill.cu"} <= set(SOURCES)


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AIENG_CACHE_DIR", str(tmp_path))
    return tmp_path / "kernels"


@functools.cache
def shipped(source: str, arch: int) -> CompiledModule:
    """A shipped source compiled once per test session (no disk cache: each test has its own)."""
    return compile_kernel_source(source, arch, use_cache=False)


def budget_of(kernel: str) -> int | None:
    for pattern, budget in REGISTER_BUDGETS.items():
        if fnmatch.fnmatchcase(kernel, pattern):
            return budget
    return None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_compiles_without_spills_within_budget(source: str, arch: int) -> None:
    module = shipped(source, arch)
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
    names = [n for s in SOURCES for n in shipped(s, 90).resources]
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


# --- the paged attention kernels' launch parameters (aieng.kernels.paged_attention) ---


def test_heads_per_cta_covers_the_group_with_the_fewest_ctas() -> None:
    assert [heads_per_cta(g) for g in (1, 2, 3, 4, 5, 7, 8)] == [
        (1, 1), (2, 1), (4, 1), (4, 1), (8, 1), (8, 1), (8, 1),
    ]  # fmt: skip
    assert heads_per_cta(12) == (8, 2) and heads_per_cta(16) == (8, 2) and heads_per_cta(17)[1] == 3
    with pytest.raises(KernelError):
        heads_per_cta(0)


def test_kernel_names_exist_in_the_compiled_sources() -> None:
    decode = shipped("paged_attention_decode.cu", 90).resources
    prefill = shipped("paged_attention_prefill.cu", 90).resources
    for dtype in (torch.float16, torch.bfloat16):
        assert decode_reduce_kernel_name(dtype) in decode
        for int8 in (False, True):
            for head_dim in (64, 128):
                assert prefill_kernel_name(dtype, int8, head_dim) in prefill
                for group in (1, 2, 3, 4, 6, 8, 16):
                    assert decode_kernel_name(dtype, int8, head_dim, group) in decode
    with pytest.raises(KernelError, match="head_dim"):
        decode_kernel_name(torch.float16, False, 256, 1)
    with pytest.raises(KernelError, match="float16"):
        prefill_kernel_name(torch.float32, False, 64)


def test_decode_tile_matches_the_kernel() -> None:
    # kTile = (128 threads / (D / 8) lanes per token) * 4 passes
    assert decode_tile(64) == 64 and decode_tile(128) == 32


def split_ranges(seq_len: int, window: int | None, plan: SplitPlan) -> list[range]:
    """The positions each split reads, as the decode kernel and its reduction compute them."""
    start = max(0, seq_len - window) if window else 0
    used = -(-(seq_len - start) // plan.split_tokens)
    assert used <= plan.num_splits
    return [
        range(start + s * plan.split_tokens, min(seq_len, start + (s + 1) * plan.split_tokens))
        for s in range(used)
    ]


@pytest.mark.parametrize(
    ("batch", "context", "kv_heads", "num_sms"),
    [(64, 1024, 8, 132), (16, 4096, 8, 132), (1, 32768, 8, 132), (1, 32768, 2, 108),
     (3, 300, 4, 132), (1, 1, 8, 132), (2, 700, 1, 16), (1, 100_000, 1, 132)],
)  # fmt: skip
@pytest.mark.parametrize("window", [None, 500])
def test_split_plan_covers_every_context_once(
    batch: int, context: int, kv_heads: int, num_sms: int, window: int | None
) -> None:
    rng = np.random.default_rng(context)
    seq_lens = np.concatenate([[context], rng.integers(1, context + 1, batch - 1)])
    longest = int(attended_lengths(seq_lens, window).max())
    plan = choose_splits(batch * kv_heads, longest, num_sms, decode_tile(128), ctas_per_sm=4)
    assert 1 <= plan.num_splits <= MAX_SPLITS
    if plan.num_splits > 1:
        assert plan.split_tokens % decode_tile(128) == 0
        assert plan.split_tokens >= MIN_SPLIT_TOKENS
        # split only a batch that leaves CTA slots idle, and into at most one wave of them
        assert batch * kv_heads * plan.num_splits <= 4 * num_sms
    for seq_len in seq_lens:
        ranges = split_ranges(int(seq_len), window, plan)
        positions = [p for r in ranges for p in r]
        first = max(0, int(seq_len) - window) if window else 0
        assert positions == list(range(first, int(seq_len)))
        assert all(len(r) > 0 for r in ranges)


def test_split_plan_examples() -> None:
    # the benchmark's shapes on an H200 (132 SMs), 8 KV heads, group 4: 6 CTAs per SM (below)
    assert choose_splits(64 * 8, 1024, 132, 32, 6).num_splits == 1  # 512 of 792 slots
    assert choose_splits(16 * 8, 4096, 132, 32, 6) == SplitPlan(6, 704)  # 768 of 792
    assert choose_splits(1 * 8, 32768, 132, 32, 6) == SplitPlan(94, 352)  # 752 of 792
    assert choose_splits(1 * 8, 32768, 132, 32, 4) == SplitPlan(64, 512)  # g8's 4 per SM
    assert choose_splits(8, 255, 132, 32, 6).num_splits == 1  # too short to split
    with pytest.raises(KernelError):
        choose_splits(0, 10, 132, 32, 4)
    with pytest.raises(KernelError):
        choose_splits(8, 10, 132, 32, 0)


def test_occupancy_arithmetic() -> None:
    def ctas(registers: int, shared: int = 0, arch: int = 90, threads: int = 128) -> int:
        return ctas_per_sm(KernelResources(registers=registers, shared_bytes=shared), threads, arch)

    assert ctas(128) == 4 and ctas(120) == 4 and ctas(136) == 3 and ctas(168) == 3
    assert ctas(255) == 2 and ctas(32) == 16 and ctas(32, threads=1024) == 2
    assert ctas(80, 35376) == 6 and ctas(80, 35376, arch=80) == 4  # 228 KB vs 164 KB of shared
    assert ctas(64, 17040, arch=89) == 5  # 100 KB on sm_89
    with pytest.raises(KernelError, match="sm_75"):
        ctas(32, arch=75)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_kernels_fit_four_ctas_per_sm(arch: int) -> None:
    """The design's claim (cuda/README.md): every decode variant keeps >= 4 CTAs, each with a
    16 KB tile in flight, resident per SM; g1-g4 with a cache in T fit 6 on sm_90."""
    resources = shipped("paged_attention_decode.cu", arch).resources
    kernels = [name for name in resources if not name.startswith("paged_decode_reduce")]
    assert len(kernels) == 32
    for name in kernels:
        assert ctas_per_sm(resources[name], DECODE_THREADS, arch) >= 4, (name, resources[name])
    if arch == 90:
        for group in (1, 2, 4):
            name = decode_kernel_name(torch.bfloat16, False, 128, group)
            assert ctas_per_sm(resources[name], DECODE_THREADS, arch) == 6, resources[name]


def test_prefill_tiles_enumerate_every_query_block() -> None:
    query_lens = np.array([1, 64, 1, 65, 200, 2, 1])
    requests = np.flatnonzero(query_lens > 1)
    tile_request, tile_first = prefill_tiles(query_lens, requests)
    want = [(r, first) for r in requests for first in range(0, query_lens[r], PREFILL_BLOCK_M)]
    assert list(zip(tile_request.tolist(), tile_first.tolist(), strict=True)) == want
    assert tile_request.dtype == np.int32 and tile_first.dtype == np.int32
    empty = prefill_tiles(query_lens, np.array([], np.int64))
    assert empty[0].size == 0 and empty[1].size == 0


def test_block_shift_needs_a_power_of_two() -> None:
    assert block_shift(16) == 4 and block_shift(32) == 5 and block_shift(1) == 0
    with pytest.raises(KernelError, match="power-of-two"):
        block_shift(24)


# --- kernel parameter lists (from the PTX) against the arguments the launchers pack ---


def test_ptx_parameters_of_a_probe(tmp_path: Path) -> None:
    path = tmp_path / "params.cu"
    path.write_text(
        'extern "C" __global__ void params(float* x, int n, float s, long long m, double d) '
        "{ x[n] = s + m + d; }\n"
    )
    module = compile_kernel_source(path, 90)
    assert module.parameters == {"params": ("b64", "b32", "f32", "b64", "f64")}
    assert compile_kernel_source(path, 90).parameters == module.parameters  # from the cache


def test_arguments_are_checked_against_the_parameters() -> None:
    _, types = pack_args([torch.zeros(1), 3, 0.5])
    check_arguments("k", ("b64", "b32", "f32"), types)
    with pytest.raises(KernelError, match=r"k takes 3 arguments \(b64, b32, f32\), got 2"):
        check_arguments("k", ("b64", "b32", "f32"), types[:2])
    with pytest.raises(KernelError, match="got 3 \\(b64, b32, b32\\)"):
        check_arguments("k", ("b64", "b32", "f32"), pack_args([torch.zeros(1), 3, 4])[1])


def paged_inputs(dtype: torch.dtype, int8: bool, head_dim: int, heads: int, kv_heads: int):
    """CPU tensors shaped as the attention kernels take them (only their pointers are read)."""
    cache_dtype = torch.int8 if int8 else dtype
    k = torch.zeros(9, 16, kv_heads, head_dim, dtype=cache_dtype)
    scales = (torch.ones(9, 16, kv_heads, 1, dtype=dtype),) * 2 if int8 else (None, None)
    q = torch.zeros(5, heads, head_dim, dtype=dtype)
    table = torch.zeros(3, 4, dtype=torch.int32)
    lens = torch.ones(3, dtype=torch.int32)
    return q, PagedCache(k, k.clone(), *scales), table, lens


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_launches_match_the_kernels(dtype: torch.dtype, int8: bool) -> None:
    decode = shipped("paged_attention_decode.cu", 90).parameters
    prefill = shipped("paged_attention_prefill.cu", 90).parameters
    for head_dim in HEAD_DIMS:
        for heads, kv_heads in ((8, 8), (12, 4), (32, 8), (40, 2)):
            q, cache, table, lens = paged_inputs(dtype, int8, head_dim, heads, kv_heads)
            partials = (torch.zeros(3, heads, 4, head_dim), torch.zeros(3, heads, 4, 2))
            launches = decode_launches(q, q, cache, table, lens, lens, SplitPlan(1, 64), 0.1, None)
            launches += decode_launches(
                q, q, cache, table, lens, lens, SplitPlan(4, 256), 0.1, 128, partials
            )
            launches.append(
                prefill_launch(q, q, cache, table, lens, lens, lens, lens, lens, 0.1, 7)
            )
            assert [launch.kernel.split("_")[1] for launch in launches] == [
                "decode", "decode", "decode", "prefill",
            ]  # fmt: skip
            for launch in launches:
                parameters = {**decode, **prefill}[launch.kernel]
                check_arguments(launch.kernel, parameters, pack_args(launch.args)[1])
                dim3(launch.grid, "grid")
                dim3(launch.block, "block")


def test_instantiation_filters_compile_only_what_a_model_needs() -> None:
    options = instantiation_options(torch.bfloat16, True, 128)
    assert options == ["-DAIENG_DTYPE=2", "-DAIENG_INT8=1", "-DAIENG_HEAD_DIM=128"]
    decode = compile_kernel_source("paged_attention_decode", 90, options).resources
    prefill = compile_kernel_source("paged_attention_prefill", 90, options).resources
    wanted = {decode_kernel_name(torch.bfloat16, True, 128, g) for g in (1, 2, 4, 8)}
    assert set(decode) == wanted | {decode_reduce_kernel_name(torch.bfloat16)}
    assert set(prefill) == {prefill_kernel_name(torch.bfloat16, True, 128)}
    assert instantiation_options() == []
    assert instantiation_options(int8=False) == ["-DAIENG_INT8=0"]
    with pytest.raises(KernelError):
        instantiation_options(head_dim=96)


def test_every_attention_launch_checks_layout_and_alignment() -> None:
    """cp.async needs 16-byte aligned cache rows, the prefill's q loads 4-byte aligned rows:
    asserted at every launch, not assumed from each cache being its own allocation. q as a view
    of a fused QKV projection (its own row stride) passes, as the model hands it over."""
    heads, kv_heads, head_dim = 8, 2, 64
    q, cache, table, lens = paged_inputs(torch.bfloat16, False, head_dim, heads, kv_heads)
    tokens = q.shape[0]
    qkv = torch.zeros(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q_view = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert q_is_aligned(q_view) and not q_view.is_contiguous()

    def launch(q: torch.Tensor, cache: PagedCache) -> None:
        decode_launches(q.contiguous(), q, cache, table, lens, lens, SplitPlan(1, 64), 0.1, None)
        prefill_launch(q.contiguous(), q, cache, table, lens, lens, lens, lens, lens, 0.1, None)

    launch(q_view, cache)
    shifted = torch.zeros(cache.k.numel() + 4, dtype=cache.k.dtype)[4:].view(cache.k.shape)
    assert shifted.data_ptr() % CACHE_ALIGNMENT == 8
    with pytest.raises(KernelError, match="K cache must be contiguous and 16-byte aligned"):
        launch(q, PagedCache(shifted, cache.v))
    with pytest.raises(KernelError, match="V cache"):
        launch(q, PagedCache(cache.k, cache.v.transpose(0, 1).contiguous().transpose(0, 1)))
    odd = torch.zeros(tokens * heads * head_dim + 1, dtype=q.dtype)[1:].view(q.shape)
    assert not q_is_aligned(odd) and not q_is_aligned(q.transpose(1, 2).contiguous().mT)
    with pytest.raises(KernelError, match="q must be"):
        launch(odd, cache)
