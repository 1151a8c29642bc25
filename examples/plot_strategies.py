#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Stage times per bundle from epmoe_strategies --json (or any epmoe::experiment JSON):
stacked bars of route, plan, permute, dispatch, experts, combine, shared and reduce (the
median of the slowest rank), one group per input ("uniform: ", "skewed: " prefixes), with
the simulator's predicted pass time as a marker where the JSON has one.

  python3 examples/plot_strategies.py strategies.json strategies.png
"""
import json
import sys

STAGES = ["route", "plan", "permute", "dispatch", "experts", "combine", "shared", "reduce"]


def main(argv):
    if len(argv) != 3 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if len(argv) > 1 and argv[1] in ("-h", "--help")
              else sys.stderr)
        return 0 if len(argv) > 1 and argv[1] in ("-h", "--help") else 2
    try:
        import matplotlib
    except ImportError:
        print("plot_strategies: matplotlib is not installed (python3-matplotlib): skipped",
              file=sys.stderr)
        return 77  # CTest's skip code for this test
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(argv[1]) as f:
        rows = json.load(f)
    if not rows:
        print(f"{argv[1]}: no rows", file=sys.stderr)
        return 1
    groups = {}
    for r in rows:
        prefix, _, name = r["bundle"].rpartition(": ")
        groups.setdefault(prefix or "", []).append((name, r))
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (title, entries) in zip(axes[0], groups.items()):
        names = [n for n, _ in entries]
        bottom = [0.0] * len(entries)
        for stage in STAGES:
            ms = [1e3 * (r.get(stage + "_s") or 0.0) for _, r in entries]
            ax.barh(names, ms, left=bottom, label=stage)
            bottom = [b + m for b, m in zip(bottom, ms)]
        predicted = [1e3 * (r.get("predicted_s") or 0.0) for _, r in entries]
        if any(predicted):
            ax.plot(predicted, names, "k|", markersize=14, label=f"sim ({entries[0][1]['topology']})")
        ax.invert_yaxis()
        ax.set_xlabel("ms: per stage the slowest rank's, median of passes")
        ax.set_title(title or "bundles")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(argv[2], dpi=120)
    print(f"wrote {argv[2]}: {len(rows)} bundles in {len(groups)} group(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
