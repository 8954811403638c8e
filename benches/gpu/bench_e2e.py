"""End to end on the GPU, nano-vllm's benchmark shape: the Qwen3-0.6B configuration with random
weights, 256 requests, prompt and output lengths uniform in [100, 1024] (seed 0), random prompt
ids, greedy, ignore_eos, all submitted at once — output tokens/s of aieng with its CUDA kernels
(attention backend `auto`, CUDA graphs, the CUDA INT4 linear method) against aieng's torch
reference path (`attention_backend="torch"`, `enforce_eager=True`, INT4 dequantize-then-matmul)
in the same run, bfloat16 and INT4 (RTN, group 128, `aieng quantize`'s compressed-tensors).
Goal: >= 10,000 output tokens/s in bfloat16 on an H200 (vLLM reports ~8,600 on an A800).

The checkpoint is built on the host with transformers from the configuration below (no
download) and the bundled model's tokenizer files (prompts are ids; the text is not looked at).
Prints a table and writes bench_gpu_e2e.{json,md} to --out and to benches/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
RESULTS = Path(__file__).resolve().parents[1] / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the tables")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt and output")
    parser.add_argument("--num-layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run")
    parser.add_argument(
        "--paths", default="kernels,reference", help="comma-separated: kernels, reference"
    )
    parser.add_argument(
        "--formats", default="bfloat16,int4", help="comma-separated: bfloat16, int4"
    )
    return parser.parse_args(argv)


def workload(num_requests: int, min_len: int, max_len: int, seed: int = 0):
    """nano-vllm's: prompt ids uniform in [0, 10000) (here from 3: no special ids), prompt and
    output lengths uniform in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(min_len, max_len + 1, num_requests)
    output_lens = rng.integers(min_len, max_len + 1, num_requests)
    prompts = [rng.integers(3, 10000, n).tolist() for n in prompt_lens]
    return prompts, [int(n) for n in output_lens]


def build_checkpoint(folder: Path, num_layers: int) -> Path:
    """Random-weight Qwen3-0.6B (bfloat16) saved with transformers, plus tokenizer files."""
    import transformers

    from aieng.models.default import default_model_path

    config = transformers.Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": num_layers})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_path() / name, folder / name)
    return folder


def quantized(folder: Path, out: Path) -> Path:
    from aieng.quantization.quantize import QuantizeOptions, quantize_checkpoint

    quantize_checkpoint(folder, out, QuantizeOptions(method="rtn"), progress=None)
    return out


def reference_linear_methods() -> contextlib.AbstractContextManager:
    """INT4 layers on the torch reference (dequantize, then matmul) instead of the kernels."""
    from aieng.quantization import methods
    from aieng.quantization.linear_method import QuantizedLinearMethod

    return mock.patch.object(methods, "CudaInt4LinearMethod", QuantizedLinearMethod)


def run(folder: Path, kernels: bool, prompts, output_lens, device: str) -> dict:
    from aieng import LLM, SamplingParams
    from aieng.quantization.methods import describe_linear_kernels

    options = dict(
        dtype="bfloat16",
        device=device,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        max_model_len=4096,
        enable_prefix_caching=False,
        attention_backend="auto" if kernels else "torch",
        enforce_eager=not kernels,
    )
    with contextlib.nullcontext() if kernels else reference_linear_methods():
        llm = LLM(str(folder), **options)
    runner = llm.engine.runner
    engine = {
        "attention": runner.attention.name,
        "linear": describe_linear_kernels(runner.model) or "dense",
        "cuda_graphs": runner.graphs is not None,
    }
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != sum(output_lens):
        raise RuntimeError(f"produced {tokens} output tokens, expected {sum(output_lens)}")
    del llm, runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {**engine, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def markdown(result: dict) -> str:
    lines = [
        f"aieng end to end on {result['device']}: Qwen3-0.6B configuration ({result['layers']} "
        f"layers), random weights, {result['num_requests']} requests, prompt and output lengths "
        f"uniform in [{result['min_len']}, {result['max_len']}], seed 0, ignore_eos",
        "",
        "| weights | path | attention | linear | CUDA graphs | output tokens | s | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["runs"]:
        lines.append(
            f"| {row['format']} | {row['path']} | {row['attention']} | {row['linear']} | "
            f"{row['cuda_graphs']} | {row['output_tokens']} | {row['wall_s']:.1f} | "
            f"{row['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_e2e: needs an NVIDIA GPU (CUDA); nothing measured", file=sys.stderr)
        return 2
    prompts, output_lens = workload(args.num_requests, args.min_len, args.max_len)
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else args.device,
        "layers": args.num_layers,
        "num_requests": args.num_requests,
        "min_len": args.min_len,
        "max_len": args.max_len,
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        checkpoints = {"bfloat16": build_checkpoint(Path(scratch) / "bf16", args.num_layers)}
        formats = args.formats.split(",")
        if "int4" in formats:
            checkpoints["int4"] = quantized(checkpoints["bfloat16"], Path(scratch) / "int4")
        for fmt in formats:
            for path in args.paths.split(","):
                row = run(checkpoints[fmt], path == "kernels", prompts, output_lens, args.device)
                result["runs"].append({"format": fmt, "path": path, **row})
                print(result["runs"][-1], flush=True)
    table = markdown(result)
    print(table)
    recorded = RESULTS if args.device.startswith("cuda") else None  # a CPU smoke run: --out only
    for folder in filter(None, (args.out, recorded)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "bench_gpu_e2e.json").write_text(json.dumps(result, indent=1))
        (folder / "bench_gpu_e2e.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
