"""One cell of benches/bench_cpu_peers.py: one engine, one mode, one workload, in a process of
its own (the parent starts it with a time limit and reads the JSON it writes).

    python benches/cpu_peers_cell.py SPEC.json OUT.json

SPEC: {"engine": "aieng" | "llama.cpp" | "machine", "mode": ..., "model": checkpoint folder or
GGUF file, "workload": a key of WORKLOADS, "vocab": ..., "threads": ..., "quick": bool,
"llama_site": folder or null}. Nothing here sets an environment variable or a thread policy:
aieng runs with its defaults (only the mode's own options: dtype, cpu_quant_kernel), llama.cpp
with its defaults but the thread count (aieng's: one thread per CPU) and a context that holds
the workload. The cell records the variables of its environment that tune either engine's
threads or kernels (none should be set) and both engines' versions.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Variables that change how torch's OpenMP, llama.cpp's ggml or aieng run: recorded per cell.
TUNING_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GGML_", "LLAMA_", "AIENG_")
TUNING_NAMES = ("TORCH_NUM_THREADS", "PYTORCH_NUM_THREADS", "LD_PRELOAD")

# workload -> (prompt tokens, output tokens, runs, runs with --quick); offline: see offline().
WORKLOADS = {
    "offline": None,
    "stream": (128, 128, 5, 1),
    "ttft128": (128, 1, 5, 1),
    "ttft1024": (1024, 1, 3, 1),
    "ctx4096": (4096 - 128, 128, 2, 1),
}
# aieng mode -> (checkpoint: "fp32" | "int8" | "int4", EngineArgs options)
AIENG_MODES = {
    "fp32": ("fp32", {}),
    "bf16": ("fp32", {"dtype": "bfloat16"}),
    "int8": ("int8", {"cpu_quant_kernel": "int8"}),  # W8A8
    "int4": ("int4", {"cpu_quant_kernel": "int8"}),  # W4A8
    "auto": ("int4", {}),  # the INT4 checkpoint, nothing set
}
BATCHED_SEQUENCES = 64  # llama.cpp batched offline: sequences one context decodes together


def tuning_environment() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k.startswith(TUNING_PREFIXES) or k in TUNING_NAMES
    }


def offline_requests(spec: dict) -> tuple[list[list[int]], list[int]]:
    from aieng.benchmarks.offline import workload

    return workload(spec["requests"], spec["vocab"])


def stream_prompt(length: int, vocab: int) -> list[int]:
    """Random ids in [3, min(vocab, 32000)), the same for every engine (seed 1)."""
    import numpy as np

    return np.random.default_rng(1).integers(3, min(vocab, 32000), length).tolist()


def runs_of(spec: dict) -> tuple[int, int, int]:
    prompt, output, runs, quick_runs = WORKLOADS[spec["workload"]]
    return prompt, output, quick_runs if spec["quick"] else runs


def stream_summary(firsts: list[float], decodes: list[float | None]) -> dict:
    out = {"ttft_ms": statistics.median(firsts) * 1e3, "ttft_trials_ms": [f * 1e3 for f in firsts]}
    if all(d is not None for d in decodes):
        out["decode_tokens_per_s"] = statistics.median(decodes)
        out["decode_trials"] = decodes
    return out


# ------------------------------------------------------------------------------------ aieng


def aieng_cell(spec: dict) -> dict:
    import torch

    import aieng
    from aieng.benchmarks.offline import run_aieng

    _, options = AIENG_MODES[spec["mode"]]
    info = {
        "aieng": getattr(aieng, "__version__", "unknown"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "options": options,
    }
    if spec["workload"] == "offline":
        prompts, output_lens = offline_requests(spec)
        run = run_aieng(spec["model"], prompts, output_lens, **options)
        return {
            **info,
            "tokens": run.tokens,
            "wall_s": run.wall_s,
            "tokens_per_s": run.tokens_per_s,
        }
    prompt_len, output, runs = runs_of(spec)
    prompt = stream_prompt(prompt_len, spec["vocab"])
    run = run_aieng(spec["model"], [prompt], [output], reps=runs, **options)
    firsts = [first for first, _ in run.first_request_s]
    decodes = [
        (output - 1) / (end - first) if output > 1 else None for first, end in run.first_request_s
    ]
    return {**info, **stream_summary(firsts, decodes), **aieng_cache(spec, options, run)}


def aieng_cache(spec: dict, options: dict, run) -> dict:
    """The KV cache aieng ran with these options (`run.kv_cache_dtype`, as its runner resolved
    `auto`): its dtype and bytes per token of context."""
    from aieng.config.engine_args import EngineArgs
    from aieng.config.engine_config import create_engine_config
    from aieng.worker.kv_cache import KVCacheSpec

    try:
        config = create_engine_config(EngineArgs(model=spec["model"], **options))
        cache = config.cache
        model_dtype = str(config.torch_dtype).removeprefix("torch.")
        resolved = "auto" if run.kv_cache_dtype == model_dtype else run.kv_cache_dtype
        kv = KVCacheSpec.for_model(config.model, cache.block_size, config.torch_dtype, resolved)
        return {
            "kv_cache_dtype": kv.cache_dtype,
            "kv_bytes_per_token": kv.block_bytes // kv.block_size,
        }
    except Exception as error:  # the figure is optional: its absence is recorded, not fatal
        return {"kv_cache_error": f"{type(error).__name__}: {error}"}


# ------------------------------------------------------------------------------- llama.cpp


def llama_cell(spec: dict) -> dict:
    import llama_cpp
    import llama_cpp_peer

    threads = spec["threads"]
    info = {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_module": llama_cpp.__file__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "n_threads": threads,
        **gguf_bytes(Path(spec["model"]), spec.get("gguf_py")),
    }
    if spec["workload"] == "offline":
        return {**info, **llama_offline(spec, threads)}
    prompt_len, output, runs = runs_of(spec)
    llm = llama_cpp_peer.load(Path(spec["model"]), threads, context_for(prompt_len + output))
    prompt = stream_prompt(prompt_len, spec["vocab"])
    llama_cpp_peer.generate(llm, prompt[:8], 2)  # warm-up
    firsts, decodes = [], []
    for _ in range(runs):
        start = time.perf_counter()
        tokens, first = llama_cpp_peer.generate(llm, prompt, output)
        wall = time.perf_counter() - start
        firsts.append(first)
        decodes.append((len(tokens) - 1) / (wall - first) if output > 1 else None)
    kv = {"kv_cache_dtype": "f16 (llama.cpp's default)", "kv_bytes_per_token": kv_f16_bytes(llm)}
    return {**info, **stream_summary(firsts, decodes), **kv}


def context_for(tokens: int) -> int:
    """llama.cpp's context: the workload's tokens, rounded up to 256 (its default is 512)."""
    return max(512, -(-tokens // 256) * 256)


def kv_f16_bytes(llm) -> int:
    """Bytes of K and V per token of context in an f16 cache (llama.cpp's default type)."""
    meta = llm.metadata
    arch = meta.get("general.architecture", "llama")
    layers = int(meta[f"{arch}.block_count"])
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta[f"{arch}.embedding_length"]) // heads
    return 2 * layers * kv_heads * head_dim * 2


def llama_offline(spec: dict, threads: int) -> dict:
    import llama_cpp_batched
    import llama_cpp_peer

    prompts, output_lens = offline_requests(spec)
    path = Path(spec["model"])
    if spec["variant"] == "one at a time":
        llm = llama_cpp_peer.load(path, threads, context_for(max(map(len, prompts)) + 256))
        run = llama_cpp_peer.run_requests(llm, prompts, output_lens)
    else:
        slots = min(BATCHED_SEQUENCES, len(prompts))
        run = llama_cpp_batched.run_batched(path, prompts, output_lens, threads, slots)
        run["sequences"] = slots
    return {k: v for k, v in run.items() if k != "token_ids"} | {"token_ids": run["token_ids"]}


def gguf_bytes(path: Path, gguf_py: str | None) -> dict:
    """Bytes of the weights one decode step reads, from the GGUF's own tensor table (read by
    llama.cpp's gguf-py, folder `gguf_py`): every tensor but the token embedding (a lookup)
    unless the output layer is that same tensor."""
    if gguf_py:
        sys.path.insert(0, gguf_py)
    try:
        from gguf import GGUFReader
    except ImportError:
        return {}
    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    embed = sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0
    return {"weight_bytes_per_token": sum(sizes.values()) - embed}


# --------------------------------------------------------------------------------- machine


def machine_cell(spec: dict) -> dict:
    """The machine's read bandwidth, the limit one-stream decode streams its weights at:
    torch.sum (its default threads) over 256 MiB, best of 5, on ordinary 4 KiB pages and on
    memory advised for 2 MiB pages (`MADV_HUGEPAGE`; how much of it the kernel backed with huge
    pages is recorded). The parent runs this beside every decode cell: the host's memory is
    shared, so the figure moves between minutes."""
    import torch

    size = 256 << 20
    ordinary = torch.randn(size // 4)
    huge, huge_bytes = huge_page_tensor(size)
    return {
        "read_bandwidth_GB_s": best_sum_rate(ordinary),
        "read_bandwidth_2m_GB_s": best_sum_rate(huge),
        "huge_page_bytes": huge_bytes,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def huge_page_tensor(size: int):
    """A float32 tensor of `size` bytes on anonymous memory advised for huge pages, filled, and
    the bytes of it the kernel backed with huge pages (AnonHugePages of the mapping)."""
    import mmap

    import torch

    align = 2 << 20
    region = mmap.mmap(-1, size + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(region)
    start = (-address_of(view)) % align
    region.madvise(mmap.MADV_HUGEPAGE, start, size)
    tensor = torch.frombuffer(view[start : start + size], dtype=torch.float32)
    tensor.normal_()
    base = address_of(view) + start
    return tensor, anon_huge_bytes(base, size)


def address_of(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def anon_huge_bytes(base: int, size: int) -> int | None:
    """AnonHugePages of the mapping holding [base, base + size), from /proc/self/smaps."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= base < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None


def best_sum_rate(tensor) -> float:
    tensor.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        tensor.sum()
        best = min(best, time.perf_counter() - start)
    return tensor.numel() * tensor.element_size() / best / 1e9


def main() -> None:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    if spec.get("llama_site"):
        sys.path.insert(0, spec["llama_site"])
    header = {
        "environment": tuning_environment(),
        "python": platform.python_version(),
        "pid": os.getpid(),
        "load_average_before": os.getloadavg(),
    }
    start = time.perf_counter()
    run = {"aieng": aieng_cell, "llama.cpp": llama_cell, "machine": machine_cell}[spec["engine"]]
    result = run(spec)
    result = {**header, **result, "cell_s": time.perf_counter() - start}
    result["load_average_after"] = os.getloadavg()
    out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
