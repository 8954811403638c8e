"""Structured outputs: the cost of JSON-schema constraints on throughput.

32 concurrent requests on the bundled default model, each constrained by a JSON schema
(llguidance masks computed in the Rust core on a worker thread while the model runs, applied
in the sampler), against the same 32 prompts unconstrained with the same output lengths (each
unconstrained request gets max_tokens = its constrained twin's output length and ignore_eos,
so both runs generate exactly the same number of tokens per request). Output tokens/s of each
(best and median of --reps, the two alternating), and their ratios; the goal is >= 90%. Every
constrained output is checked to parse and validate against its schema.

    .venv/bin/python benches/bench_structured_outputs.py [--requests 32] [--reps 7]
        [--threads 1] [--out benches/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

from aieng import LLM, SamplingParams, StructuredOutputsParams
from aieng.benchmarks.offline import machine

PROMPTS = [
    "And God said",
    "The LORD is my shepherd",
    "In the beginning",
    "Blessed are the meek",
    "And Moses went up",
    "Thus saith the LORD",
    "And it came to pass",
    "Now the serpent was",
]
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 999},
            "tribe": {"enum": ["Judah", "Levi", "Benjamin", "Dan"]},
            "sons": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["name", "age", "tribe", "sons"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "book": {"type": "string", "maxLength": 16},
            "chapter": {"type": "integer", "minimum": 1, "maximum": 150},
            "verse": {"type": "integer", "minimum": 1, "maximum": 176},
            "text": {"type": "string", "maxLength": 64},
        },
        "required": ["book", "chapter", "verse", "text"],
        "additionalProperties": False,
    },
]


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("benches/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    llm = LLM(max_num_seqs=args.requests)
    n = args.requests
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(n)]
    constrained = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=args.max_tokens,
            structured_outputs=StructuredOutputsParams(json=schemas[i]),
        )
        for i in range(n)
    ]
    run(llm, prompts, constrained)  # warm-up: compiles the schemas, touches every path
    _, outputs = run(llm, prompts, constrained)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    free = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=lengths[i], ignore_eos=True)
        for i in range(n)
    ]
    run(llm, prompts, free)
    walls: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    for _ in range(args.reps):
        for name, params in (("json_schema", constrained), ("unconstrained", free)):
            wall, outs = run(llm, prompts, params)
            walls[name].append(wall)
            produced = [len(o.outputs[0].token_ids) for o in outs]
            if produced != lengths:
                raise SystemExit(f"{name}: output lengths differ from the first run's")
            if name == "json_schema":
                for schema, out in zip(schemas, outs, strict=True):
                    completion = out.outputs[0]
                    if completion.finish_reason != "stop":
                        raise SystemExit(f"a constrained output was cut: {completion.text!r}")
                    jsonschema.validate(json.loads(completion.text), schema)
    load_after = os.getloadavg()[0]
    tokens = sum(lengths)
    rows = {
        name: {
            "wall_s": min(w),
            "median_wall_s": statistics.median(w),
            "walls_s": w,
            "tok_s": tokens / min(w),
            "median_tok_s": tokens / statistics.median(w),
        }
        for name, w in walls.items()
    }
    ratio = rows["json_schema"]["tok_s"] / rows["unconstrained"]["tok_s"]
    median_ratio = rows["json_schema"]["median_tok_s"] / rows["unconstrained"]["median_tok_s"]
    info = machine(args.threads)
    result = {
        "machine": info,
        "requests": n,
        "output_tokens": tokens,
        "mean_output_tokens": tokens / n,
        "runs": rows,
        "ratio": ratio,
        "median_ratio": median_ratio,
        "goal": 0.9,
        "load_average_1min": [load_before, load_after],
    }
    lines = [
        "# bench_structured_outputs",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}; {info['cpu_features']}), torch "
        f"{info['torch']}, Python {info['python']}, torch.set_num_threads({args.threads}). "
        f"1-minute load average {load_before:.1f} at the start and {load_after:.1f} at the end "
        f"(on {info['nproc']} CPUs: above that, other work shared the CPUs).",
        "",
        f"{n} concurrent requests on the default model, temperature 0.8 (seeded), "
        f"{tokens} output tokens per run ({tokens / n:.1f} per request); the unconstrained run "
        "has the same prompts and the same output length per request. "
        f"{args.reps} runs of each, alternating.",
        "",
        "| run | best wall s | best output tok/s | median wall s | median output tok/s |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['wall_s']:.3f} | {row['tok_s']:,.0f} | "
            f"{row['median_wall_s']:.3f} | {row['median_tok_s']:,.0f} |"
        )
    lines += [
        "",
        f"JSON-schema throughput / unconstrained: {ratio:.1%} (best runs), "
        f"{median_ratio:.1%} (medians); goal >= 90%.",
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_structured_outputs.md").write_text(table)
    (args.out / "bench_structured_outputs.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
