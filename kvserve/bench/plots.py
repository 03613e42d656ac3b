"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

- ``latency_cdfs.png``: CDFs of TTFT, TPOT, ITL and end-to-end latency, one line per run.
- ``sweep.png`` (two or more runs): output and total throughput, and p50/p99 TTFT, against load.
- ``hit_rate_per_turn.png`` (multi-turn workloads, servers that report cached tokens): the share of each
  turn's prompt tokens the server found cached, one line per run.

``kvserve bench --compare NAME=FILE ...`` draws the same plots for several servers side by side from their
saved results (``compare_*.png``): a line per server (and per load, for sweeps).
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


def hit_rate_per_turn(result: dict[str, Any]) -> dict[int, float]:
    """Turn -> cached prompt tokens / prompt tokens over the successful requests of that turn that report
    both (percent)."""
    cached: dict[int, int] = {}
    prompt: dict[int, int] = {}
    for r in result["requests"]:
        if r["success"] and r.get("prompt_tokens") and r.get("cached_tokens") is not None:
            cached[r["turn"]] = cached.get(r["turn"], 0) + r["cached_tokens"]
            prompt[r["turn"]] = prompt.get(r["turn"], 0) + r["prompt_tokens"]
    return {turn: 100 * cached[turn] / prompt[turn] for turn in sorted(prompt)}


def plot_hit_rate_per_turn(labelled: Sequence[tuple[str, dict[str, Any]]], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, result in labelled:
        rates = hit_rate_per_turn(result)
        ax.plot([t + 1 for t in rates], list(rates.values()), "o-", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt tokens found cached (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Prefix-cache hit rate per turn")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _has_turns(results: Sequence[dict[str, Any]]) -> bool:
    return any(len(hit_rate_per_turn(r)) > 1 for r in results)


def write_plots(results: Sequence[dict[str, Any]], plot_dir: Path) -> list[Path]:
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency_cdfs(results, plot_dir / "latency_cdfs.png")]
    if len(results) > 1:
        paths.append(plot_sweep(results, plot_dir / "sweep.png"))
    if _has_turns(results):
        paths.append(plot_hit_rate_per_turn([(r["load"]["label"], r) for r in results],
                                            plot_dir / "hit_rate_per_turn.png"))
    logger.info("wrote %s", ", ".join(str(p) for p in paths))
    return paths


def plot_compare_sweep(servers: Sequence[tuple[str, Sequence[dict[str, Any]]]], path: Path) -> Path:
    """Output throughput and p50 TTFT against load, a line per server."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    kinds = {r["load"]["kind"] for _, results in servers for r in results}
    xlabel = "concurrency" if kinds == {"concurrency"} else "load (concurrency or req/s)"
    for name, results in servers:
        ordered = sorted(results, key=lambda r: r["load"]["value"])
        loads = [r["load"]["value"] for r in ordered]
        left.plot(loads, [r["summary"]["output_throughput"] for r in ordered], "o-", label=name)
        right.plot(loads, [r["summary"]["ttft_ms"]["p50"] or np.nan for r in ordered], "o-", label=name)
    for ax, title, ylabel in ((left, "Output throughput", "tokens/s"), (right, "p50 time to first token", "ms")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_comparison_plots(servers: Sequence[tuple[str, Sequence[dict[str, Any]]]], plot_dir: Path) -> list[Path]:
    """``servers``: (name, its results: one run or a sweep), each loaded from a ``kvserve bench --output``."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    multi_load = any(len(results) > 1 for _, results in servers)
    labelled = [(f"{name} {r['load']['label']}" if multi_load else name, r)
                for name, results in servers for r in results]
    runs = [{**r, "load": {**r["load"], "label": label}} for label, r in labelled]
    paths = [plot_latency_cdfs(runs, plot_dir / "compare_latency_cdfs.png")]
    if multi_load:
        paths.append(plot_compare_sweep(servers, plot_dir / "compare_sweep.png"))
    if _has_turns(runs):
        paths.append(plot_hit_rate_per_turn(labelled, plot_dir / "compare_hit_rate_per_turn.png"))
    logger.info("wrote %s", ", ".join(str(p) for p in paths))
    return paths
