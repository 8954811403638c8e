"""PNG charts of benchmark results (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aieng.benchmarks.offline import EngineRun


def plot_offline(runs: list[EngineRun], title: str, path: str | Path) -> None:
    """Output tokens/s per engine, and request latency percentiles (TTFT where measured)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from err
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [r.engine for r in runs]
    colors = ["#3b6ea8", "#c8693a"][: len(runs)]
    bars = left.bar(names, [r.tokens_per_s for r in runs], color=colors)
    left.bar_label(bars, fmt="%.0f")
    left.set_ylabel("output tokens / s")
    left.set_title("throughput")
    quantiles = (50, 90, 99)
    width = 0.8 / max(1, sum(1 for r in runs for s in (r.latency_s, r.ttft_s) if s))
    offset = 0
    for run in runs:
        for label, values in (("end to end", run.latency_s), ("TTFT", run.ttft_s)):
            if not values:
                continue
            ys = [float(np.percentile(values, q)) for q in quantiles]
            xs = [i + offset * width for i in range(len(quantiles))]
            right.bar(xs, ys, width, label=f"{run.engine} {label}")
            offset += 1
    right.set_xticks([i + width * (offset - 1) / 2 for i in range(len(quantiles))])
    right.set_xticklabels([f"p{q}" for q in quantiles])
    right.set_ylabel("seconds from the start of the run")
    right.set_title("request latency (all requests arrive at t=0)")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
