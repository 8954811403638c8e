"""Regenerates the documentation's tables from their single sources.

- docs/usage.md, region `engine-options`: `aieng.EngineArgs.markdown_table()`, the options of
  `LLM(...)` and of the commands' flags;
- docs/operations.md, region `metrics`: every metric the server's registry
  (`aieng.server.metrics.ServerMetrics`) exports, with its type, labels and help.

A region is the text between `<!-- BEGIN name ... -->` and `<!-- END name -->`; nothing outside
it changes. `python scripts/gen_docs_tables.py` rewrites the pages; with `--check` it changes
nothing and exits 1 naming each stale region (tests/test_docs_tables.py runs that check).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def engine_options_table() -> str:
    from aieng.config.engine_args import EngineArgs

    return EngineArgs.markdown_table()


def metrics_table() -> str:
    """One row per metric family of a server's registry, built with every optional family
    switched on (a GPU's memory figures, a KV cache configuration, a load, a machine price)."""
    from prometheus_client import ProcessCollector
    from prometheus_client.metrics import MetricWrapperBase

    from aieng.engine.async_engine import EngineStats
    from aieng.server.metrics import ServerMetrics

    class Figures:  # stands in for aieng.worker.gpu_memory.GpuMemory
        def gauges(self) -> dict[str, float]:
            return {"weights": 0.0}

    metrics = ServerMetrics(
        "model",
        stats=lambda: EngineStats(
            kv_cache_dtype="float32",
            block_size=16,
            num_blocks=1,
            kernels={"attention_backend": "cpu", "linear_kernels": "", "cpu_isa": ""},
        ),
        gpu_memory=lambda: Figures(),
        cost_per_hour=1.0,
        load_phases=lambda: {"build": 0.0},
    )
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for collector in metrics.registry._collector_to_names:  # every collector, in order
        if isinstance(collector, ProcessCollector):
            continue
        if isinstance(collector, MetricWrapperBase):  # a Counter or Histogram of ServerMetrics
            families = [(collector._name, collector._type, collector._labelnames,
                         collector._documentation)]  # fmt: skip
        else:  # a custom collector: its families, with the labels of their samples
            families = [
                (f.name, f.type, _sample_labels(f), f.documentation) for f in collector.collect()
            ]
        for name, kind, labels, doc in families:
            shown = [label for label in labels if label != "model_name"]
            suffix = "_total" if kind == "counter" else ""
            rows.append(
                f"| `{name}{suffix}` | {kind} | {', '.join(f'`{x}`' for x in shown) or '—'} "
                f"| {doc} |"
            )
    return "\n".join(rows)


def _sample_labels(family) -> list[str]:
    names: list[str] = []
    for sample in family.samples:
        names += [label for label in sample.labels if label not in names]
    return names


REGIONS: dict[str, tuple[str, Callable[[], str]]] = {
    "engine-options": ("usage.md", engine_options_table),
    "metrics": ("operations.md", metrics_table),
}


def region_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN {name}\b[^\n]*-->\n)(.*?)(<!-- END {name} -->)", re.DOTALL)


def render(text: str, name: str, table: str) -> str:
    pattern = region_pattern(name)
    if len(pattern.findall(text)) != 1:
        raise SystemExit(f"{name}: expected one <!-- BEGIN {name} --> ... <!-- END {name} -->")
    return pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(3), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = ap.parse_args(argv)
    stale = []
    for name, (page, table) in REGIONS.items():
        path = DOCS / page
        text = path.read_text()
        new = render(text, name, table())
        if new == text:
            continue
        stale.append(f"docs/{page} ({name})")
        if not args.check:
            path.write_text(new)
    if stale and args.check:
        print("stale: " + ", ".join(stale) + "; run python scripts/gen_docs_tables.py")
        return 1
    for entry in stale:
        print(f"rewrote {entry}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
