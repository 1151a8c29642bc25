#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Plots a compare_torch.py result: time per token vs T (epmoe and PyTorch), and the layer's
efficiency against one BLAS GEMM and against the memory bound, vs T.

    /usr/bin/python3 bench/plot.py bench/results/results.json [--out-dir bench/results]

Writes time_per_token.png and efficiency.png (Debian: apt-get install python3-matplotlib).
"""
import argparse
import json
import os
import sys


def print_markdown(r):
    """The layer table (per shape and T) and the scaling table, as in README.md."""
    print("| shape | T | epmoe ms | PyTorch ms | speedup | expert GFLOP/s | 1-GEMM / layer "
          "| layer / its GEMMs | weights GB/s (of read bw) | slowest stages (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for p in r["points"]:
        e = p["epmoe"]
        stages = sorted(((v, k) for k, v in e["stage_ms"].items() if k != "total"), reverse=True)
        top = ", ".join(f"{k} {v:.1f}" for v, k in stages[:3] if v >= 0.05)
        print(f"| {p['shape']} | {p['tokens']} | {e['layer_ms']:.2f} | {p['torch']['ms']:.2f} | "
              f"**{p['speedup']:.2f}x** | {e['expert_gflops']:.0f} | {e['efficiency']:.2f} | "
              f"{e['overhead']:.2f} | {e['weight_gbs']:.1f} ({100 * e['weight_bw_fraction']:.0f}%) "
              f"| {top} |")
    if r.get("scaling"):
        print()
        print("| shape | comm | global tokens | ranks | dedup | ms | vs 1 rank | rows sent "
              "(without dedup) |")
        print("|---|---|---:|---:|---|---:|---:|---:|")
        for s in r["scaling"]:
            print(f"| {s['shape']} | {s['comm']} | {s['global_tokens']} | {s['ranks']} | "
                  f"{'yes' if s['dedup'] else 'no'} | {s['ms']:.1f} | "
                  f"{s.get('speedup_vs_1_rank') or 0:.2f}x | {s['rows_sent_off_rank']} "
                  f"({s['assignment_rows_sent_off_rank']}) |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results")
    p.add_argument("--out-dir", help="default: the results file's folder")
    p.add_argument("--markdown", action="store_true",
                   help="only print the results as Markdown tables (the README's)")
    a = p.parse_args()
    if a.markdown:
        with open(a.results) as f:
            print_markdown(json.load(f))
        return 0
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed (Debian: apt-get install python3-matplotlib)")
        return 77
    with open(a.results) as f:
        r = json.load(f)
    out = a.out_dir or os.path.dirname(os.path.abspath(a.results))
    shapes = list(dict.fromkeys(p["shape"] for p in r["points"]))
    machine = r["machine"]
    title = (f"{machine.get('cpu_model', machine.get('cpu'))}, {r['threads']} threads, "
             f"OpenBLAS core {machine['blas_core']}")

    # Time per token.
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        pts = [p for p in r["points"] if p["shape"] == shape]
        T = [p["tokens"] for p in pts]
        ax.plot(T, [p["epmoe"]["layer_ms"] / p["tokens"] for p in pts], "o-", label="epmoe")
        ax.plot(T, [p["torch"]["ms"] / p["tokens"] for p in pts], "s--", label="PyTorch (loop over experts)")
        for p in pts:
            ax.annotate(f"{p['speedup']:.1f}x", (p["tokens"], p["epmoe"]["layer_ms"] / p["tokens"]),
                        textcoords="offset points", xytext=(0, -13), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank (T)")
        ax.set_ylabel("ms per token")
        ax.set_title(f"{shape}: forward time per token")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "time_per_token.png"), dpi=110)

    # Efficiency: one BLAS GEMM of the same FLOPs / layer; weight bytes / time vs read bandwidth.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for shape in shapes:
        pts = [p for p in r["points"] if p["shape"] == shape]
        T = [p["tokens"] for p in pts]
        axes[0].plot(T, [p["epmoe"]["efficiency"] for p in pts], "o-", label=shape)
        axes[1].plot(T, [p["epmoe"]["weight_bw_fraction"] for p in pts], "o-", label=shape)
    axes[0].axhline(0.85, color="gray", ls=":", label="target at T=4096 (0.85)")
    axes[0].set_title("compute bound: one-GEMM time / layer time")
    axes[1].axhline(0.80, color="gray", ls=":", label="target at T<=16 (0.80)")
    axes[1].set_title("memory bound: weight bytes / time / read bandwidth")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank (T)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "efficiency.png"), dpi=110)
    print(f"wrote {os.path.join(out, 'time_per_token.png')} and efficiency.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
