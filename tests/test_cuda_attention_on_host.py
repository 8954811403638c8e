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
    HostLaunchError,
    build_host_binary,
    host_kernels,
    sanitizers_available,
)

from aieng.attention.backend import QuantizedKVCache
from aieng.attention.cuda_paged import build_cuda_metadata, paged_cache, split_plan
from aieng.attention.cuda_self_check import (
    RequestSpec,
    bounds,
    clone_cache,
    fused_qkv,
    random_cache,
    random_step,
    reference_attention,
)
from aieng.attention.layer import Attention
from aieng.kernels.paged_attention import (
    Launch,
    PagedCache,
    SplitPlan,
    decode_launches,
    prefill_launch,
)
from aieng.kernels.reference import write_kv_cache, write_quantized_kv_cache
from aieng.kernels.self_check import disagreement

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or clang++)")


def run_step(
    host: HostKernels, specs: Sequence[RequestSpec], heads: int, kv_heads: int, head_dim: int,
    block_size: int, window: int | None, dtype: torch.dtype, int8: bool, num_sms: int,
    ctas_per_sm: int, early_copies: bool = False, planned_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """One random step through the host-built kernels into a NaN-filled output -> (got, want,
    number of decode splits). `planned_len`: the decode's split-K plan made for that context,
    as a captured CUDA graph's; `early_copies`: every cp.async lands when issued."""
    inputs, num_blocks = random_step(specs, block_size, CPU, seed=len(specs))
    generator = torch.Generator().manual_seed(heads * head_dim)
    tokens = int(inputs.query_start_loc[-1])
    q, k, v = fused_qkv(tokens, heads, kv_heads, head_dim, dtype, generator, CPU)
    assert not q.is_contiguous() or tokens == 1  # the model's view of its QKV projection
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
        decode.planned_len = planned_len
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
        host.launch(launch.kernel, launch.grid, launch.block, launch.args, early_copies)
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


# cp.async copies landing as soon as they are issued (the other end of the GPU's freedom): a
# kernel that issues a stage's copies while its threads still read that stage fails these.
EARLY_COPY_CASES = [
    "decode split, group 4",
    "decode int8 tails, group 8 of 16 heads",
    "prefill chunk after 300 cached, many steps",
    "mixed step",
]


@pytest.mark.parametrize(
    ("case", "early_copies"),
    [(case, False) for case in CASES] + [(case, True) for case in EARLY_COPY_CASES],
    ids=[*CASES, *(f"{case}, copies land early" for case in EARLY_COPY_CASES)],
)
def test_attention_kernel_source_on_the_host(
    host_kernels: HostKernels,  # noqa: F811
    case: str,
    early_copies: bool,
) -> None:
    heads, kv_heads, head_dim, block_size, window, dtype, int8, sms, requests = CASES[case]
    specs = [RequestSpec(cached, new) for cached, new in requests]
    got, want, splits = run_step(
        host_kernels, specs, heads, kv_heads, head_dim, block_size, window, dtype, int8, *sms,
        early_copies,
    )  # fmt: skip
    if "split" in case:
        assert splits > 1, "the case was meant to take the split-K path"
    if (many := re.search(r"(\d+) splits", case)) is not None:
        assert splits == int(many.group(1)), splits
    query_lens = [new for _, new in requests]
    decode_rows = torch.tensor([n == 1 for n in query_lens for _ in range(n)])
    assert_close(got, want, dtype, decode_rows)


# Decodes planned as a captured CUDA graph plans them (`DecodeBatch.planned_len`: the context
# bucket, longer than the live contexts): most splits hold no position. Block sizes beside 16
# and 32: 8 and 64 (an engine's own block size is checked at start-up with them).
# (query heads, KV heads, head_dim, block size, INT8, (SMs, CTAs per SM), contexts, planned
#  positions, splits)
GRAPH_CASES = {
    "128 splits over 300 live positions, block size 64": (
        4, 1, 64, 64, False, (132, 4), [300], 32768, 128,
    ),
    "int8, 16 splits over 1000 and 1, block size 8": (
        4, 2, 128, 8, True, (16, 4), [1000, 1], 32768, 16,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_graph_mode_plans_on_the_host(host_kernels: HostKernels, case: str) -> None:  # noqa: F811
    heads, kv_heads, head_dim, block_size, int8, sms, lengths, planned, want_splits = GRAPH_CASES[
        case
    ]
    specs = [RequestSpec(length - 1, 1) for length in lengths]
    got, want, splits = run_step(
        host_kernels, specs, heads, kv_heads, head_dim, block_size, None, torch.bfloat16, int8,
        *sms, planned_len=planned,
    )  # fmt: skip
    assert splits == want_splits
    assert_close(got, want, torch.bfloat16, torch.ones(len(lengths), dtype=torch.bool))


def test_the_async_load_stand_ins_behave_as_the_ptx(tmp_path) -> None:
    """cp.async copies land only when a wait retires their group (so a kernel that reads its
    stage too early fails the tests above), and ldmatrix hands out the PTX fragment layout."""
    binary = build_host_binary(ROOT / "tests/cuda_host/async_copy_probe.cpp", tmp_path)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0 failures"


def test_the_host_build_stops_bad_reads(host_kernels: HostKernels, tmp_path) -> None:  # noqa: F811
    """What the emulation used to let through: a decode launch whose K cache is 16 bytes short
    of the last position it reads (AddressSanitizer: buffers are exactly their storage), and one
    whose K cache starts 8 bytes off a 16-byte boundary (the cp.async stand-in). Both are the
    launch's error, not a wrong number; the same launch over the whole cache is clean."""
    if not sanitizers_available(tmp_path):
        pytest.skip("the host compiler has no AddressSanitizer")
    heads, kv_heads, head_dim, block_size = 2, 1, 64, 16
    q = torch.randn(1, heads, head_dim).to(torch.bfloat16)
    k = torch.randn(3, block_size, kv_heads, head_dim).to(torch.bfloat16)
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)  # position 47 ends the cache's storage
    lens, rows = torch.tensor([48], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)

    def launch(k_arg: torch.Tensor) -> None:
        out = torch.full_like(q, float("nan"))
        cache = PagedCache(k, k.clone())
        [decode] = decode_launches(out, q, cache, table, lens, rows, SplitPlan(1, 48), 0.1, None)
        args = list(decode.args)
        args[5] = k_arg  # the K cache pointer, past the launch's own layout check
        host_kernels.launch(decode.kernel, decode.grid, decode.block, args)
        assert not out.isnan().any()

    launch(k)
    with pytest.raises(HostLaunchError, match="AddressSanitizer: heap-buffer-overflow"):
        launch(k.flatten()[:-8].clone())
    shifted = torch.zeros(k.numel() + 4, dtype=k.dtype)
    shifted[4:] = k.flatten()
    with pytest.raises(HostLaunchError, match="not aligned to 16 bytes"):
        launch(shifted[4:])
