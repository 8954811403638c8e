"""Offline throughput and latency: aieng's `LLM.generate` against HF transformers' `generate`.

The workload: N requests with prompt and output lengths uniform in [16, 256] (seed 0), random
token ids, greedy, ignore_eos, all arriving at once. aieng gets every request at once (continuous
batching); HF runs static batches in request order, left padded, each batch to the longest
output in it, and only each request's own output tokens count (useful tokens / wall time). A
request's latency is from the start of the run to its last token (HF: the end of its batch).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from aieng.config.engine_args import EngineArgs

HF_BATCH = 32


@dataclass
class EngineRun:
    engine: str
    tokens: int
    wall_s: float
    walls_s: list[float]
    token_ids: list[list[int]]
    latency_s: list[float] = field(default_factory=list)  # per request, end to end
    ttft_s: list[float] = field(default_factory=list)  # per request (aieng only)
    # With speculative decoding (aieng only): drafts, draft tokens, accepted tokens.
    spec_decode: dict[str, int] = field(default_factory=dict)
    # Every rep's first request: (time to its first token, its end to end latency), aieng only.
    first_request_s: list[tuple[float, float]] = field(default_factory=list)
    kv_cache_dtype: str = ""  # aieng only: the KV cache's dtype as its runner resolved it

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def summary(self) -> dict:
        out = {"tokens": self.tokens, "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s}
        for name, values in (("latency", self.latency_s), ("ttft", self.ttft_s)):
            if values:
                for q in (50, 90, 99):
                    out[f"{name}_p{q}_s"] = float(np.percentile(values, q))
        return out


def workload(
    num_requests: int, vocab: int, max_len: int = 256, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Prompts of random ids in [3, vocab) and output lengths, both uniform in [16, max_len]."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(16, max_len + 1, num_requests)
    output_lens = rng.integers(16, max_len + 1, num_requests)
    prompts = [rng.integers(3, vocab, n).tolist() for n in prompt_lens]
    return prompts, [int(n) for n in output_lens]


def run_aieng(
    engine: str | Path | EngineArgs,
    prompts: list[list[int]],
    output_lens: list[int],
    *,
    reps: int = 1,
    **engine_options,
) -> EngineRun:
    """`engine`: the EngineArgs, or a checkpoint folder run with `engine_options` and no prefix
    caching (random prompts share no prefix)."""
    from aieng import LLM, SamplingParams

    if not isinstance(engine, EngineArgs):
        engine = EngineArgs(model=str(engine), **{"enable_prefix_caching": False, **engine_options})
    llm = LLM(**dataclasses.asdict(engine))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    walls: list[float] = []
    first_request: list[tuple[float, float]] = []
    best = None
    for _ in range(reps):
        start_wall, start_clock = time.perf_counter(), time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start_wall)
        if outs[0].metrics is not None:
            m = outs[0].metrics
            first_request.append((m.first_token_time - start_clock, m.finished_time - start_clock))
        if best is None or walls[-1] <= min(walls):
            best = (outs, start_clock)
    assert best is not None
    outs, start_clock = best
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != sum(output_lens):
        raise RuntimeError(f"aieng produced {tokens} tokens, expected {sum(output_lens)}")
    latency = [o.metrics.finished_time - start_clock for o in outs if o.metrics]
    ttft = [o.metrics.first_token_time - start_clock for o in outs if o.metrics]
    stats = llm.get_stats()
    spec_decode = {
        "drafts": stats.spec_decode_num_drafts,
        "draft_tokens": stats.spec_decode_num_draft_tokens,
        "accepted_tokens": stats.spec_decode_num_accepted_tokens,
    }
    del llm
    return EngineRun(
        engine="aieng",
        tokens=tokens,
        wall_s=min(walls),
        walls_s=walls,
        token_ids=[list(o.outputs[0].token_ids) for o in outs],
        latency_s=latency,
        ttft_s=ttft,
        spec_decode=spec_decode if engine.speculative_config is not None else {},
        first_request_s=first_request,
        kv_cache_dtype=stats.kv_cache_dtype,
    )


@torch.inference_mode()
def run_hf(
    folder: str | Path, prompts: list[list[int]], output_lens: list[int], reps: int = 1
) -> EngineRun:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    model.generation_config.pad_token_id = 0

    def batch_generate(batch_prompts: list[list[int]], max_new: int) -> torch.Tensor:
        width = max(len(p) for p in batch_prompts)
        ids = torch.zeros(len(batch_prompts), width, dtype=torch.long)
        mask = torch.zeros(len(batch_prompts), width, dtype=torch.long)
        for row, p in enumerate(batch_prompts):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
        )
        return out[:, width:]

    batch_generate(prompts[:4], 4)  # warm-up
    walls: list[float] = []
    generated: list[list[int]] = []
    latency: list[float] = []
    for _ in range(reps):
        generated, rep_latency = [], []
        start = time.perf_counter()
        for lo in range(0, len(prompts), HF_BATCH):
            batch, lens = prompts[lo : lo + HF_BATCH], output_lens[lo : lo + HF_BATCH]
            new = batch_generate(batch, max(lens))
            generated += [new[row, :n].tolist() for row, n in enumerate(lens)]
            rep_latency += [time.perf_counter() - start] * len(batch)
        walls.append(time.perf_counter() - start)
        if walls[-1] <= min(walls):
            latency = rep_latency
    return EngineRun(
        engine="HF transformers",
        tokens=sum(output_lens),
        wall_s=min(walls),
        walls_s=walls,
        token_ids=generated,
        latency_s=latency,
    )


# The vector extensions that decide CPU kernel speed, quoted with every figure.
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16")


def machine(threads: int) -> dict:
    cpu, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    features = [f for f in CPU_FEATURES if f in flags]
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "cpu_features": " ".join(features) or "unknown",
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": threads,
    }


def identical_requests(a: EngineRun, b: EngineRun) -> int:
    return sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=True))
