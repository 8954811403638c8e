"""Instructions of one native-decoder prefill step, counted by valgrind's callgrind: unlike a
timing on a shared machine, a count is the same from run to run.

The decoder is the "base" shape of benches/bench_offline.py (hidden 768, 12 layers, 12 heads,
intermediate 2048, vocabulary 32000), built straight from numpy arrays (no torch): random
4-bit weights in groups of 128 on the `int8` kernel (W4A8), or `--kernel int8x2`, a float32 KV
cache. A driver runs one step, a prompt of `--tokens` tokens (default 512) on one thread, under
callgrind collecting only inside `CpuDecoder.step`. Printed: the step's instructions and, of
them, the inclusive counts of the norm and quantize kernels (`add_rms_norm`, `quantize_rows`,
`rms_norm_quantize`). valgrind has no AVX-512, so the kernels run their AVX2 paths here.

`--core DIR` counts another build: DIR is put first on the driver's PYTHONPATH (a copy of
python/ holding another `aieng/_core.abi3.so`, e.g. the commit before a change).

    .venv/bin/python benches/native_prefill_instructions.py [--tokens 512] [--kernel int8]
        [--core DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SHAPE = dict(hidden=768, layers=12, heads=12, intermediate=2048, vocab=32000)
GROUP = 128
BLOCK_SIZE = 16
FUNCTIONS = (
    "_core::kernels::elementwise::add_rms_norm",
    "_core::kernels::quantize::quantize_rows",
    "_core::kernels::norm_quantize::rms_norm_quantize",
)


def drive(tokens: int, kernel: str) -> None:
    """Builds the decoder and runs one prefill step of `tokens` tokens on one thread."""
    import numpy as np

    from aieng import _core

    rng = np.random.default_rng(0)
    hidden, inter, vocab = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["vocab"]
    heads, d = SHAPE["heads"], SHAPE["hidden"] // SHAPE["heads"]

    def packed(n: int, k: int) -> tuple:
        q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        scales = (0.02 * rng.random((n, k // GROUP)) + 0.01).astype(np.float32)
        zeros = np.full((n, k // GROUP), 8.0, np.float32)
        return _core.Int8Weights(q, scales, zeros, 4), None, kernel == "int8x2"

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    layers = [
        {
            "input_norm": norm(),
            "post_attention_norm": norm(),
            "qkv": packed(3 * hidden, hidden),
            "o": packed(hidden, hidden),
            "gate_up": packed(2 * inter, hidden),
            "down": packed(hidden, inter),
            "window": None,
            "rope": 0,
        }
        for _ in range(SHAPE["layers"])
    ]
    positions = np.arange(tokens, dtype=np.float32)[:, None]
    angles = positions / 10000.0 ** (np.arange(0, d, 2, dtype=np.float32) / d)
    ropes = [(np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))]
    table = np.tile(rng.standard_normal((1000, hidden)).astype(np.float32), (vocab // 1000, 1))
    config = {
        "hidden": hidden,
        "heads": heads,
        "kv_heads": heads,
        "head_dim": d,
        "intermediate": inter,
        "vocab": vocab,
        "eps": 1e-6,
        "attention_scale": d**-0.5,
        "attention_softcap": None,
        "final_softcap": None,
        "embedding_scale": 1.0,
        "residual_scale": 1.0,
        "logits_scale": 1.0,
        "activation": "silu",
        "norms": "pre",
        "qk_norm_per_head": True,
    }
    head = (np.ascontiguousarray(table), None, False)
    decoder = _core.CpuDecoder(config, table, layers, norm(), head, ropes)
    blocks = -(-tokens // BLOCK_SIZE)
    caches = _core.CpuKvCaches(
        [
            tuple(np.zeros((blocks, BLOCK_SIZE, heads, d), np.float32) for _ in range(2))
            for _ in range(SHAPE["layers"])
        ]
    )
    ids = rng.integers(0, vocab, tokens, dtype=np.int32)
    hidden_out = np.zeros((tokens, hidden), np.float32)
    logits = np.zeros((1, vocab), np.float32)
    decoder.step(
        ids,
        np.arange(tokens, dtype=np.int32),
        np.arange(tokens, dtype=np.int32),
        np.array([0, tokens], np.int32),
        np.array([tokens], np.int32),
        np.arange(blocks, dtype=np.int32)[None, :],
        np.array([tokens - 1], np.int32),
        caches,
        hidden_out,
        logits,
        1,
    )
    assert np.isfinite(logits).all()


def count(args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    python = [str(Path(args.core).resolve())] if args.core else []
    python.append(str(HERE.parent / "python"))
    env["PYTHONPATH"] = os.pathsep.join([*python, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        command = [
            "valgrind", "--tool=callgrind", "--collect-atstart=no",
            "--toggle-collect=*PyCpuDecoder::__pymethod_step__*",
            f"--callgrind-out-file={out}",
            sys.executable, __file__, "--drive",
            "--tokens", str(args.tokens), "--kernel", args.kernel,
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True, capture_output=True)
        annotate = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    total = re.search(r"^([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", annotate, re.M)
    if total is None:
        raise SystemExit(f"no program total in callgrind_annotate's output:\n{annotate[:2000]}")
    counts = {"step": int(total.group(1).replace(",", ""))}
    for name in FUNCTIONS:
        line = re.search(rf"^\s*([\d,]+) \([^)]*\)\s+\S*:{re.escape(name)}(?: |$)", annotate, re.M)
        counts[name.rsplit("::", 1)[1]] = int(line.group(1).replace(",", "")) if line else 0
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--kernel", choices=("int8", "int8x2"), default="int8")
    ap.add_argument("--core", help="a python/ folder whose aieng/_core.abi3.so to count")
    ap.add_argument("--out", help="also write the counts as JSON here")
    ap.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        drive(args.tokens, args.kernel)
        return
    counts = count(args)
    label = args.core or "this checkout"
    print(f"native decoder, base shape, W4A8 `{args.kernel}`, one {args.tokens}-token prefill "
          f"step on 1 thread ({label}): instructions (callgrind, inclusive)")  # fmt: skip
    for name, value in counts.items():
        print(f"  {name:<20} {value:>16,}")
    if args.out:
        Path(args.out).write_text(json.dumps({"core": label, **vars(args), **counts}, indent=1))


if __name__ == "__main__":
    main()
