"""Load test of `aieng serve`: open-loop Poisson arrivals against a running server.

Workload: a 6:3:1 mix of short-prompt/short-output, short-prompt/long-output and
long-prompt/short-output requests (token-id prompts cut from a King James passage tokenized by
the server, exact output lengths with ignore_eos, temperature 1, streaming), a fraction of
clients that disconnect mid-stream, and greedy canary prompts whose text must equal what the
idle server gave before the load.

Reported: TTFT, time per output token (TPOT) and inter-token latency (ITL) at p50/p90/p99,
throughput, goodput (completions per second meeting the TTFT and TPOT targets), and every
request's outcome: sent = completed + refused (by status) + aborted + failed, cross-checked
with the server's own counters. Then the end state: nothing running or waiting, KV usage back
to 0 (only the prefix cache holds blocks), the server still answering.

    aieng bench --serve --url http://127.0.0.1:8000 --rate 4 --duration 60
    python benches/load_test.py --spawn default --rate auto --duration 300 --out benches/results

(`aieng bench --serve ARGS` and `python benches/load_test.py ARGS` are the same program.)

`--rate auto` first measures capacity (the best completed requests/s of the same mix, closed
loop, over the `--calibrate-concurrency` client counts) and runs at `--load-factor` times it.
`--spawn MODEL|default` starts `python -m aieng.server` on a free port for the run and stops
it with SIGTERM after (its exit status is checked). Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from aieng.benchmarks.load_timeline import (
    Outcome,
    Timeline,
    sample_server,
    switch_phases,
    switch_version,
    windows,
)
from aieng.benchmarks.load_timeline import markdown as timeline_markdown
from aieng.benchmarks.load_timeline import plot as timeline_plot

SEED_TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon "
    "the face of the waters. And God said, Let there be light: and there was light. And God "
    "saw the light, that it was good: and God divided the light from the darkness. And God "
    "called the light Day, and the darkness he called Night. And the evening and the morning "
    "were the first day. And God said, Let there be a firmament in the midst of the waters, "
    "and let it divide the waters from the waters. And God made the firmament, and divided "
    "the waters which were under the firmament from the waters which were above the "
    "firmament: and it was so. And God called the firmament Heaven. And the evening and the "
    "morning were the second day. And God said, Let the waters under the heaven be gathered "
    "together unto one place, and let the dry land appear: and it was so. And God called the "
    "dry land Earth; and the gathering together of the waters called he Seas: and God saw "
    "that it was good. "
)
CANARY_PROMPTS = [
    "And God said, Let there be light:",
    "The LORD is my shepherd; I shall not want.",
    "In the beginning was the Word, and the Word was with God,",
]
MIX = (("short/short", 6), ("short/long", 3), ("long/short", 1))
PERCENTILES = (50, 90, 99)


@dataclass
class Workload:
    prompt_ids: list[int]  # a long token sequence to cut prompts from
    lengths: dict[str, tuple[int, int]]  # kind -> (prompt tokens, output tokens)
    model: str
    disconnect_fraction: float
    timeout: float

    def request(self, kind: str, rng: random.Random) -> tuple[dict, int | None]:
        """(body, chunks after which the client leaves, or None)."""
        prompt_len, max_tokens = self.lengths[kind]
        start = rng.randrange(len(self.prompt_ids) - prompt_len)
        body = {
            "model": self.model,
            "prompt": self.prompt_ids[start : start + prompt_len],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": rng.randrange(1 << 31),
        }
        leave = None
        if rng.random() < self.disconnect_fraction:
            leave = rng.randint(1, max(1, max_tokens // 2))
        return body, leave


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict, leave_after: int | None, outcome: Outcome
) -> str:
    """Runs one streaming completion, filling `outcome`; returns the text received."""
    start = time.perf_counter()
    last = None
    texts: list[str] = []
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                outcome.category = _refusal(response)
                outcome.detail = response.text[:200]
                return ""
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.detail = str(chunk["error"])[:200]
                    return "".join(texts)
                if chunk.get("usage"):
                    outcome.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    now = time.perf_counter()
                    if last is None:
                        outcome.ttft = now - start
                    else:
                        outcome.itl.append(now - last)
                    last = now
                    texts.append(choice["text"])
                    chunks += 1
                    if choice.get("finish_reason"):
                        outcome.finish_reason = choice["finish_reason"]
                if leave_after is not None and chunks >= leave_after:
                    outcome.category = "aborted_client"
                    return "".join(texts)  # leaving the block closes the connection
            if not done or outcome.finish_reason is None:
                outcome.detail = "the stream ended without [DONE] or a finish_reason"
            elif outcome.finish_reason == "abort":
                outcome.category = "aborted_server"
            else:
                outcome.category = "completed"
                if outcome.ttft is not None and last is not None and outcome.tokens > 1:
                    outcome.tpot = (last - start - outcome.ttft) / (outcome.tokens - 1)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        outcome.detail = f"{type(error).__name__}: {error}"[:200]
    return "".join(texts)


def _refusal(response: httpx.Response) -> str:
    """A 429 or 503 is a refusal, except a timeout before the first token: the server
    counts that one as an abort."""
    if response.status_code not in (429, 503):
        return "failed"
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return "aborted_server" if code == "request_timeout" else f"refused_{response.status_code}"


@dataclass
class Canary:
    prompt: str
    status: int | None = None  # None: no answer (transport error)
    text: str | None = None


async def canary_text(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> Canary:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
    }
    canary = Canary(prompt)
    try:
        response = await client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError:
        return canary
    canary.status = response.status_code
    if response.status_code == 200:
        canary.text = response.json()["choices"][0]["text"]
    return canary


async def run_canary(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, canaries: list[Canary]
) -> None:
    canaries.append(await canary_text(client, url, model, prompt))


def judge_canaries(canaries: list[Canary], idle: dict[str, str]) -> dict:
    """Greedy text under load against the idle server's; a refused canary is only counted."""
    answered = [c for c in canaries if c.status == 200]
    return {
        "sent": len(canaries),
        "answered": len(answered),
        "matched": sum(1 for c in answered if c.text == idle[c.prompt]),
        "refused": sum(1 for c in canaries if c.status in (429, 503)),
        "failed": sum(1 for c in canaries if c.status not in (200, 429, 503)),
        "mismatched": [asdict(c) | {"idle": idle[c.prompt]} for c in answered
                       if c.text != idle[c.prompt]],
    }  # fmt: skip


def pick_kind(rng: random.Random) -> str:
    kinds, weights = zip(*MIX, strict=True)
    return rng.choices(kinds, weights)[0]


async def calibrate(url: str, workload: Workload, concurrency: int, seconds: float) -> float:
    """Completed requests per second of the mix with `concurrency` clients always busy."""
    rng = random.Random(1)
    done = 0
    end = time.perf_counter() + seconds
    calm = Workload(**{**asdict(workload), "disconnect_fraction": 0.0})

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < end:
            body, _ = calm.request(pick_kind(rng), rng)
            outcome = Outcome("calibrate", 0.0)
            await stream_request(client, url, body, None, outcome)
            if outcome.category == "completed":
                done += 1

    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=workload.timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


async def run_load(
    url: str,
    workload: Workload,
    rate: float,
    duration: float,
    canary_every: float,
    seed: int,
    start: float | None = None,
) -> tuple[list[Outcome], list[Canary], float]:
    """Open loop: arrivals at exponential gaps, never waiting for earlier requests. `start`:
    the perf_counter the arrival times count from (default: now)."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    canaries: list[Canary] = []
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=workload.timeout, limits=limits) as client:
        start = time.perf_counter() if start is None else start
        next_arrival, next_canary, canary_index = 0.0, canary_every, 0
        while next_arrival < duration:
            await asyncio.sleep(max(0.0, start + next_arrival - time.perf_counter()))
            kind = pick_kind(rng)
            body, leave = workload.request(kind, rng)
            outcome = Outcome(kind, next_arrival)
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(stream_request(client, url, body, leave, outcome)))
            while next_canary <= next_arrival:
                prompt = CANARY_PROMPTS[canary_index % len(CANARY_PROMPTS)]
                canary_index += 1
                tasks.append(
                    asyncio.create_task(run_canary(client, url, workload.model, prompt, canaries))
                )
                next_canary += canary_every
            next_arrival += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        return outcomes, canaries, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}


def summarize(outcomes: list[Outcome], elapsed: float, slo_ttft: float, slo_tpot: float) -> dict:
    completed = [o for o in outcomes if o.category == "completed"]
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.category] = counts.get(o.category, 0) + 1
    good = [o for o in completed if (o.ttft or 0) <= slo_ttft and (o.tpot or 0) <= slo_tpot]
    streamed = [o for o in outcomes if o.ttft is not None]
    return {
        "sent": len(outcomes),
        "outcomes": dict(sorted(counts.items())),
        "accounted": sum(counts.values()) == len(outcomes),
        "by_kind": {k: sum(1 for o in outcomes if o.kind == k) for k, _ in MIX},
        "elapsed_s": elapsed,
        "throughput_req_s": len(completed) / elapsed,
        "throughput_out_tok_s": sum(o.tokens for o in completed) / elapsed,
        "goodput_req_s": len(good) / elapsed,
        "goodput_fraction": len(good) / len(completed) if completed else 0.0,
        "ttft_s": percentiles([o.ttft for o in streamed]),
        "tpot_s": percentiles([o.tpot for o in completed if o.tpot is not None]),
        "itl_s": percentiles([gap for o in streamed for gap in o.itl]),
        "failures": [o.detail for o in outcomes if o.category == "failed"][:20],
    }


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
            values[key] = values.get(key, 0.0) + sample.value
    return values


def server_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    names = ("aieng_request_success_total", "aieng_request_rejected_total")
    keys = {k for k in after if k.startswith(names)}
    return {k: after[k] - before.get(k, 0.0) for k in sorted(keys) if after[k] != before.get(k)}


def cross_check(summary: dict, deltas: dict[str, float], canaries: dict) -> list[str]:
    """Every request the clients sent, in the server's own counters; returns the mismatches.

    A client that leaves just as its request ends may find the server finished it first, so
    client disconnects bound the server's aborts from above rather than equal them."""
    o = summary["outcomes"]
    problems = []
    finished = sum(v for k, v in deltas.items() if k.startswith("aieng_request_success_total"))
    ran = o.get("completed", 0) + o.get("aborted_client", 0) + o.get("aborted_server", 0)
    if finished != ran + canaries["answered"]:
        problems.append(f"the server finished {finished:.0f} requests, the clients ran {ran} "
                        f"and {canaries['answered']} canaries")  # fmt: skip
    refused = sum(v for k, v in o.items() if k.startswith("refused_")) + canaries["refused"]
    server_refused = sum(v for k, v in deltas.items() if k.startswith("aieng_request_rejected"))
    if server_refused != refused:
        problems.append(f"the server refused {server_refused:.0f}, the clients saw {refused}")
    aborted = deltas.get("aieng_request_success_total|finished_reason=abort", 0.0)
    if (
        not o.get("aborted_server", 0)
        <= aborted
        <= o.get("aborted_server", 0) + o.get("aborted_client", 0)
    ):
        problems.append(f"the server aborted {aborted:.0f}, outside what the clients saw")
    return problems


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """The server's metrics once nothing runs or waits (or at the timeout)."""
    end = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = m["aieng_num_requests_running"] == 0 and m["aieng_num_requests_waiting"] == 0
        if idle or time.monotonic() > end:
            return m
        time.sleep(0.2)


def end_state(url: str, model: str, idle: dict[str, float]) -> dict:
    """Idle, KV usage back to 0 (the prefix cache may keep blocks), and still answering."""
    health = httpx.get(f"{url}/health", timeout=10).status_code
    probe = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": "And God said", "max_tokens": 4},
        timeout=60,
    ).status_code
    state = {
        "running": idle["aieng_num_requests_running"],
        "waiting": idle["aieng_num_requests_waiting"],
        "kv_cache_usage": idle["aieng_kv_cache_usage_perc"],
        "cached_blocks": idle.get("aieng_kv_cache_cached_blocks", 0.0),
        "health_status": health,
        "probe_status": probe,
    }
    state["ok"] = (
        state["running"] == 0
        and state["waiting"] == 0
        and state["kv_cache_usage"] == 0.0
        and health == 200
        and probe == 200
    )
    return state


def spawn(model: str, extra: list[str], stderr: IO | None = None) -> tuple[subprocess.Popen, str]:
    """`aieng serve` on a free port (its stderr to `stderr`, default: this process's), once
    ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "aieng.server", "--port", str(port), *extra]
    if model != "default":
        command.insert(3, model)
    proc = subprocess.Popen(command, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 300
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the spawned server did not become ready")


def markdown(result: dict) -> str:
    s, cfg, c = result["summary"], result["config"], result["canaries"]
    o = s["outcomes"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    rate = f"{cfg['rate']:.2f} req/s"
    if cfg["capacity_req_s"]:
        sweep = ", ".join(f"{k}: {v:.2f}" for k, v in cfg["capacity_sweep"].items())
        rate += (
            f" ({cfg['load_factor']:.2f}x the capacity of {cfg['capacity_req_s']:.2f} req/s, the "
            f"best completed req/s measured closed-loop first: {sweep})"
        )
    lengths = ", ".join(f"{k} = {p}+{n}" for k, (p, n) in cfg["lengths"].items())
    refused = ", ".join(
        f"{v} x {k.removeprefix('refused_')}" for k, v in o.items() if k.startswith("refused_")
    )
    checks = [
        f"accounting {'ok' if s['accounted'] else 'BROKEN'}",
        "server counters " + ("agree" if not result["cross_check"] else "DISAGREE: "
                              + "; ".join(result["cross_check"])),
        f"canaries {c['matched']} of {c['answered']} answered equal to the idle run "
        f"({c['refused']} refused, {c['failed']} failed, of {c['sent']})",
        "end state " + ("ok" if result["end_state"]["ok"] else "BAD") + f" {result['end_state']}",
    ]  # fmt: skip
    if "exit_status" in result:
        checks.append(f"server exit status after SIGTERM {result['exit_status']}")
    lines = [
        "# load_test",
        "",
        f"Machine: {result['machine']}. Server: `{cfg['server']}`, model {cfg['model']}.",
        "",
        f"Workload: Poisson arrivals at {rate} for {cfg['duration']:.0f} s; mix 6:3:1 of "
        f"(prompt+output tokens) {lengths}; temperature 1, ignore_eos, streaming; "
        f"{cfg['disconnect_fraction']:.0%} of clients leave mid-stream; a greedy canary every "
        f"{cfg['canary_every']:.0f} s. Targets: TTFT <= {cfg['slo_ttft']} s, TPOT <= "
        f"{cfg['slo_tpot']} s.",
        "",
        "| metric | p50 | p90 | p99 |",
        "|---|---|---|---|",
        *(
            f"| {name} | {ms(s[key]['p50'])} | {ms(s[key]['p90'])} | {ms(s[key]['p99'])} |"
            for name, key in (
                ("TTFT (ms)", "ttft_s"),
                ("TPOT (ms)", "tpot_s"),
                ("ITL (ms)", "itl_s"),
            )
        ),
        "",
        "| sent | completed | refused (status) | aborted by client | aborted by server | failed |",
        "|---|---|---|---|---|---|",
        f"| {s['sent']} | {o.get('completed', 0)} | {refused or 0} | {o.get('aborted_client', 0)} "
        f"| {o.get('aborted_server', 0)} | {o.get('failed', 0)} |",
        "",
        f"Throughput: {s['throughput_req_s']:.2f} completed req/s, "
        f"{s['throughput_out_tok_s']:.1f} output tok/s. Goodput: {s['goodput_req_s']:.2f} req/s "
        f"({s['goodput_fraction']:.0%} of completions within both targets).",
        "",
        "Checks: " + "; ".join(checks) + ".",
        *timeline_markdown(result),
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, outcomes: list[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s")]
    width = 0.25
    for i, p in enumerate(PERCENTILES):
        values = [(s[key][f"p{p}"] or 0) * 1000 for _, key in names]
        bars.bar(np.arange(3) + (i - 1) * width, values, width, label=f"p{p}")
    bars.set_xticks(np.arange(3), [n for n, _ in names])
    bars.set_yscale("log")
    bars.set_ylabel("ms (log)")
    bars.set_title("latency percentiles")
    bars.legend()
    points = [(o.sent_at, o.ttft * 1000) for o in outcomes if o.ttft is not None]
    if points:
        x, y = zip(*points, strict=True)
        scatter.scatter(x, y, s=4, alpha=0.5)
    scatter.set_yscale("log")
    scatter.set_xlabel("arrival (s since start)")
    scatter.set_ylabel("TTFT ms (log)")
    scatter.set_title(f"TTFT over the run at {result['config']['rate']:.2f} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="aieng bench --serve", description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--spawn", metavar="MODEL", help="start a server on MODEL (or 'default')")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to --spawn")
    ap.add_argument("--rate", default="auto", help="arrivals per second, or 'auto'")
    ap.add_argument("--load-factor", type=float, default=1.0, help="times capacity, for auto")
    ap.add_argument(
        "--calibrate-concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[16, 32, 64, 128],
        help="closed-loop client counts tried; capacity is the best completed req/s",
    )
    ap.add_argument("--calibrate-seconds", type=float, default=15.0, help="per client count")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--short-prompt", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=384)
    ap.add_argument("--short-output", type=int, default=32)
    ap.add_argument("--long-output", type=int, default=128)
    ap.add_argument("--disconnect-fraction", type=float, default=0.05)
    ap.add_argument("--canary-every", type=float, default=10.0, help="seconds")
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write load_test<label>.{md,json,png} here")
    ap.add_argument("--label", default="", help="suffix of the result file names")
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per reported window")
    ap.add_argument("--switch-version", help="load this version at --switch-at (--model-dir)")
    ap.add_argument("--switch-at", type=float, default=30.0, help="seconds into the load")
    ap.add_argument("--admin-key", default=os.environ.get("AIENG_ADMIN_KEY"), help="for --switch")
    args = ap.parse_args(argv)
    if args.switch_version is not None and not args.admin_key:
        ap.error("--switch-version needs --admin-key (or AIENG_ADMIN_KEY)")
    if (args.url is None) == (args.spawn is None):
        ap.error("give exactly one of --url and --spawn")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    url = args.url
    if args.spawn is not None:
        proc, url = spawn(args.spawn, args.server_arg)
    try:
        result, outcomes = asyncio.run(_run(args, url))
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            exit_status = proc.wait(120)
    if proc is not None:
        result["exit_status"] = exit_status
    result["command"] = " ".join(["python benches/load_test.py", *(argv or sys.argv[1:])])
    ok = (
        result["summary"]["accounted"]
        and not result["cross_check"]
        and result["canaries"]["matched"] == result["canaries"]["answered"] > 0
        and not result["canaries"]["failed"]
        and result["end_state"]["ok"]
        and result.get("exit_status", 0) == 0
        and not result["summary"]["outcomes"].get("failed")
    )
    result["ok"] = ok
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"load_test{args.label}"  # a label may hold dots: no with_suffix
        (args.out / f"{stem}.md").write_text(text)
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        plot(result, outcomes, args.out / f"{stem}.png")
        timeline_plot(result, args.out / f"{stem}_timeline.png")
    return 0 if ok else 1


async def _run(args: argparse.Namespace, url: str) -> tuple[dict, list[Outcome]]:
    async with httpx.AsyncClient(timeout=60) as client:
        # the server's own model first (with --model-dir, NAME@VERSION entries follow)
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]
        ids = (await client.post(f"{url}/tokenize", json={"prompt": SEED_TEXT * 8})).json()
        idle = {}
        for prompt in CANARY_PROMPTS:
            canary = await canary_text(client, url, model["id"], prompt)
            if canary.text is None:
                raise SystemExit(f"the idle server did not answer a canary: {canary}")
            idle[prompt] = canary.text
    lengths = {
        "short/short": (args.short_prompt, args.short_output),
        "short/long": (args.short_prompt, args.long_output),
        "long/short": (args.long_prompt, args.short_output),
    }
    context = model.get("max_model_len")
    for kind, (p, o) in lengths.items():
        if context is not None and p + o > context:
            raise SystemExit(f"{kind}: {p} + {o} tokens exceed the model's context of {context}")
    workload = Workload(ids["tokens"], lengths, model["id"], args.disconnect_fraction, args.timeout)
    capacity, sweep = None, {}
    if args.rate == "auto":
        for concurrency in args.calibrate_concurrency:
            sweep[concurrency] = await calibrate(url, workload, concurrency, args.calibrate_seconds)
        capacity = max(sweep.values())
        rate = capacity * args.load_factor
    else:
        rate = float(args.rate)
    before = scrape(url)
    start, stop, timeline = time.perf_counter(), asyncio.Event(), Timeline()
    watchers = [asyncio.create_task(sample_server(url, args.sample_every, start, stop, timeline))]
    if args.switch_version is not None:
        watchers.append(
            asyncio.create_task(
                switch_version(
                    url, model["id"], args.switch_version, args.switch_at, args.admin_key,
                    start, timeline,
                )
            )
        )  # fmt: skip
    outcomes, canaries, elapsed = await run_load(
        url, workload, rate, args.duration, args.canary_every, args.seed, start
    )
    if len(watchers) > 1:
        await watchers[1]  # the switch finishes (the old version freed) before the report
    stop.set()
    await watchers[0]
    idle_metrics = await asyncio.to_thread(wait_idle, url)
    deltas = server_deltas(before, idle_metrics)
    state = await asyncio.to_thread(end_state, url, model["id"], idle_metrics)
    summary = summarize(outcomes, elapsed, args.slo_ttft, args.slo_tpot)
    canary_report = judge_canaries(canaries, idle)
    result = {
        "machine": f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}",
        "config": {
            "server": _server_line(args, url),
            "rate": rate,
            "capacity_req_s": capacity,
            "capacity_sweep": {f"{c} clients": x for c, x in sweep.items()},
            "load_factor": args.load_factor if capacity else None,
            "duration": args.duration,
            "lengths": lengths,
            "disconnect_fraction": args.disconnect_fraction,
            "canary_every": args.canary_every,
            "slo_ttft": args.slo_ttft,
            "slo_tpot": args.slo_tpot,
            "model": model["id"],
        },
        "summary": summary,
        "server_counters": deltas,
        "cross_check": cross_check(summary, deltas, canary_report),
        "canaries": canary_report,
        "end_state": state,
        "samples": timeline.samples,
        "windows": windows(outcomes, args.window, args.duration),
    }
    if timeline.switch is not None:
        result["switch"] = timeline.switch
        result["switch_phases"] = switch_phases(outcomes, timeline.switch)
    return result, outcomes


def _server_line(args: argparse.Namespace, url: str) -> str:
    if args.spawn is None:
        return url
    model = [] if args.spawn == "default" else [args.spawn]
    return " ".join(["python -m aieng.server", *model, *args.server_arg])


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


if __name__ == "__main__":
    sys.exit(main())
