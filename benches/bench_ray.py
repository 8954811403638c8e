"""One `aieng serve` against 2 engine replicas on Ray Serve (round-robin and prefix-aware
routing), on a workload whose prompts share system prompts, all in one run.

Per configuration: requests/s and output tokens/s, TTFT p50/p99 (streamed, from the client),
the prefix-cache hit rate (prompt tokens found in the cache over prompt tokens looked up, from
/metrics); and the routing overhead per request: 1-token requests sent alternately to the
plain server (one process) and through Ray (Serve's proxy, the ingress and its router, the
replica: three processes), the median of the paired differences.

On a machine with few cores the replicas share them with each other and with the ingress:
throughput and TTFT then say little about a cluster; the hit rate and the overhead carry over.

    PYTHONPATH=python python benches/bench_ray.py [--model DIR] [--out benches/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ray_fixtures import RayApp, ray_cluster
from server_fixtures import MODEL_NAME, SubprocessServer, scrape

from aieng.config.default_model import default_model_path

ENGINE = dict(kv_cache_memory=1 << 24, block_size=16, max_num_seqs=8)
PREFIXES, PER_PREFIX, PREFIX_TOKENS, SUFFIX_TOKENS = 8, 16, 256, 16
MAX_TOKENS, CONCURRENCY, OVERHEAD_SAMPLES = 16, 4, 40


def workload(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    prompts = [
        prefixes[i % PREFIXES] + [rng.randrange(10, vocab) for _ in range(SUFFIX_TOKENS)]
        for i in range(PREFIXES * PER_PREFIX)
    ]
    rng.shuffle(prompts)
    return prompts


def stream_one(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to the end, tokens) of one streamed completion."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    first, tokens = None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0]["text"] is not None:
                tokens += 1
                first = first or time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start, tokens


def measure(url: str, vocab: int, seed: int) -> dict[str, float]:
    before = scrape(url)
    prompts = workload(seed, vocab)
    start = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda p: stream_one(url, p, MAX_TOKENS), prompts))
    elapsed = time.perf_counter() - start
    time.sleep(1.0)  # the replicas' last stats reach the ingress
    after = scrape(url)
    queries = after["aieng_prefix_cache_queries_total"] - before["aieng_prefix_cache_queries_total"]
    hits = after["aieng_prefix_cache_hits_total"] - before["aieng_prefix_cache_hits_total"]
    ttfts = sorted(r[0] for r in results)
    return {
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": sum(r[2] for r in results) / elapsed,
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
        "prefix_hit_rate": hits / queries if queries else 0.0,
    }


def routing_overhead(direct: str, through_ray: str) -> tuple[float, float, float]:
    """(direct median, Ray median, median of the paired differences) in ms of a 1-token
    request, the two sent alternately one at a time so both see the same machine load."""
    pairs = []
    for _ in range(OVERHEAD_SAMPLES):
        plain = stream_one(direct, [11, 12, 13], 1)[1]
        ray = stream_one(through_ray, [11, 12, 13], 1)[1]
        pairs.append((plain, ray))
    return (
        1000 * statistics.median(p for p, _ in pairs),
        1000 * statistics.median(r for _, r in pairs),
        1000 * statistics.median(r - p for p, r in pairs),
    )


def machine() -> str:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in cpu.splitlines()
            if line.startswith("Model name")
        ),
        platform.processor(),
    )
    cores = next(
        (line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("CPU(s)")),
        "?",
    )
    return f"{model}, {cores} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--out", type=Path, default=Path("benches/results"))
    args = parser.parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rows: dict[str, dict[str, float]] = {}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    flags.append(f"--served-model-name={MODEL_NAME}")
    log = args.out / "bench_ray_server.log"
    args.out.mkdir(parents=True, exist_ok=True)
    with SubprocessServer(args.model, log, *flags) as plain:  # its own process, as a replica
        rows["aieng serve (1 engine)"] = measure(plain.url, vocab, seed=1)
        ray_cluster()
        for routing in ("round_robin", "prefix"):
            name = routing.replace("_", "-")
            app = RayApp(name, args.model, ENGINE, num_replicas=2, routing=routing)
            try:
                rows[f"Ray Serve, 2 replicas, {routing}"] = measure(app.url, vocab, seed=2)
                if routing == "prefix":
                    overhead = routing_overhead(plain.url, app.url)
            finally:
                app.delete()
    log.unlink()
    header = "| configuration | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | prefix hit rate |"
    lines = [header, "|" + "---|" * 6]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} "
            f"| {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['prefix_hit_rate']:.1%} |"
        )
    lines += [
        "",
        "| 1-token request, one at a time | direct (aieng serve) | through Ray Serve | "
        "routing overhead (median of paired differences) |",
        "|---|---|---|---|",
        f"| median latency ms ({OVERHEAD_SAMPLES} pairs) | {overhead[0]:.1f} | "
        f"{overhead[1]:.1f} | {overhead[2]:+.1f} |",
    ]
    names = ("direct", "ray", "paired_difference")
    rows["routing_overhead_ms"] = dict(zip(names, overhead, strict=True))
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ray.json").write_text(json.dumps({"machine": machine(), "rows": rows}))
    (args.out / "bench_ray.md").write_text(
        f"# bench_ray\n\nMachine: {machine()}, shared with other jobs during the run; the "
        "replicas, the ingress and the single server share the same 2 cores, so throughput "
        "and TTFT are not a cluster's. The hit rate and the overhead carry over.\n\n"
        f"Workload: {PREFIXES} system prompts of {PREFIX_TOKENS} tokens, each in {PER_PREFIX} "
        f"requests with its own {SUFFIX_TOKENS}-token suffix, shuffled; {MAX_TOKENS} output "
        f"tokens each (streamed), {CONCURRENCY} at a time; model {args.model.name} "
        f"({vocab} tokens vocabulary); engine options {ENGINE}.\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
