"""What a long load test watches over time, beside each request's outcome:

- **samples** every `--sample-every` seconds from the server's `/metrics`: its resident memory
  (`process_resident_memory_bytes`), running and waiting requests, KV usage — and this
  machine's 1-minute load average (client and server share the CPUs);
- **windows**: completed requests, output tokens/s and TTFT/TPOT p50/p99 per `--window`
  seconds of arrivals (a soak's stability at a glance);
- **a version switch under load** (`--switch-version V --switch-at S --admin-key K`, against
  `aieng serve --model-dir`): at S seconds the new version is loaded through the admin API;
  the run notes when it started serving and when the old version was freed, and reports the
  requests sent before, during and after the switch separately.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class Timeline:
    samples: list[dict[str, float]] = field(default_factory=list)
    switch: dict[str, Any] | None = None


@dataclass
class Outcome:
    kind: str
    sent_at: float  # seconds since the load started
    status: int | None = None
    category: str = "failed"  # completed, refused_<status>, aborted_client, aborted_server
    finish_reason: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    detail: str | None = None


def _quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


async def sample_server(
    url: str, every: float, start: float, stop: asyncio.Event, timeline: Timeline
) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            row: dict[str, float] = {"t": time.perf_counter() - start, "load1": os.getloadavg()[0]}
            try:
                text = (await client.get(f"{url}/metrics")).text
                values = await asyncio.to_thread(_parse, text)
                row["rss_bytes"] = values.get("process_resident_memory_bytes", float("nan"))
                row["running"] = values.get("aieng_num_requests_running", float("nan"))
                row["waiting"] = values.get("aieng_num_requests_waiting", float("nan"))
                row["kv_usage"] = values.get("aieng_kv_cache_usage_perc", float("nan"))
            except httpx.HTTPError as error:
                row["error"] = str(error)  # type: ignore[assignment]
            timeline.samples.append(row)
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass


def _parse(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def switch_version(
    url: str, model: str, version: str, at: float, admin_key: str, start: float, timeline: Timeline
) -> None:
    """At `at` seconds: load `version`, then note when it serves and when the old one is freed."""
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    name = model.partition("@")[0]
    headers = {"Authorization": f"Bearer {admin_key}"}
    record: dict[str, Any] = {"version": version, "requested_s": time.perf_counter() - start}
    timeline.switch = record
    async with httpx.AsyncClient(timeout=30) as client:
        before = (await client.get(f"{url}/admin/models", headers=headers)).json()
        record["from"] = before["serving"]
        response = await client.post(
            f"{url}/admin/models/{name}/load", json={"version": version}, headers=headers
        )
        if response.status_code != 202:
            record["error"] = f"{response.status_code} {response.text}"
            return
        old = before["serving"].partition("@")[2]
        while True:
            listing = (await client.get(f"{url}/admin/models", headers=headers)).json()
            states = {v["version"]: v for v in listing["data"]}
            now = time.perf_counter() - start
            if states[version]["state"] == "failed":
                record["error"] = states[version].get("error")
                return
            if states[version]["state"] == "serving" and "serving_s" not in record:
                record["serving_s"] = now
                record["load_s"] = states[version].get("load_s")
            if states[old]["state"] == "unloaded":
                record["old_freed_s"] = now
                record["rss_before_unload"] = states[old].get("rss_before_unload")
                record["rss_after_unload"] = states[old].get("rss_after_unload")
                return
            await asyncio.sleep(0.2)


def _stats(outcomes: list[Outcome]) -> dict[str, Any]:
    completed = [o for o in outcomes if o.category == "completed"]
    return {
        "sent": len(outcomes),
        "completed": len(completed),
        "failed": sum(o.category == "failed" for o in outcomes),
        "refused": sum(o.category.startswith("refused") for o in outcomes),
        "ttft_s": _quantiles([o.ttft for o in outcomes if o.ttft is not None]),
        "tpot_s": _quantiles([o.tpot for o in completed if o.tpot is not None]),
    }


def switch_phases(outcomes: list[Outcome], switch: dict[str, Any]) -> dict[str, Any]:
    """Requests by when they were sent: before the load was asked for, during (until the old
    version was freed), after."""
    begin, end = switch["requested_s"], switch.get("old_freed_s", float("inf"))
    phases = {
        "before": [o for o in outcomes if o.sent_at < begin],
        "during": [o for o in outcomes if begin <= o.sent_at < end],
        "after": [o for o in outcomes if o.sent_at >= end],
    }
    return {name: _stats(group) for name, group in phases.items()}


def windows(outcomes: list[Outcome], width: float, duration: float) -> list[dict[str, Any]]:
    rows = []
    for begin in np.arange(0.0, duration, width):
        group = [o for o in outcomes if begin <= o.sent_at < begin + width]
        stats = _stats(group)
        tokens = sum(o.tokens for o in group if o.category == "completed")
        rows.append({"start_s": float(begin), "out_tok_s": tokens / width, **stats})
    return rows


def markdown(result: dict[str, Any]) -> list[str]:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    lines: list[str] = []
    switch = result.get("switch")
    if switch is not None:
        serving = switch.get("serving_s", float("nan"))
        lines += [
            "",
            f"Version switch under load: {switch.get('from')} -> {switch['version']} asked at "
            f"{switch['requested_s']:.1f} s; serving from {serving:.1f} s "
            f"(loaded in {switch.get('load_s')} s); the old version freed at "
            f"{switch.get('old_freed_s', float('nan')):.1f} s (server RSS "
            f"{_mib(switch.get('rss_before_unload'))} -> {_mib(switch.get('rss_after_unload'))} "
            f"MiB). {switch.get('error') or ''}",
            "",
            "| requests sent | sent | completed | refused | failed | TTFT p50 / p99 ms | "
            "TPOT p50 / p99 ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, s in result["switch_phases"].items():
            lines.append(
                f"| {name} the switch | {s['sent']} | {s['completed']} | {s['refused']} | "
                f"{s['failed']} | {ms(s['ttft_s']['p50'])} / {ms(s['ttft_s']['p99'])} | "
                f"{ms(s['tpot_s']['p50'])} / {ms(s['tpot_s']['p99'])} |"
            )
    rows = result.get("windows") or []
    if rows:
        samples = result.get("samples") or []
        lines += [
            "",
            f"Over time ({rows[1]['start_s'] - rows[0]['start_s']:.0f}-second windows of arrivals"
            if len(rows) > 1
            else "Over time (one window",
        ]
        lines[-1] += "; server RSS and load average sampled at the window's end):"
        lines += [
            "",
            "| window start s | sent | completed | failed | out tok/s | TTFT p50 / p99 ms | "
            "TPOT p50 / p99 ms | server RSS MiB | load avg |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            end = row["start_s"] + (rows[1]["start_s"] - rows[0]["start_s"] if len(rows) > 1 else 0)
            sample = min(samples, key=lambda s: abs(s["t"] - end)) if samples else {}
            lines.append(
                f"| {row['start_s']:.0f} | {row['sent']} | {row['completed']} | {row['failed']} | "
                f"{row['out_tok_s']:.1f} | {ms(row['ttft_s']['p50'])} / {ms(row['ttft_s']['p99'])} "
                f"| {ms(row['tpot_s']['p50'])} / {ms(row['tpot_s']['p99'])} | "
                f"{_mib(sample.get('rss_bytes'))} | {sample.get('load1', float('nan')):.1f} |"
            )
    return lines


def _mib(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value / 2**20:.1f}"


def plot(result: dict[str, Any], path) -> None:
    """Server RSS, output tokens/s and TTFT p99 over the run, the switch marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [s for s in result.get("samples") or [] if "rss_bytes" in s]
    rows = result.get("windows") or []
    fig, (rss, tput, ttft) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    if samples:
        rss.plot([s["t"] for s in samples], [s["rss_bytes"] / 2**20 for s in samples])
    rss.set_ylabel("server RSS (MiB)")
    centers = [r["start_s"] for r in rows]
    tput.plot(centers, [r["out_tok_s"] for r in rows], marker="o")
    tput.set_ylabel("output tok/s")
    ttft.plot(centers, [(r["ttft_s"]["p99"] or 0) * 1000 for r in rows], marker="o", label="p99")
    ttft.plot(centers, [(r["ttft_s"]["p50"] or 0) * 1000 for r in rows], marker="o", label="p50")
    ttft.set_ylabel("TTFT (ms)")
    ttft.set_xlabel("seconds since the load started")
    ttft.legend()
    switch = result.get("switch")
    if switch is not None:
        for axis in (rss, tput, ttft):
            for key in ("requested_s", "old_freed_s"):
                if key in switch:
                    axis.axvline(switch[key], color="red", linestyle="--", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
