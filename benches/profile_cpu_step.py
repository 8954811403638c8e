"""Where one CPU engine step's time goes: aieng fp32 and W4A8 on the base Llama of
benches/bench_offline.py, decoding 64 requests at once and one stream (2 threads).

Each engine takes its requests (128-token random prompts, long greedy outputs), steps until
every request is decoding (prefill done), then times `--steps` decode steps with wall-clock
timers around the parts (the CPU runs synchronously, so a part's wall time is its cost):

- the engine step (`LLMEngine.step`), and inside it the Rust core's `schedule` and `update`,
  the runner (`executor.execute`), and the Python left (outputs, bookkeeping);
- inside the runner: the model forward, the logits (the LM head), sampling
  (`verify_and_sample`), and the runner's own Python (inputs, block tables);
- inside the forward: every `Linear` by projection and kernel (forward hooks), the attention
  (`attn` modules: the paged kernel and its cache write), and the rest (norms, RoPE, SiLU,
  residual adds, the embedding).

    .venv/bin/python benches/profile_cpu_step.py [--steps 16] [--out benches/results]

Writes profile_cpu_step.md/json: per configuration, milliseconds per step and share of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

import bench_cpu_peers
import bench_offline

import aieng.worker.runner
from aieng import EngineArgs, SamplingParams
from aieng.benchmarks.offline import machine
from aieng.engine.llm_engine import LLMEngine

THREADS = 2
PROMPT = 128
CONFIGS = (  # (mode, EngineArgs.cpu_quant_kernel or None for fp32, requests)
    ("fp32", None, 64),
    ("W4A8 (int8)", "int8", 64),
    ("fp32", None, 1),
    ("W4A8 (int8)", "int8", 1),
)


class Timers:
    """Seconds per named part, accumulated while `on`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed

    def hook(self, module: torch.nn.Module, name: str) -> None:
        starts: list[float] = []

        def before(*_):
            starts.append(time.perf_counter())

        def after(*_):
            start = starts.pop()
            if self.on:
                self.seconds[name] += time.perf_counter() - start

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)


class TimedCore:
    """The engine's Rust core with `schedule` and `update` timed; the rest passed through."""

    def __init__(self, core, timers: Timers) -> None:
        self._core = core
        self.schedule = timers.wrap("rust core: schedule", core.schedule)
        self.update = timers.wrap("rust core: update", core.update)

    def __getattr__(self, name: str):
        return getattr(self._core, name)


def instrument(engine: LLMEngine, timers: Timers) -> dict[str, str]:
    """Timers on the step's parts -> the Linear method of each projection."""
    from aieng.layers.linear import Linear

    runner = engine.runner
    engine.core = TimedCore(engine.core, timers)
    engine.step = timers.wrap("engine step", engine.step)
    engine.executor.execute = timers.wrap("runner (executor.execute)", engine.executor.execute)
    runner._forward = timers.wrap("model forward", runner._forward)
    runner.model.compute_logits = timers.wrap("logits", runner.model.compute_logits)
    aieng.worker.runner.verify_and_sample = timers.wrap(
        "sampling", aieng.worker.runner.verify_and_sample
    )
    methods = {}
    for name, module in runner.model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, Linear):
            methods[leaf] = type(module.method).__name__
            timers.hook(module, "LM head matmul" if leaf == "lm_head" else f"matmul {leaf}")
        elif leaf == "attn":
            timers.hook(module, "attention (paged, in place)")
    return methods


def breakdown(seconds: dict[str, float], steps: int) -> list[dict]:
    """Exclusive parts (ms per step): each timer less the timers inside it."""
    ms = {k: v / steps * 1e3 for k, v in seconds.items()}
    layer_matmuls = {k: v for k, v in ms.items() if k.startswith("matmul")}
    head = ms.get("LM head matmul", 0.0)
    attention = ms.get("attention (paged, in place)", 0.0)
    forward = ms.get("model forward", 0.0)
    logits = ms.get("logits", 0.0)
    runner = ms.get("runner (executor.execute)", 0.0)
    core = ms.get("rust core: schedule", 0.0) + ms.get("rust core: update", 0.0)
    step = ms["engine step"]
    parts = {
        **layer_matmuls,
        "attention (paged, in place)": attention,
        "model other (norms, RoPE, SiLU, adds, embedding)": forward
        - sum(layer_matmuls.values())
        - attention,
        "LM head matmul": head,
        "logits other": logits - head,
        "sampling": ms.get("sampling", 0.0),
        "runner Python (inputs, block tables)": runner - forward - logits - ms.get("sampling", 0),
        "rust core: schedule": ms.get("rust core: schedule", 0.0),
        "rust core: update": ms.get("rust core: update", 0.0),
        "engine Python (outputs, bookkeeping)": step - runner - core,
    }
    return [{"part": k, "ms_per_step": v, "share": v / step} for k, v in parts.items()] + [
        {"part": "engine step (total)", "ms_per_step": step, "share": 1.0}
    ]


def profile(model: Path, config: dict, kernel: str | None, requests: int, steps: int) -> dict:
    options = {"cpu_quant_kernel": kernel} if kernel else {}
    per_token = 2 * config["num_hidden_layers"] * config["hidden_size"] * 4  # float32 K and V
    args = EngineArgs(
        model=str(model), enable_prefix_caching=False, max_num_seqs=64,
        max_num_batched_tokens=1024, kv_cache_memory=requests * 256 * per_token, **options,
    )  # fmt: skip
    engine = LLMEngine(args)
    timers = Timers()
    sample = aieng.worker.runner.verify_and_sample
    methods = instrument(engine, timers)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(requests):
        engine.add_request(str(i), rng.integers(3, 32000, PROMPT).tolist(), params)
    while engine.last_step_num_tokens != requests or engine.core.num_running != requests:
        engine.step()  # prefill, until every request decodes one token a step
    for _ in range(2):
        engine.step()  # warm decode steps
    timers.on = True
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
        if engine.last_step_num_tokens != requests:
            raise RuntimeError("a profiled step was not a pure decode step of every request")
    wall = time.perf_counter() - start
    timers.on = False
    seconds = dict(timers.seconds)
    engine.shutdown()
    aieng.worker.runner.verify_and_sample = sample
    del engine
    rows = breakdown(seconds, steps)
    return {
        "steps": steps,
        "wall_s": wall,
        "tokens_per_s": requests * steps / wall,
        "linear_methods": methods,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--model", choices=("base", "small"), default="base", help="small: a smoke run")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    info = {**machine(THREADS), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "unset")}
    load = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder, params = bench_offline.build_checkpoint(args.model, Path(tmp) / "model")
        int4 = bench_cpu_peers.quantized_checkpoint(folder, Path(tmp) / "model-int4")
        for mode, kernel, requests in CONFIGS:
            model = folder if kernel is None else int4
            config = bench_offline.MODELS[args.model]
            result = profile(model, config, kernel, requests, args.steps)
            results.append({"mode": mode, "requests": requests, **result})
            print(mode, requests, f"{result['tokens_per_s']:.1f} tok/s", flush=True)
    load_after = os.getloadavg()
    md = [
        "# Where a CPU decode step's time goes (benches/profile_cpu_step.py)",
        "",
        f"{info['cpu']} ({info['cpu_features']}), {THREADS} threads, torch {info['torch']}, "
        f"OMP_WAIT_POLICY={info['OMP_WAIT_POLICY']}. {args.model.capitalize()} Llama "
        f"({params / 1e6:.0f}M parameters, random weights); W4A8 is its INT4 checkpoint (RTN "
        "g128, LM head too) on the int8 kernel (CpuQuantizedLinearMethod), fp32 on "
        "DenseLinearMethod (aieng's dense GEMV for few rows, torch's F.linear otherwise). "
        f"{PROMPT}-token prompts, then {args.steps} timed decode steps in which "
        "every request decodes one token. Load average (1, 5, 15 min) "
        + ", ".join(f"{x:.1f}" for x in load)
        + " at the start, "
        + ", ".join(f"{x:.1f}" for x in load_after)
        + " at the end (2 cores: above about 2, other jobs shared them); figures are one run's.",
        "",
        "Exclusive parts: each is its timer less the timers inside it (a `Linear`'s time is its "
        "kernel and the Python around it).",
        "",
    ]
    parts = list(dict.fromkeys(x["part"] for r in results for x in r["rows"]))
    header = [f"{r['mode']}, {r['requests']} req: ms (share)" for r in results]
    md += ["| part | " + " | ".join(header) + " |", "|---|" + "---|" * len(results)]
    for part in parts:
        cells = []
        for r in results:
            row = next((x for x in r["rows"] if x["part"] == part), None)
            cells.append("" if row is None else f"{row['ms_per_step']:.2f} ({row['share']:.0%})")
        md.append(f"| {part} | " + " | ".join(cells) + " |")
    md.append(
        "| decode tokens/s while profiled | "
        + " | ".join(f"{r['tokens_per_s']:.1f}" for r in results)
        + " |"
    )
    text = "\n".join(md) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_cpu_step.md").write_text(text)
    payload = {"machine": info, "load_average": [load, load_after], "results": results}
    (args.out / "profile_cpu_step.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
