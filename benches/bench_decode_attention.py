"""A decode row's paged attention on the CPU (rust/src/kernels/paged_attention.rs and
paged_decode_x86.rs) against the machine's read bandwidth and the pure-PyTorch path.

The base model's attention shape (12 heads, 12 KV heads, head_dim 64, blocks of 16) over one
layer's cache. Each request decodes one token against C cached positions whose blocks lie in a
shuffled order in a pool several times larger than the context (as a long-running engine leaves
them), for R requests at once, C in {512, 4096, 16384} and caches of bfloat16 (the CPU default),
float32 and int8 (+ float32 scales). Printed per cell:
- `aieng`: `_core.paged_attention` (the binding the native decoder's step calls), median ms and
  the GB/s of K and V it reads (every byte once);
- `torch`: the pure-PyTorch path at its best — `scaled_dot_product_attention` over the same
  context already gathered into contiguous float32 tensors (the gather is not timed), torch's
  own threads set to the same count;
- the ratio, and aieng's GB/s as a % of the read bandwidth measured at the start (torch.sum
  over 256 MiB, best of 5).
A cell whose K/V fit in the last-level cache reads faster than memory; the 16,384-position and
the R = 4 cells do not. The bench uses only the public binding, so the same command on an older
checkout times the kernel it had (old design vs new).

    .venv/bin/python benches/bench_decode_attention.py [--threads 2] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from aieng import _core
from aieng.benchmarks.offline import machine

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 12, 64, 16


def read_bandwidth() -> float:
    source = torch.ones(64 << 20)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        source.sum()
        best = min(best, time.perf_counter() - t)
    return source.numel() * 4 / best / 1e9


def cache(kind: str, blocks: int, rng: np.random.Generator) -> dict:
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "float32":
        return {"k": x, "v": x[::-1].copy(), "bytes": 4}
    if kind == "bfloat16":
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        return {"k": bits, "v": bits[::-1].copy(), "bytes": 2}
    q = np.clip(np.rint(x * 40), -127, 127).astype(np.int8)
    scale = np.full(shape[:3], 1 / 40, np.float32)
    return {"k": q, "v": q[::-1].copy(), "k_scale": scale, "v_scale": scale, "bytes": 1}


def as_float(kind: str, c: dict, part: str) -> torch.Tensor:
    x = c[part]
    if kind == "bfloat16":
        return torch.from_numpy((x.astype(np.uint32) << 16).view(np.float32))
    if kind == "int8":
        return torch.from_numpy(x.astype(np.float32) * c[f"{part}_scale"][..., None])
    return torch.from_numpy(x)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def cell(kind: str, context: int, requests: int, threads: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    per_request = context // BLOCK
    pool = 4 * per_request * requests  # the pool is larger than the context: blocks scattered
    c = cache(kind, pool, rng)
    tables = rng.permutation(pool)[: per_request * requests].astype(np.int32)
    tables = tables.reshape(requests, per_request)
    q = rng.standard_normal((requests, HEADS, HEAD_DIM), dtype=np.float32)
    out = np.empty_like(q)
    qsl = np.arange(requests + 1, dtype=np.int32)
    lens = np.full(requests, context, np.int32)
    scales = {k: c[k] for k in ("k_scale", "v_scale") if k in c}
    scale = HEAD_DIM**-0.5

    def aieng() -> None:
        _core.paged_attention(
            q, c["k"], c["v"], out, qsl, lens, tables, scale, 0, 0.0, threads, **scales
        )

    ms = timed(aieng, repeats)
    # The same context gathered, as the pure-PyTorch path reads it: (R, H, C, D) float32.
    index = torch.from_numpy(tables.astype(np.int64))
    k = as_float(kind, c, "k")[index].reshape(requests, context, KV_HEADS, HEAD_DIM)
    v = as_float(kind, c, "v")[index].reshape(requests, context, KV_HEADS, HEAD_DIM)
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    qt = torch.from_numpy(q)[:, :, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = sdpa(qt, k, v, scale=scale)[:, :, 0, :].numpy()
    error = float(np.abs(out - want).max())
    torch_ms = timed(lambda: sdpa(qt, k, v, scale=scale), repeats)
    read = 2 * requests * context * KV_HEADS * HEAD_DIM * c["bytes"]
    if kind == "int8":
        read += 2 * requests * context * KV_HEADS * 4
    return {
        "cache": kind,
        "context": context,
        "requests": requests,
        "aieng_ms": ms * 1e3,
        "aieng_GB_s": read / ms / 1e9,
        "torch_sdpa_ms": torch_ms * 1e3,
        "max_abs_error": error,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="two cells, few repeats")
    ap.add_argument("--out", type=Path, help="write decode_attention.{json,md} here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    cells = [(kind, c, r) for kind in ("bfloat16", "float32", "int8") for c, r in
             ((512, 1), (4096, 1), (16384, 1), (4096, 4))]  # fmt: skip
    if args.quick:
        cells = [("bfloat16", 512, 1), ("int8", 4096, 1)]
    rows = []
    for kind, context, requests in cells:
        repeats = 5 if args.quick else max(10, 400 // max(1, context * requests // 1024))
        rows.append(cell(kind, context, requests, args.threads, repeats))
    info = machine(args.threads)
    lines = [
        f"decode attention, one layer of the base model's shape ({HEADS} heads, {KV_HEADS} KV "
        f"heads, head_dim {HEAD_DIM}, blocks of {BLOCK} scattered in a pool 4x the context); "
        f"{args.threads} threads; read bandwidth {bandwidth:.1f} GB/s; CPU: {info['cpu']} "
        f"({info['cpu_features']}), {info['nproc']} vCPU; torch {info['torch']}",
        "",
        "| cache | context | requests | aieng ms | aieng GB/s | of bandwidth | torch SDPA ms "
        "(gathered float32) | torch / aieng | max abs error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cache']} | {r['context']} | {r['requests']} | {r['aieng_ms']:.3f} | "
            f"{r['aieng_GB_s']:.1f} | {100 * r['aieng_GB_s'] / bandwidth:.0f}% | "
            f"{r['torch_sdpa_ms']:.3f} | {r['torch_sdpa_ms'] / r['aieng_ms']:.2f}x | "
            f"{r['max_abs_error']:.1e} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_attention.md").write_text(text + "\n")
        payload = {"machine": info, "read_bandwidth_GB_s": bandwidth, "cells": rows}
        (args.out / "decode_attention.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
