"""Speculative decoding off against on, the bundled default model, one run. `--method ngram`
(prompt lookup): single stream on KJV prompts at temperature 0 and 0.8, a copy-heavy prompt (a
passage, then its opening again: the output reproduces it), and 64 concurrent requests.
`--method draft` (the draft model shipped beside the default model): single stream on KJV
prompts at temperature 0 and 0.8. Prints output tokens/s beside the figures that do not depend
on the machine: acceptance rate (accepted / draft tokens) and tokens per target forward of a
speculating request (1 + accepted / drafts).

    .venv/bin/python benches/bench_speculative.py [--method ngram|draft] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from aieng import LLM, SamplingParams
from aieng.benchmarks.offline import machine
from aieng.config.speculative import SHIPPED_DRAFT_NAME, SHIPPED_DRAFT_TOKENS

KJV = [
    "And God said",
    "In the beginning",
    "The LORD is my shepherd",
    "Blessed are the poor in spirit",
]
PASSAGE = (
    "And the name of the man was Elimelech, and the name of his wife Naomi, and the name of "
    "his two sons Mahlon and Chilion, Ephrathites of Bethlehemjudah. And they came into the "
    "country of Moab, and continued there. And Elimelech Naomi's husband died; and she was "
    "left, and her two sons."
)
COPY = [f"{PASSAGE}\n\n{PASSAGE[:40]}", f"{PASSAGE}\n{PASSAGE}\n{PASSAGE[:60]}"]


SWEEP = (1, 2, 4, 8, 16, 64)  # --sweep: concurrent requests


def concurrent(n: int) -> list[str]:
    return [KJV[i % 4] + " " * (i // 4) for i in range(n)]


def scenarios(
    method: str, max_tokens: int, sweep: bool = False
) -> list[tuple[str, list[str], SamplingParams, bool]]:
    """(name, prompts, params, one request at a time)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens, ignore_eos=True)
    batch = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    if sweep:
        return [(f"{n} concurrent, KJV, T=0", concurrent(n), batch, False) for n in SWEEP]
    if method == "draft":
        return [
            ("single stream, KJV, T=0", KJV, greedy, True),
            ("single stream, KJV, T=0.8", KJV, sampled, True),
        ]
    return [
        ("single stream, KJV, T=0", KJV, greedy, True),
        ("single stream, KJV, T=0.8", KJV, sampled, True),
        ("single stream, copy-heavy, T=0", COPY, greedy, True),
        ("64 concurrent, KJV, T=0", concurrent(64), batch, False),
    ]  # fmt: skip


def measure(llm: LLM, prompts: list[str], params: SamplingParams, alone: bool) -> dict:
    before = llm.get_stats()
    started = time.perf_counter()
    groups = [[p] for p in prompts] if alone else [prompts]
    outputs = [o for group in groups for o in llm.generate(group, params, use_tqdm=False)]
    seconds = time.perf_counter() - started
    after = llm.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    per_position = [
        (a - b) / drafts if drafts else None
        for a, b in zip(
            after.spec_decode_accepted_per_position,
            before.spec_decode_accepted_per_position or [0] * 16,
            strict=False,
        )
    ]
    return {
        "accepted_per_position": per_position,
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "steps": after.num_steps - before.num_steps,
        "acceptance": accepted / draft_tokens if draft_tokens else None,
        "tokens_per_forward": 1 + accepted / drafts if drafts else None,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    ap.add_argument(
        "--k", type=int, help=f"num_speculative_tokens (ngram 4, draft {SHIPPED_DRAFT_TOKENS})"
    )
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2, help="runs of each, alternating (best kept)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--note", default="", help="e.g. that the machine was shared")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help=f"ngram at {', '.join(map(str, SWEEP))} concurrent requests, speculating at every "
        "batch size (disable_by_batch_size 0): where it stops paying",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    method = args.method
    if method == "draft":
        args.k = args.k or SHIPPED_DRAFT_TOKENS
        config = {"model": SHIPPED_DRAFT_NAME, "num_speculative_tokens": args.k}
    else:
        args.k = args.k or 4
        config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2}  # fmt: skip
    if args.sweep:
        config["disable_by_batch_size"] = 0
    engines = {"off": LLM(kv_cache_memory=1 << 26), method: LLM(
        kv_cache_memory=1 << 26, speculative_config=config)}  # fmt: skip
    rows = []
    for name, prompts, params, alone in scenarios(method, args.max_tokens, args.sweep):
        for llm in engines.values():  # warm-up
            llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        # Off and on alternate, best of --reps each: a shared machine's load hits both.
        off = on = None
        for _ in range(args.reps):
            o = measure(engines["off"], prompts, params, alone)
            n = measure(engines[method], prompts, params, alone)
            off = o if off is None or o["tok_s"] > off["tok_s"] else off
            on = n if on is None or n["tok_s"] > on["tok_s"] else on
        same = on.pop("token_ids") == off.pop("token_ids")
        rows.append({"scenario": name, "off": off, method: on, "identical": same})
    what = "ngram" if method == "ngram" else f"the draft model {SHIPPED_DRAFT_NAME}"
    lines = [
        f"Speculative decoding ({what}, k={args.k}) against plain decoding, the bundled default "
        f"model, {args.threads} threads, best of {args.reps} alternating runs. {args.note}",
        "",
        f"| scenario | off tok/s | {method} tok/s | speed-up | off steps | {method} steps | "
        "acceptance | accepted per position | tokens per forward | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        off, on = r["off"], r[method]
        acceptance = f"{on['acceptance']:.2f}" if on["acceptance"] is not None else "-"
        positions = (
            "/".join(f"{p:.2f}" for p in on["accepted_per_position"] if p is not None) or "-"
        )
        per_forward = (
            f"{on['tokens_per_forward']:.2f}" if on["tokens_per_forward"] is not None else "-"
        )
        lines.append(
            f"| {r['scenario']} | {off['tok_s']:.0f} | {on['tok_s']:.0f} | "
            f"{on['tok_s'] / off['tok_s']:.2f}x | {off['steps']} | {on['steps']} | "
            f"{acceptance} | {positions} | {per_forward} | {'yes' if r['identical'] else 'NO'} |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    info = machine(args.threads)
    stem = "bench_speculative" if method == "ngram" else "bench_speculative_draft"
    stem += "_sweep" if args.sweep else ""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(
        f"# {stem}\n\nMachine: {info['cpu']} ({info['cpu_features']}), "
        f"{info['nproc']} cores, torch {info['torch']}.\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
