"""aieng against llama.cpp on the CPU, each engine as its own users run it.

Rules of this bench (issue 36, item 5): no environment variable that changes an engine's
behaviour is set by the bench, and those inherited from the shell that tune OpenMP, ggml or
llama.cpp (OMP_*, GOMP_*, KMP_*, MKL_*, OPENBLAS_*, GGML_*, LLAMA_*, TORCH_NUM_THREADS) are
removed from every cell's environment (listed in the results; --keep-environment passes them
on and says so). Every (engine, mode, workload) runs in a process of its own
(benches/cpu_peers_cell.py) under a time limit, which records its environment and versions.
aieng runs with its defaults (one thread per CPU, its own kernel and cache choices), the mode's
own option only; llama.cpp with its defaults (llama-cpp-python's `Llama`, f16 KV cache) but the
same thread count as aieng and a context that holds the workload.

Engines (--engines, default all):
  aieng-fp32, aieng-bf16 (dtype bfloat16), aieng-int8 (W8A8: the 8-bit checkpoint,
  cpu_quant_kernel int8), aieng-int4 (W4A8: the 4-bit checkpoint, cpu_quant_kernel int8),
  aieng-auto (the 4-bit checkpoint, nothing set); llama-F32, llama-Q8_0, llama-Q4_0 (the F32
  GGUF by llama.cpp's convert_hf_to_gguf.py, quantized by llama_model_quantize).
  Checkpoints (RTN, asymmetric, the largest group of 128/64/32, LM head too) by `aieng quantize`.
Shapes (--shapes, default all; random weights, context 4096):
  base (the 134M Llama of bench_offline.py, vocabulary 32000, untied), qwen0.5b (Qwen2.5-0.5B's
  shape: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936,
  tied), qwen1.5b (hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocabulary
  151936, tied).
Workloads (--workloads, default all):
  offline   64 requests (16 at the larger shapes), prompt and output lengths U[16, 256], greedy,
            output tokens/s (llama.cpp twice: one request at a time, and continuously batched
            in one context of up to 64 sequences, benches/llama_cpp_batched.py);
  stream    one 128-token prompt, 128 greedy tokens: decode tokens/s, median of 5;
  ttft128, ttft1024   time to the first token of a 128- and a 1024-token prompt (5 and 3 runs);
  ctx4096   one stream decoding 128 tokens after a 3968-token prompt (to 4096): decode tokens/s.
Kernel table: one-stream decode against the machine's read bandwidth (torch.sum over 256 MiB,
on 4 KiB pages and on 2 MiB pages, measured just before and just after each decode cell: the
host's memory is shared and the figure moves; the limit is the best of those four reads)
over the bytes one token reads: the weights (llama.cpp: its GGUF's tensors; aieng: the
checkpoint's linear layers and head at the mode's bytes per weight, the packed int8 layout
measured) and the KV cache at the run's mean context.

    .venv/bin/python benches/bench_cpu_peers.py --llama-site /work/llama_site \\
        --llama-cpp-src /work/llama_src/llama_cpp_python-0.3.36.tar.gz [--shapes base,...]
        [--engines ...] [--workloads ...] [--quick] [--resume] [--tag NAME] [--timeout S]

Without llama_cpp importable (--llama-site or installed) the llama.cpp cells are left out and
the results say so. --resume keeps the cells of the same --tag already measured. Results:
benches/results/bench_cpu_peers[_TAG].md and .json, written after every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import bench_offline  # noqa: E402
import cpu_peers_cell as cell  # noqa: E402

AIENG_ENGINES = {
    "aieng-fp32": "aieng fp32",
    "aieng-bf16": "aieng bf16",
    "aieng-int8": "aieng W8A8 (int8)",
    "aieng-int4": "aieng W4A8 (int8)",
    "aieng-auto": "aieng auto (INT4 checkpoint, nothing set)",
}
LLAMA_ENGINES = {"llama-F32": "F32", "llama-Q8_0": "Q8_0", "llama-Q4_0": "Q4_0"}
ENGINES = (*AIENG_ENGINES, *LLAMA_ENGINES)
WORKLOADS = tuple(cell.WORKLOADS)
QUICK_WORKLOADS = ("offline", "stream", "ttft128")
QUICK_REQUESTS = 8
CONTEXT = 4096
SHAPES = {  # name -> (LlamaConfig fields, offline requests)
    "base": (
        {**bench_offline.MODELS["base"], "vocab_size": 32000, "tie_word_embeddings": False},
        64,
    ),
    "qwen0.5b": (
        dict(
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        16,
    ),
    "qwen1.5b": (
        dict(
            hidden_size=1536,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            intermediate_size=8960,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        16,
    ),
}
# Inherited variables removed from every cell's environment (see the module docstring).
STRIPPED_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GGML_", "LLAMA_")
STRIPPED_NAMES = ("TORCH_NUM_THREADS", "PYTORCH_NUM_THREADS")


def cell_environment(keep: bool) -> tuple[dict[str, str], dict[str, str]]:
    """(the cells' environment, the variables removed from it)."""
    env = dict(os.environ)
    removed = {
        k: v for k, v in env.items() if k.startswith(STRIPPED_PREFIXES) or k in STRIPPED_NAMES
    }
    if not keep:
        for k in removed:
            del env[k]
    return env, removed


# ------------------------------------------------------------------------------ checkpoints


def build_checkpoints(shape: str, work: Path) -> dict[str, Path]:
    """fp32, int8 and int4 checkpoints of `shape` under `work` (kept for --resume)."""
    fp32, int8, int4 = work / "fp32", work / "int8", work / "int4"
    if not (fp32 / "config.json").exists():
        build_float(shape, fp32)
    for bits, out in ((8, int8), (4, int4)):
        if not (out / "config.json").exists():
            quantize(fp32, out, bits)
    return {"fp32": fp32, "int8": int8, "int4": int4}


def build_float(shape: str, folder: Path) -> None:
    """A random-weight Llama of `shape` beside bench_offline's tokenizer files (the small
    checkpoint is built for them, then its config and weights are replaced)."""
    import torch
    import transformers

    bench_offline.build_checkpoint("small", folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        max_position_embeddings=CONTEXT, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="float32", **SHAPES[shape][0],
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)


def quantize(folder: Path, out: Path, bits: int) -> None:
    from aieng.config.model_config import ModelConfig
    from aieng.quantizer.compressed_tensors_writer import QuantScheme
    from aieng.quantizer.quantize import QuantizeOptions, largest_group_size, quantize_checkpoint

    group = largest_group_size(ModelConfig.from_pretrained(folder))
    options = QuantizeOptions(
        method="rtn", scheme=QuantScheme(bits, group, symmetric=False), quantize_lm_head=True
    )
    quantize_checkpoint(folder, out, options, progress=None)


def llama_source(src: Path, work: Path) -> Path:
    """llama.cpp's source folder (vendor/llama.cpp of llama-cpp-python's sdist): `src` itself,
    or extracted from the sdist .tar.gz into `work`."""
    if src.is_dir():
        return src
    target = work / "llama_cpp_src"
    if not (target / "convert_hf_to_gguf.py").exists():
        with tarfile.open(src) as archive:
            members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name]
            archive.extractall(work / "sdist", members=members, filter="data")
        (found,) = (work / "sdist").glob("*/vendor/llama.cpp")
        found.rename(target)
    return target


def build_ggufs(fp32: Path, work: Path, src: Path, env: dict, site: str | None) -> dict:
    """F32 by llama.cpp's converter, Q8_0 and Q4_0 by llama_model_quantize (in a subprocess)."""
    import llama_cpp_peer

    f32 = work / "model-F32.gguf"
    if not f32.exists():
        llama_cpp_peer.convert(fp32, f32, src)
    paths = {"F32": f32}
    for mode in ("Q8_0", "Q4_0"):
        path = paths[mode] = work / f"model-{mode}.gguf"
        if path.exists():
            continue
        code = (
            "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import llama_cpp_peer; "
            "llama_cpp_peer.quantize(*map(__import__('pathlib').Path, sys.argv[3:5]), "
            "sys.argv[5], int(sys.argv[6]))"
        )
        args = [str(HERE), site or "", str(f32), str(path), mode, str(os.cpu_count() or 1)]
        done = subprocess.run(
            [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"llama.cpp could not quantize to {mode}: {done.stderr[-2000:]}")
    return paths


def aieng_bytes_per_weight(folder: Path) -> dict[str, float]:
    """Bytes per weight of aieng's packed int8-kernel layouts at the checkpoint's group size
    (8- and 4-bit), measured by packing a matrix; float32 and bfloat16 by their size."""
    import torch

    from aieng.config.model_config import ModelConfig
    from aieng.kernels.cpu_int8 import pack_int8_weights
    from aieng.quantizer.quantize import largest_group_size

    group = largest_group_size(ModelConfig.from_pretrained(folder))
    n, k = 256, group * 16
    scales = torch.full((n, k // group), 0.01)
    out = {"fp32": 4.0, "bf16": 2.0}
    for name, bits in (("int8", 8), ("int4", 4)):
        q = torch.randint(0, 1 << bits, (n, k), dtype=torch.int32)
        zeros = torch.full_like(scales, float(1 << (bits - 1)))
        out[name] = pack_int8_weights(q, scales, zeros, bits).nbytes / (n * k)
    out["auto"] = out["int4"]
    return out


def weights_read(shape: str) -> int:
    """Weights one decode step multiplies: every layer's linears and the LM head."""
    c = SHAPES[shape][0]
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = hidden // heads
    attention = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * c["intermediate_size"]
    return c["num_hidden_layers"] * (attention + mlp) + c["vocab_size"] * hidden


# ------------------------------------------------------------------------------------ cells


def cell_specs(args, shape: str, paths: dict, ggufs: dict | None) -> list[tuple[str, dict]]:
    requests = QUICK_REQUESTS if args.quick else SHAPES[shape][1]
    vocab = SHAPES[shape][0]["vocab_size"]
    base = {"vocab": vocab, "threads": args.threads, "quick": args.quick, "requests": requests}
    specs = []
    for engine in args.engines:
        for workload in args.workloads:
            if engine in AIENG_ENGINES:
                mode = engine.removeprefix("aieng-")
                model = str(paths[cell.AIENG_MODES[mode][0]])
                spec = {**base, "engine": "aieng", "mode": mode, "model": model}
                specs.append((f"{engine}|{workload}", {**spec, "workload": workload}))
                continue
            if ggufs is None:
                continue
            mode = LLAMA_ENGINES[engine]
            spec = {
                **base, "engine": "llama.cpp", "mode": mode, "model": str(ggufs[mode]),
                "workload": workload, "llama_site": args.llama_site,
                "gguf_py": str(args.llama_src / "gguf-py") if args.llama_src else None,
            }  # fmt: skip
            variants = ("one at a time", "batched") if workload == "offline" else (None,)
            for variant in variants:
                key = f"{engine}|{workload}" + (f"|{variant}" if variant else "")
                specs.append((key, {**spec, "variant": variant}))
    return specs


DECODE_WORKLOADS = ("stream", "ctx4096")


def run_beside_bandwidth(spec: dict, work: Path, env: dict, timeout: float) -> dict:
    """A cell; a decode cell with the machine's read bandwidth measured just before and just
    after it (its kernel-table limit: the best of the four reads, 4 KiB and 2 MiB pages)."""
    if spec["workload"] not in DECODE_WORKLOADS:
        return run_cell(spec, work, env, timeout)
    before = run_cell({"engine": "machine"}, work, env, 300)
    result = run_cell(spec, work, env, timeout)
    after = run_cell({"engine": "machine"}, work, env, 300)
    reads = [
        m.get(k)
        for m in (before, after)
        for k in ("read_bandwidth_GB_s", "read_bandwidth_2m_GB_s")
        if m.get("status") == "ok"
    ]
    result["bandwidth_beside"] = {
        "before": before,
        "after": after,
        "best_GB_s": max((r for r in reads if r), default=None),
    }
    return result


def run_cell(spec: dict, work: Path, env: dict, timeout: float) -> dict:
    spec_path, out_path = work / "cell_spec.json", work / "cell_out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    command = [sys.executable, str(HERE / "cpu_peers_cell.py"), str(spec_path), str(out_path)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "limit_s": timeout}
    if done.returncode != 0 or not out_path.exists():
        tail = (done.stderr or done.stdout)[-3000:]
        return {"status": "failed", "returncode": done.returncode, "error": tail}
    return {
        "status": "ok",
        "wall_s": time.perf_counter() - start,
        **json.loads(out_path.read_text()),
    }


# ---------------------------------------------------------------------------------- results


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def value_of(result: dict | None, workload: str) -> float | None:
    """The headline figure of a cell: tokens/s (offline, stream, ctx4096) or ms (TTFT)."""
    if not result or result.get("status") != "ok":
        return None
    if workload == "offline":
        return result.get("tokens_per_s")
    if workload.startswith("ttft"):
        return result.get("ttft_ms")
    return result.get("decode_tokens_per_s")


def status_note(result: dict | None) -> str:
    if result is None:
        return ""
    return {"timeout": "timed out", "failed": "failed"}.get(result["status"], "")


def rows_of(cells: dict) -> list[tuple[str, str, dict]]:
    """(row label, cell key prefix, {workload: result}) per engine row, in ENGINES order."""
    rows = []
    for engine in ENGINES:
        if engine in AIENG_ENGINES:
            rows.append((AIENG_ENGINES[engine], engine, {}))
        else:
            mode = LLAMA_ENGINES[engine]
            rows.append((f"llama.cpp {mode}", engine, {}))
            rows.append((f"llama.cpp {mode}, batched (offline)", engine + "|batched", {}))
    out = []
    for label, key, found in rows:
        for workload in WORKLOADS:
            if key.endswith("|batched"):
                name = key.replace("|batched", f"|{workload}|batched")
            elif workload == "offline" and key in LLAMA_ENGINES:
                name = f"{key}|offline|one at a time"
            else:
                name = f"{key}|{workload}"
            if name in cells:
                found[workload] = cells[name]
        if found:
            out.append((label, key, found))
    return out


def shape_markdown(shape: str, data: dict, bandwidth: float | None, quick: bool) -> list[str]:
    cells, model = data["cells"], data["model"]
    rows = rows_of(cells)
    heads = {
        "offline": f"offline, {model['requests']} requests: output tok/s",
        "stream": "one stream: decode tok/s",
        "ttft128": "first token, 128-token prompt: ms",
        "ttft1024": "first token, 1024-token prompt: ms",
        "ctx4096": "decode at 4096 context: tok/s",
    }
    md = [
        f"## {shape}: {model['description']}",
        "",
        "| engine | " + " | ".join(heads.values()) + " |",
        "|---|" + "---|" * len(heads),
    ]
    for label, _, found in rows:
        values = []
        for w in heads:
            note = status_note(found.get(w))
            values.append(note or fmt(value_of(found.get(w), w), 0 if w.startswith("ttft") else 1))
        md.append(f"| {label} | " + " | ".join(values) + " |")
    md += ["", *ratio_table(rows, heads), "", *kernel_table(shape, rows, bandwidth, data), ""]
    greedy = data.get("batched_greedy")
    if greedy:
        md += [
            "llama.cpp batched offline, requests whose greedy tokens equal its one-at-a-time "
            "run's: " + ", ".join(f"{k} {v}" for k, v in greedy.items()) + ".",
            "",
        ]
    if quick:
        md += ["(--quick: fewer requests and runs; a smoke run, not a result.)", ""]
    return md


def ratio_table(rows: list, heads: dict) -> list[str]:
    """aieng with nothing set, and aieng's best mode, against llama.cpp's best mode."""
    md = [
        "| workload | aieng auto (nothing set) | aieng best | llama.cpp best | auto / llama.cpp "
        "best | aieng best / llama.cpp best |",
        "|---|---|---|---|---|---|",
    ]
    for w in heads:
        lower = w.startswith("ttft")  # milliseconds: less is better
        aieng, llama = [], []
        for label, key, found in rows:
            v = value_of(found.get(w), w)
            if v is not None:
                (aieng if key.startswith("aieng") else llama).append((v, label))
        if not aieng:
            continue
        pick = min if lower else max
        best_a, best_l = pick(aieng), pick(llama) if llama else None
        auto = next((v for v, label in aieng if "auto" in label), None)

        def ratio(a, b, lower=lower):
            if a is None or b is None:
                return ""
            return f"{(b[0] / a if lower else a / b[0]):.2f}x"

        md.append(
            f"| {w} | {fmt(auto)} | {fmt(best_a[0])} ({best_a[1]}) | "
            + (f"{fmt(best_l[0])} ({best_l[1]})" if best_l else "")
            + f" | {ratio(auto, best_l)} | {ratio(best_a[0], best_l)} |"
        )
    md.append("")
    md.append("A ratio above 1 means aieng is faster (TTFT: llama.cpp's time over aieng's).")
    return md


def kernel_table(shape: str, rows: list, bandwidth: float | None, data: dict) -> list[str]:
    per_weight = data.get("aieng_bytes_per_weight", {})
    weights = weights_read(shape)
    md = [
        "Kernel table: one-stream decode against the bandwidth limit: the best read bandwidth "
        "measured just before and just after the cell (torch.sum over 256 MiB on 4 KiB and on "
        "2 MiB pages) over the bytes a token reads: weights + KV cache at the mean context"
        + (f" (cells without one: the run's first read, {bandwidth:.1f} GB/s)" if bandwidth else "")
        + ".",
        "",
        "| engine | workload | weights MB/token | KV MB/token | read GB/s beside (4 KiB / 2 MiB "
        "pages, before; after) | limit tok/s | measured tok/s | of the limit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, key, found in rows:
        for w, (prompt, output) in (("stream", (128, 128)), ("ctx4096", (4096 - 128, 128))):
            result = found.get(w)
            measured = value_of(result, w)
            if measured is None or key.endswith("|batched"):
                continue
            if key.startswith("aieng"):
                wbytes = weights * per_weight.get(key.removeprefix("aieng-"), 0.0)
            else:
                wbytes = result.get("weight_bytes_per_token", 0)
            kv = result.get("kv_bytes_per_token", 0) * (prompt + output / 2)
            beside = result.get("bandwidth_beside") or {}
            read = beside.get("best_GB_s") or bandwidth
            if not wbytes or not read:
                continue
            limit = read * 1e9 / (wbytes + kv)
            md.append(
                f"| {label} | {w} | {wbytes / 1e6:.1f} | {kv / 1e6:.1f} | {reads_text(beside)} | "
                f"{limit:.1f} | {measured:.1f} | {measured / limit:.0%} |"
            )
    return md if len(md) > 4 else []


def reads_text(beside: dict) -> str:
    """ "a / b; c / d" for the reads before and after a cell (4 KiB / 2 MiB pages)."""
    parts = []
    for when in ("before", "after"):
        m = beside.get(when) or {}
        if m.get("status") != "ok":
            continue
        parts.append(
            f"{fmt(m.get('read_bandwidth_GB_s'))} / {fmt(m.get('read_bandwidth_2m_GB_s'))}"
        )
    return "; ".join(parts) or "(not measured beside)"


def markdown(result: dict) -> str:
    m = result["machine"]
    env = result["environment"]
    lines = [
        "# aieng against llama.cpp on the CPU, each with its defaults (benches/bench_cpu_peers.py)",
        "",
        f"{m['cpu']}, {m['nproc']} CPUs; {result['threads']} threads for each engine (aieng's "
        f"default: one per CPU; llama.cpp given the same); Python {m['python']}; aieng "
        f"{m.get('aieng', '?')}, torch {m.get('torch', '?')}; llama-cpp-python "
        f"{m.get('llama_cpp_python') or 'not available'}. Read bandwidth "
        f"{fmt(result.get('read_bandwidth_GB_s'))} GB/s. No environment variable set by the "
        "bench; "
        + (
            "removed from the cells' environment: "
            + ", ".join(f"{k}={v}" for k, v in env["removed"].items())
            if env["removed"] and not env["kept"]
            else "inherited and KEPT (not the engines' defaults): "
            + ", ".join(f"{k}={v}" for k, v in env["removed"].items())
            if env["removed"]
            else "none inherited that tunes either engine"
        )
        + ". Every cell's own environment and versions are in the JSON.",
        "",
    ]
    for shape, data in result["shapes"].items():
        lines += shape_markdown(shape, data, result.get("read_bandwidth_GB_s"), result["quick"])
    return "\n".join(lines)


def machine_info() -> dict:
    from aieng.benchmarks.offline import machine

    info = machine(os.cpu_count() or 1)
    info["python"] = platform.python_version()
    try:
        import aieng

        info["aieng"] = aieng.__version__
    except ImportError:
        pass
    return info


def llama_version(site: str | None, env: dict) -> str | None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import llama_cpp; "
        "print(llama_cpp.__version__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, site or ""], env=env, capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else None


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    listed = lambda known: lambda text: checked_list(text, known)  # noqa: E731
    ap.add_argument("--engines", type=listed(ENGINES), default=list(ENGINES))
    ap.add_argument("--workloads", type=listed(WORKLOADS), default=None)
    ap.add_argument("--shapes", type=listed(tuple(SHAPES)), default=list(SHAPES))
    ap.add_argument("--quick", action="store_true", help="8 requests, one run each: a smoke run")
    ap.add_argument("--resume", action="store_true", help="keep cells already measured")
    ap.add_argument("--tag", default="", help="results go to bench_cpu_peers_TAG.*")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per cell")
    ap.add_argument("--llama-site", default=None, help="a folder where llama_cpp is installed")
    ap.add_argument(
        "--llama-cpp-src", type=Path, default=None,
        help="llama-cpp-python's sdist (.tar.gz) or its vendor/llama.cpp folder (the converter)",
    )  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path("/tmp/aieng_cpu_peers"))
    ap.add_argument("--keep-environment", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    args.workloads = args.workloads or list(QUICK_WORKLOADS if args.quick else WORKLOADS)
    args.timeout = args.timeout or (600.0 if args.quick else 3600.0)
    args.threads = os.cpu_count() or 1  # aieng's default (worker/device.py cpu_threads)
    args.llama_src = None
    return args


def checked_list(text: str, known: tuple[str, ...]) -> list[str]:
    names = [t for t in text.split(",") if t]
    if unknown := [n for n in names if n not in known]:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {', '.join(known)}")
    return names


def main() -> None:
    args = parse_args()
    env, removed = cell_environment(args.keep_environment)
    stem = "bench_cpu_peers" + (f"_{args.tag}" if args.tag else "")
    json_path = args.out / f"{stem}.json"
    previous = json.loads(json_path.read_text()) if args.resume and json_path.exists() else {}
    info = machine_info()
    info["llama_cpp_python"] = llama_version(args.llama_site, env)
    result = {
        "machine": info,
        "threads": args.threads,
        "quick": args.quick,
        "environment": {"removed": removed, "kept": args.keep_environment},
        "read_bandwidth_GB_s": previous.get("read_bandwidth_GB_s"),
        "shapes": previous.get("shapes", {}),
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        json_path.write_text(json.dumps(result, indent=1))
        (args.out / f"{stem}.md").write_text(markdown(result))

    args.work.mkdir(parents=True, exist_ok=True)
    if not result["read_bandwidth_GB_s"]:
        bw = run_cell({"engine": "machine"}, args.work, env, 300)
        result["read_bandwidth_GB_s"] = bw.get("read_bandwidth_GB_s")
    llama = info["llama_cpp_python"] is not None and args.llama_cpp_src is not None
    if not llama:
        print(
            "llama.cpp cells left out: llama_cpp not importable or no --llama-cpp-src", flush=True
        )
    for shape in args.shapes:
        work = args.work / shape
        work.mkdir(parents=True, exist_ok=True)
        print(f"{shape}: checkpoints in {work}", flush=True)
        paths = build_checkpoints(shape, work)
        ggufs = None
        if llama:
            args.llama_src = llama_source(args.llama_cpp_src, args.work)
            ggufs = build_ggufs(paths["fp32"], work, args.llama_src, env, args.llama_site)
        requests = QUICK_REQUESTS if args.quick else SHAPES[shape][1]
        data = result["shapes"].setdefault(shape, {"cells": {}})
        data["model"] = {
            **SHAPES[shape][0],
            "requests": requests,
            "description": describe(shape, requests),
        }
        data["aieng_bytes_per_weight"] = aieng_bytes_per_weight(paths["fp32"])
        for key, spec in cell_specs(args, shape, paths, ggufs):
            done = data["cells"].get(key)
            if args.resume and done and done.get("status") == "ok":
                continue
            print(f"  {key} ...", flush=True)
            data["cells"][key] = run_beside_bandwidth(spec, args.work, env, args.timeout)
            print(f"  {key}: {summary(data['cells'][key])}", flush=True)
            data["batched_greedy"] = batched_greedy(data["cells"])
            save()
    save()
    print((args.out / f"{stem}.md").read_text())


def describe(shape: str, requests: int) -> str:
    c = SHAPES[shape][0]
    params = weights_read(shape) + (
        0 if c["tie_word_embeddings"] else c["vocab_size"] * c["hidden_size"]
    )
    return (
        f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} heads, {c['num_key_value_heads']} KV heads, intermediate "
        f"{c['intermediate_size']}, vocabulary {c['vocab_size']}, "
        + ("tied" if c["tie_word_embeddings"] else "untied")
        + f" (about {params / 1e6:.0f}M weights), random weights"
    )


def summary(result: dict) -> str:
    if result["status"] != "ok":
        return result["status"] + (
            f": {result.get('error', '')[-300:]}" if "error" in result else ""
        )
    keys = ("tokens_per_s", "decode_tokens_per_s", "ttft_ms", "cell_s")
    return ", ".join(f"{k} {result[k]:.1f}" for k in keys if isinstance(result.get(k), float))


def batched_greedy(cells: dict) -> dict[str, str]:
    """Per llama.cpp mode: batched requests whose greedy tokens equal the one-at-a-time run's."""
    out = {}
    for engine, mode in LLAMA_ENGINES.items():
        one = cells.get(f"{engine}|offline|one at a time", {})
        batched = cells.get(f"{engine}|offline|batched", {})
        if one.get("status") == "ok" and batched.get("status") == "ok":
            pairs = list(zip(one["token_ids"], batched["token_ids"], strict=True))
            out[mode] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return out


if __name__ == "__main__":
    main()
