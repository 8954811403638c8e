"""llama.cpp as the peer of benches/bench_cpu_peers.py, through llama-cpp-python (built from its
source distribution with CMAKE_ARGS="-DGGML_NATIVE=ON"; not a dependency of aieng).

A checkpoint goes to GGUF with llama.cpp's own `convert_hf_to_gguf.py` from that source
distribution (`--llama-cpp-src`: its vendor/llama.cpp folder) — tensors, hyper-parameters and
layout as llama.cpp writes them; only the vocabulary is replaced by placeholder tokens of the
checkpoint's size, since the benchmark models' WordLevel tokenizer is not one llama.cpp knows and
both engines are fed token ids. F32 is then quantized with `llama_model_quantize` to Q8_0 and
Q4_0. Generation is greedy over token ids, either one request after another (`Llama.generate`,
the high-level API) or with continuous batching through the low-level API (`run_batched`): one
context with a KV stream per sequence (`n_seq_max` slots, `kv_unified` off), every step one
`llama_batch` holding each running sequence's last token and chunks of waiting prompts, as
llama.cpp's own `parallel` example schedules them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

CONVERT = """
import sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion.llama import LlamaModel
import convert_hf_to_gguf

def set_vocab(self):
    size = self.hparams["vocab_size"]
    writer = self.gguf_writer
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(size)])
    writer.add_token_scores([0.0] * size)
    writer.add_token_types([3 if i < 4 else 1 for i in range(size)])
    writer.add_unk_token_id(3)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

LlamaModel.set_vocab = set_vocab
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "f32"]
convert_hf_to_gguf.main()
"""

FTYPES = {"Q8_0": 7, "Q4_0": 2}  # llama_ftype: LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_0


def convert(folder: Path, out: Path, llama_cpp_src: Path) -> Path:
    """The checkpoint -> an F32 GGUF by llama.cpp's converter."""
    command = [sys.executable, "-c", CONVERT, str(llama_cpp_src), str(folder), str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return out


def quantize(source: Path, out: Path, ftype: str, threads: int) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {ftype} failed")
    return out


def load(gguf: Path, threads: int, context: int):
    """llama-cpp-python's `Llama` with its defaults but the thread count and the context
    (n_batch 512 is its default too)."""
    from llama_cpp import Llama

    return Llama(
        model_path=str(gguf),
        n_ctx=context,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def generate(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens (EOS ignored) -> (tokens, seconds to the first one)."""
    llm.reset()  # no reuse of the previous request's prefix: every prompt is evaluated whole
    start = time.perf_counter()
    tokens, first = [], 0.0
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        if not tokens:
            first = time.perf_counter() - start
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return tokens, first


def run_requests(llm, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """Every request in turn -> output tokens/s and each request's tokens."""
    generate(llm, prompts[0][:8], 4)  # warm-up
    start = time.perf_counter()
    token_ids = [generate(llm, p, n)[0] for p, n in zip(prompts, output_lens, strict=True)]
    wall = time.perf_counter() - start
    tokens = sum(map(len, token_ids))
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "token_ids": token_ids}
