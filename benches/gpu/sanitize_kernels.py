"""Every CUDA kernel once, on small shapes, for compute-sanitizer (run.sh's `sanitizer` part):

    compute-sanitizer --tool memcheck  python benches/gpu/sanitize_kernels.py
    compute-sanitizer --tool racecheck python benches/gpu/sanitize_kernels.py --kernels attention

- attention: the `cuda` backend's start-up checks (`attention_checks`), run in this process
  (so that the sanitizer sees every launch; the engine runs them in a child process first) for
  several models (head_dim 64 and 128, query-head groups 1, 4 and 8, a sliding window), float16
  and bfloat16, model-dtype and INT8 caches: every decode (split, whole, planned as a CUDA
  graph's up to 128 splits) and prefill kernel the model uses, at the block sizes of
  `--block-sizes`, once each, against the reference; a kernel that fails is a failure.
- int4: `int4_matmul`'s GEMV and GEMM at every M that picks another variant (1 ... 17, 64),
  float16 and bfloat16, checked row by row against `reference_matmul`.
- fused: `check_fused_ops` (add_rms_norm, rope_kv_write + kv_write, silu_and_mul); every kernel
  must pass.
Small shapes keep the sanitizer's slowdown (10-100x) to seconds. Exit status 1 when an output
is wrong or a kernel path fell back; the sanitizer's own exit code reports what it found.

`--smoke`: the same steps on the CPU — the torch attention backend, the INT4 kernels' host
emulations, the fused kernels' references only — so that CI keeps this script runnable.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_int4 import host_emulation, random_weights
from common import NO_GPU, ROW_TOLERANCE, PathMismatch, WrongOutput, check_rows

from aieng.attention.backend import AttentionBackend
from aieng.attention.cuda_paged import CudaPagedAttention
from aieng.attention.cuda_self_check import attention_checks
from aieng.attention.torch_paged import TorchPagedAttention
from aieng.kernels.fused import check_cases, check_fused_ops
from aieng.kernels.int4 import choose_path, int4_matmul, reference_matmul

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# (query heads, KV heads, head_dim, sliding window): groups 1, 4 and 8, both head dims, a window
ATTENTION_MODELS = ((8, 8, 64, None), (32, 8, 128, None), (16, 2, 64, None), (8, 2, 128, 48))
INT4_SHAPE = (256, 512)  # (N, K): two groups of 128 per row, more rows than one CTA's tile
INT4_M = (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)


@dataclass(frozen=True)
class Scope:
    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    attention_models: tuple[tuple[int, int, int, int | None], ...]
    block_sizes: tuple[int, ...]
    smoke: bool


def sanitize_attention(scope: Scope) -> int:
    checked = 0
    for heads, kv_heads, head_dim, window in scope.attention_models:
        for dtype in scope.dtypes:
            for int8 in (False, True):
                backend: AttentionBackend
                if scope.smoke:  # the reference stands in for the kernels on the CPU, in
                    backend = TorchPagedAttention(sliding_windows=(window,))
                    dtype = torch.float32  # float32: the bound is the float32 reference's
                else:
                    backend = CudaPagedAttention(scope.device, dtype, int8, head_dim)
                shape = (heads, kv_heads, head_dim, dtype, int8, (window,), scope.device)
                for name, check in attention_checks(
                    backend, *shape, block_sizes=scope.block_sizes, repeats=1
                ):
                    if not check():
                        raise WrongOutput(
                            f"attention {name} ({heads}/{kv_heads} heads, window {window}, "
                            f"{'INT8' if int8 else 'model-dtype'} cache) failed its check: see "
                            "the warning above"
                        )
                    checked += 1
    return checked


def sanitize_int4(scope: Scope) -> int:
    matmul: Callable = host_emulation if scope.smoke else int4_matmul
    device = scope.device
    n, k = INT4_SHAPE
    [weights] = random_weights(n, k, 1, device)
    generator = torch.Generator(device=device).manual_seed(0)
    checked = 0
    for dtype in scope.dtypes:
        for m in INT4_M:
            x = torch.randn(m, k, generator=generator, device=device).to(dtype)
            want = reference_matmul(x.float(), weights)
            paths = {"gemv", choose_path(m, dtype)} - {None}
            for path in sorted(paths):
                got = matmul(x, weights, path).float()
                check_rows(got, want, ROW_TOLERANCE[dtype], f"int4 {path} M={m} {dtype}")
                checked += 1
    return checked


def sanitize_fused(scope: Scope) -> int:
    checked = 0
    for dtype in scope.dtypes:
        cases = check_cases(scope.device, dtype)
        if scope.smoke:  # no CUDA kernel to run: the cases are built, nothing is launched
            checked += len(cases)
            continue
        failed = set(cases) - check_fused_ops(scope.device, dtype)
        if failed:
            raise WrongOutput(f"fused kernels failed their check: {sorted(failed)}")
        checked += len(cases)
    return checked


PARTS = {"attention": sanitize_attention, "int4": sanitize_int4, "fused": sanitize_fused}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=",".join(PARTS), help="comma list of " + str(PARTS))
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of " + str(DTYPES))
    parser.add_argument(
        "--attention-models", type=int, default=len(ATTENTION_MODELS),
        help=f"the first N of {ATTENTION_MODELS} (heads, KV heads, head_dim, window)",
    )  # fmt: skip
    parser.add_argument(
        "--block-sizes", default="16,128", help="comma list: the attention checks' cache blocks"
    )
    parser.add_argument("--smoke", action="store_true", help="the same steps on the CPU")
    args = parser.parse_args(argv)
    names = args.kernels.split(",")
    if unknown := [name for name in names if name not in PARTS]:
        parser.error(f"--kernels: unknown {unknown}; choose from {list(PARTS)}")
    if unknown := [name for name in args.dtypes.split(",") if name not in DTYPES]:
        parser.error(f"--dtypes: unknown {unknown}; choose from {list(DTYPES)}")
    if not 1 <= args.attention_models <= len(ATTENTION_MODELS):
        parser.error(f"--attention-models: 1 to {len(ATTENTION_MODELS)}")
    if not args.smoke and not torch.cuda.is_available():
        print(
            f"sanitize_kernels: {NO_GPU}",
            file=sys.stderr,
        )
        return 2
    scope = Scope(
        torch.device("cpu" if args.smoke else "cuda"),
        tuple(DTYPES[name] for name in args.dtypes.split(",")),
        ATTENTION_MODELS[: 1 if args.smoke else args.attention_models],  # the CPU: one, small
        tuple(int(size) for size in args.block_sizes.split(","))[: 1 if args.smoke else None],
        args.smoke,
    )
    try:
        for name in names:
            count = PARTS[name](scope)
            print(f"sanitize_kernels: {name}: {count} cases checked", flush=True)
    except (PathMismatch, WrongOutput) as error:
        print(f"sanitize_kernels: FAILED: {error}", file=sys.stderr)
        return 1
    if not args.smoke:
        torch.cuda.synchronize()  # a fault in the last launch surfaces here, inside the run
    return 0


if __name__ == "__main__":
    sys.exit(main())
