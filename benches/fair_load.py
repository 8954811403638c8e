"""No client starves the others: a light chat client's time to first token alone, then beside a
flood of 4 MB bodies and a heavy embedding client, against `aieng serve` on loopback; and the
server's memory (RSS) before, during and after the burst.

Each client has its own loopback address (127.0.0.2, .3, .4), so the server tells them apart
as it would tell apart machines, and the flood and the heavy client run in processes of their
own (their bodies encoded once): the light client's times are not its own event loop's delays
behind the others' 4 MB bodies, as they would be on another machine. The goal (issue 37): the
light client's p99 TTFT under load at most 2x its idle p99, and RSS back within 10% of its
level before the burst.

While the clients share the engine its steps are bounded in time (`--shared-step-ms`): the
report gives the step token budgets seen under load (the `aieng_step_token_budget` gauge,
scraped) and the heavy client's embedded inputs per second, the throughput the bound costs it;
run once more with `--server-arg=--shared-step-ms --server-arg=0` for the unbounded figures.

    .venv/bin/python benches/fair_load.py            # the bundled model, about 2 minutes
    .venv/bin/python benches/fair_load.py --quick    # a short check that it runs

Where the light client's time goes: `--stages LOG` runs the server at debug level (its log to
LOG) and adds the light requests' stage times alone and under load (p50/p99, each stage's
share), the engine's steps, and the CPU time of the server's threads, the clients' processes and
the whole machine over each phase (fair_load_stages.py); `--clients flood` or `--clients heavy`
runs one background client alone, to see its own part:

    .venv/bin/python benches/fair_load.py --stages /tmp/fair_load.log
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import httpx
from fair_load_stages import machine_busy, process_cpu, thread_delta, thread_times
from fair_load_stages import markdown as stages_markdown

from aieng.benchmarks.load_test import spawn, wait_idle

STEP_BUDGET_GAUGE = "aieng_step_token_budget{"

FLOOD, HEAVY, LIGHT = "127.0.0.2", "127.0.0.3", "127.0.0.4"
FLOOD_BODY_BYTES = 4_000_000
FLOOD_CONCURRENCY = 8
HEAVY_CONCURRENCY = 2
WORDS = (
    "and the earth was without form and void and darkness was upon the face of the deep "
    "and the spirit of god moved upon the face of the waters "
)


def client(address: str, url: str) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=url, transport=transport, timeout=300)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def light_ttft(http: httpx.AsyncClient, model: str, request_id: str) -> tuple[float, float]:
    """When a short streamed chat turn was sent (time.monotonic(), the server's clock on this
    machine) and the seconds to its first content."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "In the beginning"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    start = time.monotonic()
    headers = {"x-request-id": request_id}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return start, time.monotonic() - start
    raise RuntimeError("the stream ended without output")


async def light_client(
    url: str, model: str, count: int, pause: float, phase: str
) -> dict[str, tuple[float, float]]:
    """(sent at, TTFT seconds) by request id (`light-<phase>-<n>`)."""
    async with client(LIGHT, url) as http:
        await light_ttft(http, model, f"light-{phase}-warm")
        times = {}
        for n in range(count):
            request_id = f"light-{phase}-{n}"
            times[request_id] = await light_ttft(http, model, request_id)
            await asyncio.sleep(pause)
        return times


class Phases:
    """Each light phase's wall-clock window, and over it the server threads' times, the
    processes' (`others`: name -> pid) and the whole machine's CPU (other work on it too)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.others: dict[str, int] = {"bench (light client)": os.getpid()}
        self.windows: dict[str, tuple[datetime, datetime]] = {}
        self.threads: dict[str, dict] = {}

    def _sample(self) -> dict[str, tuple[float, float]]:
        sample = thread_times(self.pid)
        for name, pid in {"server": self.pid, **self.others}.items():
            sample[f"process: {name}"] = (process_cpu(pid), 0.0)
        sample["process: the whole machine (all cores)"] = (machine_busy(), 0.0)
        return sample

    async def run(self, phase: str, work):
        start, before, started = datetime.now(), self._sample(), time.perf_counter()
        result = await work
        seconds = time.perf_counter() - started
        self.windows[phase] = (start, datetime.now())
        self.threads[phase] = thread_delta(before, self._sample(), seconds)
        return result


async def flood(url: str, stop: asyncio.Event, statuses: Counter) -> None:
    """Bodies of one 4 MB string on every text route, FLOOD_CONCURRENCY at a time."""
    text = "In the beginning " * (FLOOD_BODY_BYTES // 17)
    bodies = [
        ("/v1/embeddings", json.dumps({"input": text, "pooling": "mean"}).encode()),
        ("/v1/completions", json.dumps({"prompt": text, "max_tokens": 1}).encode()),
        ("/tokenize", json.dumps({"prompt": text}).encode()),
    ]
    headers = {"content-type": "application/json"}

    async def one(http: httpx.AsyncClient, index: int) -> None:
        while not stop.is_set():
            path, body = bodies[index % len(bodies)]
            index += 1
            try:
                response = await http.post(path, content=body, headers=headers)
                statuses[response.status_code] += 1
            except httpx.HTTPError as error:
                statuses[type(error).__name__] += 1

    async with client(FLOOD, url) as http:
        await asyncio.gather(*(one(http, i) for i in range(FLOOD_CONCURRENCY)))


async def heavy(url: str, stop: asyncio.Event, inputs: int, statuses: Counter) -> None:
    """Embedding requests of `inputs` inputs of about 400 tokens, HEAVY_CONCURRENCY at a time."""
    texts = [f"{i} " + WORDS * 14 for i in range(inputs)]

    async def one(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            response = await http.post("/v1/embeddings", json={"input": texts, "pooling": "mean"})
            statuses[response.status_code] += 1

    async with client(HEAVY, url) as http:
        await asyncio.gather(*(one(http) for _ in range(HEAVY_CONCURRENCY)))


def background_client(name: str, url: str, heavy_inputs: int, stop, answers) -> None:
    """In a process of its own: the flood or the heavy client until `stop` (a process Event)
    is set; its answers (status: count) go to the `answers` queue."""

    async def run() -> Counter:
        statuses: Counter = Counter()
        stopping = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.1)
            stopping.set()

        watcher = asyncio.create_task(watch())
        if name == "flood":
            await flood(url, stopping, statuses)
        else:
            await heavy(url, stopping, heavy_inputs, statuses)
        await watcher
        return statuses

    answers.put((name, dict(asyncio.run(run()))))


async def step_budget(http: httpx.AsyncClient) -> int | None:
    """The last step's token budget, from the server's metrics."""
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(STEP_BUDGET_GAUGE):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(args: argparse.Namespace, url: str, pid: int) -> dict:
    phases = Phases(pid)
    light = (url, args.model_name, args.light_requests, args.pause)
    idle = await phases.run("alone", light_client(*light, "alone"))
    rss_before = rss_bytes(pid)
    processes = multiprocessing.get_context("spawn")
    stop, answers = processes.Event(), processes.Queue()
    rss_peak = rss_before
    budgets: list[int] = []

    async def watch_rss() -> None:
        nonlocal rss_peak
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while not stop.is_set():
                rss_peak = max(rss_peak, rss_bytes(pid))
                budget = await step_budget(http)
                if budget is not None and loading.is_set():
                    budgets.append(budget)
                await asyncio.sleep(0.2)

    clients = [
        processes.Process(target=background_client, args=(n, url, args.heavy_inputs, stop, answers))
        for n in args.clients
    ]
    loading = asyncio.Event()
    for process in clients:
        process.start()
    phases.others.update({f"{n} client": p.pid for n, p in zip(args.clients, clients, strict=True)})
    started = time.perf_counter()
    watcher = asyncio.create_task(watch_rss())
    await asyncio.sleep(args.warmup)  # the flood and the heavy client fill the server first
    loading.set()
    loaded = await phases.run("load", light_client(*light, "load"))
    stop.set()
    seconds = time.perf_counter() - started
    await watcher
    statuses = dict(await asyncio.to_thread(lambda: [answers.get() for _ in clients]))
    for process in clients:
        await asyncio.to_thread(process.join)
    await asyncio.to_thread(wait_idle, url)
    await asyncio.sleep(args.settle)
    rss_after = rss_bytes(pid)
    return {
        "idle": idle,
        "loaded": loaded,
        "flood": statuses.get("flood", {}),
        "heavy": statuses.get("heavy", {}),
        "heavy_inputs_per_s": statuses.get("heavy", {}).get(200, 0) * args.heavy_inputs / seconds,
        "step_budgets": budgets,
        "rss": (rss_before, rss_peak, rss_after),
        "phases": phases,
    }


def report(result: dict) -> None:
    idle = [ttft for _, ttft in result["idle"].values()]
    loaded = [ttft for _, ttft in result["loaded"].values()]
    rows = [
        ("light TTFT p50, alone (ms)", f"{1000 * statistics.median(idle):.1f}"),
        ("light TTFT p99, alone (ms)", f"{1000 * percentile(idle, 0.99):.1f}"),
        ("light TTFT p50, under load (ms)", f"{1000 * statistics.median(loaded):.1f}"),
        ("light TTFT p99, under load (ms)", f"{1000 * percentile(loaded, 0.99):.1f}"),
        ("p99 under load / p99 alone", f"{percentile(loaded, 0.99) / percentile(idle, 0.99):.2f}"),
        ("flood answers (status: count)", str(result["flood"])),
        ("heavy answers (status: count)", str(result["heavy"])),
        ("heavy inputs embedded per second", f"{result['heavy_inputs_per_s']:.1f}"),
    ]
    budgets = result["step_budgets"]
    if budgets:
        rows.append(
            (
                "step token budget under load, min / p50 / max",
                f"{min(budgets)} / {statistics.median(budgets):.0f} / {max(budgets)}",
            )
        )
    before, peak, after = result["rss"]
    rows += [
        ("RSS before / peak / after (MB)", f"{before >> 20} / {peak >> 20} / {after >> 20}"),
        ("RSS after / before", f"{after / before:.2f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("| what | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a checkpoint folder (default: bundled)")
    ap.add_argument("--model-name", default=None, help="the served name (default: the server's)")
    ap.add_argument("--light-requests", type=int, default=100)
    ap.add_argument("--pause", type=float, default=0.1, help="seconds between light requests")
    ap.add_argument("--heavy-inputs", type=int, default=128)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds before the last RSS")
    ap.add_argument("--quick", action="store_true", help="20 light requests, short phases")
    ap.add_argument("--server-arg", action="append", default=[], help="passed to aieng serve")
    ap.add_argument(
        "--clients",
        type=lambda text: tuple(text.split(",")),
        default=("flood", "heavy"),
        help="the background clients, comma-separated (default: flood,heavy); one alone "
        "shows its own part of the light client's delay",
    )
    ap.add_argument(
        "--stages",
        metavar="LOG",
        type=Path,
        default=None,
        help="the server at --log-level debug, its log to this file: also break the light "
        "client's TTFT into the server's stages, its steps and its threads' CPU, alone and "
        "under load (fair_load_stages.py)",
    )
    args = ap.parse_args()
    if args.quick:
        args.light_requests, args.warmup, args.settle, args.heavy_inputs = 20, 2.0, 1.0, 32
    server_args, log = list(args.server_arg), None
    if args.stages is not None:
        server_args += ["--log-level", "debug"]
        log = args.stages.open("w")
    proc, url = spawn(args.model, server_args, stderr=log)
    try:
        if args.model_name is None:
            args.model_name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        result = asyncio.run(measure(args, url, proc.pid))
        report(result)
    finally:
        proc.terminate()
        proc.wait(60)
        if log is not None:
            log.close()
    if args.stages is not None:
        phases = result["phases"]
        ttfts = {"alone": result["idle"], "load": result["loaded"]}
        text = args.stages.read_text()
        print()
        print(stages_markdown(ttfts, text, phases.windows, phases.threads), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
