"""Plots and a markdown table from benchmarks/serve_compare.py's summary.json.

    python benchmarks/plot_serve_compare.py bench_results/serve/summary.json \
        docs/results/serve-compare-vs-vllm-llamacpp-CPU-DATE.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from serve_compare import print_markdown_table  # noqa: E402  (a sibling script)


def main() -> None:
    summary = json.loads(open(sys.argv[1]).read())
    series: dict[tuple[str, str], list[tuple[int, dict]]] = defaultdict(list)
    for key, s in summary.items():
        server, workload, conc = key.split("/")
        series[(workload, server)].append((int(conc[1:]), s))
    workloads = sorted({w for w, _ in series})
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 7), squeeze=False)
    for col, workload in enumerate(workloads):
        for (w, server), points in sorted(series.items()):
            if w != workload:
                continue
            points.sort()
            xs = [c for c, _ in points]
            axes[0][col].plot(xs, [s["output_throughput"] for _, s in points], marker="o", label=server)
            axes[1][col].plot(xs, [s["ttft_ms"]["p50"] for _, s in points], marker="o", label=server)
        axes[0][col].set_title(f"{workload}: output tokens/s")
        axes[1][col].set_title(f"{workload}: TTFT p50 (ms)")
        axes[1][col].set_yscale("log")
        for row in range(2):
            axes[row][col].set_xscale("log", base=2)
            axes[row][col].set_xlabel("concurrency")
            axes[row][col].legend()
            axes[row][col].grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct, 2 CPU cores: kvserve vs peers (benchmarks/serve_compare.py)")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=80)

    print_markdown_table(summary)

if __name__ == "__main__":
    main()
