"""The paged attention kernels' own source run on the CPU (issue 12): paged_attention_decode.cu
and paged_attention_prefill.cu built with the host's C++ compiler over tests/cuda_host/emulate.h
(threads as std::threads, shuffles and mma.sync emulated from the PTX fragment layouts), launched
with exactly the grids and arguments the `cuda` backend computes (`decode_launches`,
`prefill_launch`), against the torch reference in float32 over the same cache. This checks the
kernels' indexing, masking, split-K and online-softmax arithmetic without a GPU; the PTX itself
only runs on one (tests/test_cuda_attention_gpu.py). Small shapes: every block is 128 threads."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence

import pytest
import torch
from test_cuda_kernels_on_host import (  # noqa: F401 (host_kernels: a fixture)
    COMPILER,
    ROOT,
    HostKernels,
    host_kernels,
)

from aieng.attention.backend import QuantizedKVCache
from aieng.attention.cuda_paged import build_cuda_metadata, paged_cache, split_plan
from aieng.attention.cuda_self_check import (
    QUERY_SCALE,
    RequestSpec,
    bounds,
    clone_cache,
    random_cache,
    random_step,
    reference_attention,
)
from aieng.attention.layer import Attention
from aieng.kernels.paged_attention import Launch, decode_launches, prefill_launch
from aieng.kernels.reference import write_kv_cache, write_quantized_kv_cache
from aieng.kernels.self_check import disagreement

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or clang++)")


def run_step(
    host: HostKernels, specs: Sequence[RequestSpec], heads: int, kv_heads: int, head_dim: int,
    block_size: int, window: int | None, dtype: torch.dtype, int8: bool, num_sms: int,
    ctas_per_sm: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """One random step through the host-built kernels into a NaN-filled output -> (got, want,
    number of decode splits)."""
    inputs, num_blocks = random_step(specs, block_size, CPU, seed=len(specs))
    generator = torch.Generator().manual_seed(heads * head_dim)
    tokens = int(inputs.query_start_loc[-1])
    q = (torch.randn(tokens, heads, head_dim, generator=generator) * QUERY_SCALE).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype)
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, int8, CPU, generator)
    layer = Attention(heads, kv_heads, head_dim, 0, sliding_window=window)
    want = reference_attention(layer, q, k, v, clone_cache(cache), inputs)
    metadata = build_cuda_metadata(inputs)
    if isinstance(cache, QuantizedKVCache):
        write_quantized_kv_cache(k, v, cache, metadata.slot_mapping)
    else:
        write_kv_cache(k, v, cache[0], cache[1], metadata.slot_mapping)
    out = torch.full_like(q, float("nan"))
    launches: list[Launch] = []
    splits = 0
    if (decode := metadata.decode) is not None:
        plan = split_plan(decode, window, heads, kv_heads, head_dim, num_sms, ctas_per_sm)
        shape = (len(decode.seq_lens_host), heads, plan.num_splits)
        partials = (
            torch.full((*shape, head_dim), float("nan")),
            torch.full((*shape, 2), float("nan")),
        )
        launches += decode_launches(
            out, q, paged_cache(cache), decode.block_tables, decode.seq_lens, decode.rows, plan,
            layer.scale, window, partials,
        )  # fmt: skip
        splits = plan.num_splits
    if (prefill := metadata.prefill) is not None:
        launch = prefill_launch(
            out, q, paged_cache(cache), prefill.block_tables, prefill.query_start,
            prefill.num_computed, prefill.seq_lens, prefill.tile_request, prefill.tile_first,
            layer.scale, window,
        )  # fmt: skip
        launches.append(launch)
    for launch in launches:
        host.launch(launch.kernel, launch.grid, launch.block, launch.args)
    return out, want, splits


def assert_close(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, decode_rows: torch.Tensor
) -> None:
    """Every (token, head) row within the start-up check's own `RowBound` (`bounds`: decode
    rows the decode kernel's, the others the prefill kernel's), no row left unwritten: one
    dropped or repeated position fails it at any context length (a norm bound would not)."""
    assert not got.isnan().any(), f"{int(got.isnan().any(-1).sum())} (token, head) rows unwritten"
    for kind, rows in (("decode", decode_rows), ("prefill", ~decode_rows)):
        if rows.any():
            why = disagreement(got[rows], want[rows], bounds(dtype)[kind])
            assert why is None, f"{kind} rows: {why}"


# (query heads, KV heads, head_dim, block size, window, dtype, INT8, (SMs, CTAs per SM),
#  (cached, new) per request); every decode split is whole tiles of 32 (D 128) or 64 (D 64)
CASES = {
    "decode split, group 4": (
        8, 2, 64, 16, None, torch.float16, False, (132, 4), [(699, 1), (4, 1), (31, 1), (0, 1)],
    ),
    "decode int8 window, group 3": (
        6, 2, 128, 32, 100, torch.bfloat16, True, (4, 4),
        [(0, 1), (98, 1), (99, 1), (100, 1), (299, 1)],
    ),
    "decode group 20 (3 CTAs per KV head), split": (
        20, 1, 64, 16, None, torch.bfloat16, False, (132, 4), [(49, 1), (599, 1)],
    ),
    "decode int8 split with window": (
        4, 4, 64, 32, 600, torch.float16, True, (132, 4), [(899, 1), (10, 1)],
    ),
    # the pipeline's new paths: many splits over thousands of positions, split-K with a window,
    # each GQA group instantiation, both block sizes, contexts that end inside a tile
    "decode 11 splits of 3000 positions, group 1": (
        1, 1, 128, 16, None, torch.bfloat16, False, (8, 4), [(2999, 1)],
    ),
    "decode int8 3 splits with window over 2500, group 2": (
        4, 2, 64, 32, 1000, torch.bfloat16, True, (8, 4), [(2499, 1), (700, 1)],
    ),
    "decode split of 1500, group 8": (
        8, 1, 128, 16, None, torch.float16, False, (16, 4), [(1499, 1), (37, 1)],
    ),
    "decode int8 tails, group 8 of 16 heads": (
        16, 2, 128, 32, None, torch.float16, True, (132, 4), [(32, 1), (64, 1), (95, 1), (2, 1)],
    ),
    "decode tails, group 2": (
        4, 2, 64, 16, None, torch.bfloat16, False, (132, 4), [(64, 1), (100, 1), (127, 1)],
    ),
    "prefill fresh and chunked": (
        4, 2, 64, 16, None, torch.float16, False, (132, 4), [(0, 37), (50, 70)],
    ),
    "prefill int8 window, two query tiles": (
        2, 1, 128, 32, 40, torch.bfloat16, True, (132, 4), [(0, 130), (100, 3)],
    ),
    "prefill chunk after 300 cached, many steps": (
        1, 1, 128, 32, None, torch.float16, False, (132, 4), [(300, 70)],
    ),
    "mixed step": (
        4, 1, 128, 16, None, torch.float16, False, (132, 4), [(0, 2), (300, 1), (17, 20), (0, 1)],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_attention_kernel_source_on_the_host(host_kernels: HostKernels, case: str) -> None:  # noqa: F811
    heads, kv_heads, head_dim, block_size, window, dtype, int8, sms, requests = CASES[case]
    specs = [RequestSpec(cached, new) for cached, new in requests]
    got, want, splits = run_step(
        host_kernels, specs, heads, kv_heads, head_dim, block_size, window, dtype, int8, *sms
    )
    if "split" in case:
        assert splits > 1, "the case was meant to take the split-K path"
    if (many := re.search(r"(\d+) splits", case)) is not None:
        assert splits == int(many.group(1)), splits
    query_lens = [new for _, new in requests]
    decode_rows = torch.tensor([n == 1 for n in query_lens for _ in range(n)])
    assert_close(got, want, dtype, decode_rows)


def test_the_async_load_stand_ins_behave_as_the_ptx(tmp_path) -> None:
    """cp.async copies land only when a wait retires their group (so a kernel that reads its
    stage too early fails the tests above), and ldmatrix hands out the PTX fragment layout."""
    binary = tmp_path / "async_copy_probe"
    source = ROOT / "tests/cuda_host/async_copy_probe.cpp"
    command = [COMPILER, "-std=c++20", "-O1", "-pthread", f"-I{ROOT / 'cuda'}"]
    command += [f"-I{ROOT / 'tests/cuda_host'}", str(source), "-o", str(binary)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0 failures"
