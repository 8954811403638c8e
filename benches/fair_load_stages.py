"""Where the light client's time to first token goes, for `fair_load.py --stages`.

The server runs with `--log-level debug`, its log in a file: each request's line carries
`stages=` (seconds in each stage, each from the one before: see docs/operations.md) and the
engine thread logs each step (`step tokens= step_s= cpu_s= turn_s=`). The light client names
its requests (`X-Request-Id: light-<phase>-<n>`), so each of its lines is matched with the
TTFT the client measured; what the client saw beyond the server's span from arrival to the
first chunk sent is split, on the machine's monotonic clock, into the time before the server's
app saw the request (`to_server`: the request in the socket, uvicorn reading it) and after it
sent the chunk (`to_client`: the client's process reading it).

The server's threads are also sampled from /proc (`schedstat`: CPU time and time runnable but
waiting for a core) over each phase: the event loop, the engine thread and the kernels' pool
workers, and whether they lost their cores to the others.
"""

from __future__ import annotations

import os
import re
import statistics
from datetime import datetime, timedelta
from pathlib import Path

ORDER = (
    "body_read",
    "parsed",
    "prepared",
    "gate",
    "queued",
    "scheduled",
    "first_token",
    "delivered",
    "engine",  # a server before the engine's own stages: queued to delivered in one
    "sent",
)
_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"


def parse_log(
    text: str,
) -> tuple[dict[str, tuple[dict, float | None]], list[tuple[datetime, dict]]]:
    """By request id, each request line's stage seconds and arrival (time.monotonic()); and
    the steps' lines (their time and fields)."""
    requests: dict[str, tuple[dict, float | None]] = {}
    steps: list[tuple[datetime, dict]] = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        fields = dict(part.split("=", 1) for part in match[2].split(" ") if "=" in part)
        if match[2].startswith("step "):
            at = datetime.strptime(match[1], _TIME_FORMAT)
            steps.append((at, {k: float(v) for k, v in fields.items()}))
        elif "stages" in fields and "request_id" in fields:
            stages = dict(part.split(":") for part in fields["stages"].split(","))
            seconds = {k: float(v) for k, v in stages.items()}
            arrival = float(fields["arrival"]) if "arrival" in fields else None
            requests[fields["request_id"]] = (seconds, arrival)
    return requests, steps


def thread_times(pid: int) -> dict[str, tuple[float, float]]:
    """Per thread name (threads of one name summed; the server names its own: the engine's
    loop, its pools): seconds on a CPU and seconds runnable but waiting for one, since each
    thread started. Unnamed threads (torch's, asyncio's default pool) are `python`."""
    out: dict[str, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        if task.name == str(pid):
            name = "main: event loop"
        name = re.sub(r"\d+$", "N", name)  # one row for a pool's threads
        cpu, wait = out.get(name, (0.0, 0.0))
        out[name] = (cpu + int(run_ns) / 1e9, wait + int(wait_ns) / 1e9)
    return out


def process_cpu(pid: int) -> float:
    """Seconds the process (all its threads) has had on a CPU; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """Seconds all the machine's cores have been busy (not idle, not waiting for I/O)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def thread_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], seconds: float
) -> dict[str, tuple[float, float]]:
    """Per thread name: its share of one core on a CPU, and waiting for one, over `seconds`."""
    delta = {}
    for name, (cpu, wait) in after.items():
        cpu0, wait0 = before.get(name, (0.0, 0.0))
        if cpu - cpu0 > 0.001 * seconds or wait - wait0 > 0.001 * seconds:
            delta[name] = ((cpu - cpu0) / seconds, (wait - wait0) / seconds)
    return delta


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


COLUMNS = ("to_server", *ORDER, "to_client", "ttft")


def stage_rows(phase_ttft: dict[str, dict], requests: dict) -> dict[str, dict]:
    """Per phase: per stage, the seconds of each light request: `to_server` from the client's
    send to the server's arrival (the request in the socket, uvicorn reading its headers: the
    event loop's turns), the server's stages, then `to_client` from its first chunk sent to the
    client's reading it (the client's process)."""
    table: dict[str, dict[str, list[float]]] = {}
    for phase, sent in phase_ttft.items():
        columns: dict[str, list[float]] = {name: [] for name in COLUMNS}
        for request_id, (start, ttft) in sent.items():
            if request_id not in requests:
                continue
            stages, arrival = requests[request_id]
            if arrival is None:  # a server that does not log it: all the time outside here
                arrival = start + ttft - sum(stages.values())
            columns["to_server"].append(max(0.0, arrival - start))
            for name in ORDER:
                columns[name].append(stages.get(name, 0.0))
            columns["to_client"].append(max(0.0, start + ttft - arrival - sum(stages.values())))
            columns["ttft"].append(ttft)
        table[phase] = columns
    return table


def markdown(
    phase_ttft: dict[str, dict[str, float]],
    log_text: str,
    windows: dict[str, tuple[datetime, datetime]],
    threads: dict[str, dict[str, tuple[float, float]]],
) -> str:
    requests, steps = parse_log(log_text)
    table = stage_rows(phase_ttft, requests)
    alone, loaded = table["alone"], table["load"]
    lines = [
        f"light requests matched in the log: {len(alone['ttft'])} alone, "
        f"{len(loaded['ttft'])} under load",
        "",
        "| stage (ms) | alone p50 | alone p99 | load p50 | load p99 | load mean | "
        "share of load mean | mean added by load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if not loaded["ttft"] or not alone["ttft"]:
        return "\n".join(lines[:1]) + "\n"
    total = statistics.fmean(loaded["ttft"])
    for name in COLUMNS:
        a, b = alone[name], loaded[name]
        if not any(a) and not any(b):  # a stage this server does not mark
            continue
        added = statistics.fmean(b) - statistics.fmean(a)
        lines.append(
            f"| {name} | {1000 * statistics.median(a):.2f} | {1000 * _pct(a, 0.99):.2f} | "
            f"{1000 * statistics.median(b):.2f} | {1000 * _pct(b, 0.99):.2f} | "
            f"{1000 * statistics.fmean(b):.2f} | {100 * statistics.fmean(b) / total:.0f}% | "
            f"{1000 * added:+.2f} |"
        )
    lines += ["", "| engine steps | alone | under load |", "|---|---|---|"]
    by_phase = {  # the steps that started in the phase (its log line comes at the end)
        phase: [f for at, f in steps if start <= at - timedelta(seconds=f["turn_s"]) <= end]
        for phase, (start, end) in windows.items()
    }

    def cell(phase: str, fn) -> str:
        rows = by_phase.get(phase, [])
        return fn(rows) if rows else "-"

    def q(key: str, p: float):
        return lambda rows: f"{1000 * _pct([r[key] for r in rows], p):.2f}"

    for label, fn in (
        ("steps", lambda rows: str(len(rows))),
        ("tokens p50", lambda rows: f"{statistics.median(r['tokens'] for r in rows):.0f}"),
        ("step ms p50", q("step_s", 0.5)),
        ("step ms p99", q("step_s", 0.99)),
        (
            "engine thread on a CPU / step wall (sum)",
            lambda rows: f"{sum(r['cpu_s'] for r in rows) / sum(r['step_s'] for r in rows):.2f}",
        ),
        (
            "turn ms beyond the step p50",
            lambda rows: f"{1000 * statistics.median(r['turn_s'] - r['step_s'] for r in rows):.2f}",
        ),
    ):
        lines.append(f"| {label} | {cell('alone', fn)} | {cell('load', fn)} |")
    lines += [
        "",
        "| server thread | alone: on CPU / waiting for one (cores) | "
        "under load: on CPU / waiting for one (cores) |",
        "|---|---|---|",
    ]
    names = sorted(set(threads.get("alone", {})) | set(threads.get("load", {})))
    names = [n for n in names if not n.startswith("process: ")] + sorted(
        n for n in names if n.startswith("process: ")
    )
    for name in names:
        cells = []
        for phase in ("alone", "load"):
            cpu, wait = threads.get(phase, {}).get(name, (0.0, 0.0))
            cells.append(f"{cpu:.2f} / {wait:.2f}")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"
