"""End to end on the GPU, nano-vllm's benchmark shape: the Qwen3-0.6B configuration with random
weights, 256 requests, prompt and output lengths uniform in [100, 1024] (seed 0), random prompt
ids, greedy, ignore_eos, all submitted at once — output tokens/s of aieng with its CUDA kernels
(attention backend `auto`, CUDA graphs, the CUDA INT4 linear method) in bfloat16 and INT4 (RTN,
group 128, `aieng quantize`'s compressed-tensors). Goal: >= 10,000 output tokens/s in bfloat16
on an H200 (vLLM reports ~8,600 on an A800).

The peer in the same run: aieng's torch reference path (`attention_backend="torch"`,
`enforce_eager=True`) in bfloat16 on a slice of the workload (its first --slice requests; the
whole workload on the reference would not fit a device run), beside the kernels on the same slice.

It cannot report a path that did not run: after each load the engine's own report
(`ModelInfo.kernels`, the runner's decode graphs) must name what the row claims — the `cuda`
attention backend (its start-up self-check passed), every quantized layer (4 per decoder layer)
on `cuda_int4`, decode CUDA graphs captured — or the bench stops with an error; every request
must produce exactly its output length.

The checkpoint is built on the host with transformers from the configuration below (no
download) and the bundled model's tokenizer files (prompts are ids; the text is not looked at).
`--smoke`: a tiny configuration on the CPU, a few short requests, the same steps and checks
(what the CPU picks instead of the CUDA kernels); CI runs it so that the script cannot rot.
Prints a table and writes bench_gpu_e2e.{json,md} to --out (and benches/results/).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from common import NO_GPU, PathMismatch, write_results

# Qwen/Qwen3-0.6B's config.json (the fields that shape the model).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
TINY = {
    **QWEN3_0_6B,
    "vocab_size": 4096,
    "hidden_size": 128,  # group 128 divides every layer's input features
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
QUANTIZED_PER_LAYER = 4  # qkv_proj, o_proj, gate_up_proj, down_proj (the LM head stays dense)


@dataclass(frozen=True)
class Expect:
    """What the engine must report for a row; None: whatever the device picks."""

    attention: str | None
    int4_kernel: str | None  # every quantized layer's kernel
    graphs: bool


KERNELS_ON_GPU = Expect(attention="cuda", int4_kernel="cuda_int4", graphs=True)
KERNELS_ON_CPU = Expect(attention=None, int4_kernel=None, graphs=False)  # a smoke run
REFERENCE = Expect(attention="torch", int4_kernel=None, graphs=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the tables")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of every step")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt and output")
    parser.add_argument("--num-layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--slice", type=int, default=16, help="requests the reference peer runs")
    parser.add_argument("--formats", default="bfloat16,int4", help="bfloat16, int4 (comma list)")
    args = parser.parse_args(argv)
    if args.smoke:  # a few short requests through a tiny model
        args.num_requests, args.min_len, args.max_len = 6, 4, 12
        args.num_layers, args.slice = TINY["num_hidden_layers"], 3
    if not 1 <= args.slice <= args.num_requests or not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --slice <= --num-requests and 1 <= --min-len <= --max-len")
    return args


def workload(
    num_requests: int,
    min_len: int,
    max_len: int,
    vocab_size: int = QWEN3_0_6B["vocab_size"],
    seed: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's: prompt ids uniform in [0, 10000) (here from 3: no special ids, and below the
    vocabulary), prompt and output lengths uniform in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(min_len, max_len + 1, num_requests)
    output_lens = rng.integers(min_len, max_len + 1, num_requests)
    high = min(10000, vocab_size)
    prompts = [rng.integers(3, high, n).tolist() for n in prompt_lens]
    return prompts, [int(n) for n in output_lens]


def build_checkpoint(folder: Path, shape: dict, num_layers: int, device: str) -> Path:
    """Random-weight model of `shape` (bfloat16) saved with transformers, plus tokenizer files;
    the weights are drawn on `device` (a 0.6B model initialises in seconds on a GPU)."""
    import transformers

    from aieng.config.default_model import default_model_path

    config = transformers.Qwen3Config(**{**shape, "num_hidden_layers": num_layers})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_path() / name, folder / name)
    del model
    return folder


def quantized(folder: Path, out: Path) -> Path:
    from aieng.quantizer.quantize import QuantizeOptions, quantize_checkpoint

    quantize_checkpoint(folder, out, QuantizeOptions(method="rtn"), progress=None)
    return out


def linear_counts(described: str) -> Counter[str]:
    """ModelInfo.kernels' "112 cuda_int4, 1 dense" -> {"cuda_int4": 112, "dense": 1}."""
    counts: Counter[str] = Counter()
    for part in filter(None, (p.strip() for p in described.split(","))):
        count, _, kernel = part.partition(" ")
        counts[kernel] += int(count)
    return counts


def check_paths(
    kernels: dict[str, str], graphs: bool, expect: Expect, fmt: str, num_layers: int
) -> None:
    """PathMismatch unless the engine's report matches `expect` for a `fmt` checkpoint."""
    attention = kernels.get("attention_backend")
    if expect.attention is not None and attention != expect.attention:
        raise PathMismatch(
            f"attention backend {attention!r}, not {expect.attention!r}: the kernels' start-up "
            "check failed or they could not load (see the warnings above)"
        )
    counts = linear_counts(kernels.get("linear_kernels", ""))
    quantized_layers = {kernel: n for kernel, n in counts.items() if kernel != "dense"}
    if fmt == "int4":
        wanted = QUANTIZED_PER_LAYER * num_layers
        if sum(quantized_layers.values()) != wanted or len(quantized_layers) != 1:
            raise PathMismatch(
                f"linear kernels {dict(counts)}: want all {wanted} quantized layers on one kernel"
            )
        kernel = next(iter(quantized_layers))
        if expect.int4_kernel is not None and kernel != expect.int4_kernel:
            raise PathMismatch(f"quantized layers on {kernel!r}, not {expect.int4_kernel!r}")
    elif quantized_layers:
        raise PathMismatch(f"a {fmt} checkpoint with quantized layers: {dict(counts)}")
    if graphs != expect.graphs:
        raise PathMismatch(f"decode CUDA graphs {'on' if graphs else 'off'}, want the other")


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(
    folder: Path, fmt: str, path: str, prompts: list[list[int]], output_lens: list[int],
    device: str, num_layers: int,
) -> dict:  # fmt: skip
    from aieng import LLM, SamplingParams

    kernels_path = path == "kernels"
    on_gpu = device.startswith("cuda")
    expect = (KERNELS_ON_GPU if on_gpu else KERNELS_ON_CPU) if kernels_path else REFERENCE
    longest = max(len(p) for p in prompts) + max(output_lens)
    llm = LLM(
        str(folder),
        dtype="bfloat16",
        device=device,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        max_model_len=max(256, longest),
        enable_prefix_caching=False,
        attention_backend="auto" if kernels_path else "torch",
        enforce_eager=not kernels_path,
    )
    try:
        kernels = dict(llm.engine.model_info.kernels)
        graphs = llm.engine.runner.graphs is not None
        check_paths(kernels, graphs, expect, fmt, num_layers)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        llm.shutdown()
        del llm
        release_memory()  # the next engine sizes its KV cache from the memory left free
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != sum(output_lens):
        raise PathMismatch(f"produced {tokens} output tokens, expected {sum(output_lens)}")
    return {
        "format": fmt,
        "path": path,
        "requests": len(prompts),
        "attention": kernels["attention_backend"],
        "linear": kernels["linear_kernels"],
        "cuda_graphs": graphs,
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
    }


def markdown(result: dict) -> str:
    lines = [
        f"aieng end to end on {result['device']}: Qwen3-0.6B configuration ({result['layers']} "
        f"layers{', tiny smoke shape' if result['smoke'] else ''}), random weights, "
        f"{result['num_requests']} requests, prompt and output lengths uniform in "
        f"[{result['min_len']}, {result['max_len']}], seed 0, ignore_eos. Every row's kernel "
        "paths checked against the engine's report before it ran.",
        "",
        "| weights | path | requests | attention | linear | CUDA graphs | output tokens | s "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["runs"]:
        lines.append(
            f"| {row['format']} | {row['path']} | {row['requests']} | {row['attention']} "
            f"| {row['linear']} | {row['cuda_graphs']} | {row['output_tokens']} "
            f"| {row['wall_s']:.1f} | {row['tokens_per_s']:.0f} |"
        )
    if result["smoke"]:
        lines += ["", "Smoke run on the CPU: the figures mean nothing."]
    return "\n".join(lines) + "\n"


def bench(args: argparse.Namespace, device: str) -> dict:
    shape = TINY if args.smoke else QWEN3_0_6B
    prompts, lens = workload(args.num_requests, args.min_len, args.max_len, shape["vocab_size"])
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "smoke": args.smoke,
        "layers": args.num_layers,
        "num_requests": args.num_requests,
        "min_len": args.min_len,
        "max_len": args.max_len,
        "runs": [],
    }
    formats = args.formats.split(",")
    if unknown := set(formats) - {"bfloat16", "int4"}:
        raise ValueError(f"--formats: unknown {sorted(unknown)}; bfloat16 and int4 exist")
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        bf16 = build_checkpoint(Path(scratch) / "bf16", shape, args.num_layers, device)
        checkpoints = {"bfloat16": bf16}
        if "int4" in formats:
            checkpoints["int4"] = quantized(bf16, Path(scratch) / "int4")
        print(f"checkpoints built in {time.perf_counter() - start:.0f} s", flush=True)
        cases = [(fmt, "kernels", prompts, lens) for fmt in formats]
        if "bfloat16" in formats:
            head = prompts[: args.slice], lens[: args.slice]
            cases += [("bfloat16", "kernels", *head), ("bfloat16", "reference", *head)]
        for fmt, path, some_prompts, some_lens in cases:
            row = run(checkpoints[fmt], fmt, path, some_prompts, some_lens, device, args.num_layers)
            result["runs"].append(row)
            print(row, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(
            f"bench_e2e: {NO_GPU}",
            file=sys.stderr,
        )
        return 2
    try:
        result = bench(args, device)
    except PathMismatch as error:
        print(f"bench_e2e: FAILED: {error}", file=sys.stderr)
        return 1
    table = markdown(result)
    print(table)
    write_results("bench_gpu_e2e", result, table, args.out, record=not args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
