"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

- ``latency_cdfs.png``: CDFs of TTFT, TPOT, ITL and end-to-end latency, one line per run.
- ``sweep.png`` (two or more runs): output and total throughput, and p50/p99 TTFT, against load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(result: dict[str, Any]) -> dict[str, list[float]]:
    ok = [r for r in result["requests"] if r["success"]]
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    return {
        "TTFT": [r["ttft_s"] * 1e3 for r in ok],
        "TPOT": [t * 1e3 for t in tpot],
        "ITL": [g * 1e3 for r in ok for g in r["itl_s"]],
        "E2E latency": [r["e2e_s"] * 1e3 for r in ok],
    }


def plot_latency_cdfs(results: Sequence[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, metric in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E latency"), strict=True):
        for result in results:
            values = np.sort(np.asarray(_series(result)[metric]))
            if values.size == 0:
                continue
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=result["load"]["label"])
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(metric)
    axes.flat[0].legend(fontsize=8)
    workload = results[0]["config"]["workload"]["name"] if results else ""
    fig.suptitle(f"Latency CDFs ({workload})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(results: Sequence[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    loads = [r["load"]["value"] for r in results]
    kind = results[0]["load"]["kind"]
    xlabel = "concurrency" if kind == "concurrency" else "request rate (req/s)"
    s = [r["summary"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(loads, [x["output_throughput"] for x in s], "o-", label="output tok/s")
    left.plot(loads, [x["total_token_throughput"] for x in s], "s--", label="total tok/s")
    left.set_xlabel(xlabel)
    left.set_ylabel("tokens/s")
    left.set_title("Throughput")
    left.legend()
    left.grid(alpha=0.3)
    for p, style in ((50, "o-"), (99, "s--")):
        right.plot(loads, [x["ttft_ms"][f"p{p}"] or np.nan for x in s], style, label=f"p{p} TTFT")
    right.set_xlabel(xlabel)
    right.set_ylabel("ms")
    right.set_title("Time to first token")
    right.legend()
    right.grid(alpha=0.3)
    if len(set(loads)) > 1 and min(loads) > 0 and max(loads) / min(loads) >= 8:
        left.set_xscale("log", base=2)
        right.set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: Sequence[dict[str, Any]], plot_dir: Path) -> list[Path]:
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency_cdfs(results, plot_dir / "latency_cdfs.png")]
    if len(results) > 1:
        paths.append(plot_sweep(results, plot_dir / "sweep.png"))
    logger.info("wrote %s", ", ".join(str(p) for p in paths))
    return paths
