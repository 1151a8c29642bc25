#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Draws a run report of epmoe (include/epmoe/core/report.hpp) to PNG.

  plot_stats.py STATS.jsonl [--trace TRACE.json] [--pass P] [--out PREFIX]

writes PREFIX_load.png: the expert x rank heat map of one pass (rows each source rank routed
to each expert, from the stats lines' routed_per_expert), with the rows each rank's experts
computed beside it; and PREFIX_timeline.png: the stage timeline per rank, from the trace when
given (every chunk and round of dispatch / experts / combine), else from the stats lines'
stage start times and durations. Uses Debian's matplotlib (apt-get install python3-matplotlib).
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STAGES = ["route", "plan", "permute", "shared", "dispatch", "experts", "combine", "reduce"]
COLORS = {
    "route": "#8c564b", "plan": "#7f7f7f", "permute": "#bcbd22", "shared": "#17becf",
    "dispatch": "#1f77b4", "experts": "#2ca02c", "combine": "#ff7f0e", "reduce": "#9467bd",
}


def read_stats(path):
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    sys.exit(f"{path}:{n}: not a JSON line: {e}")
    if not records:
        sys.exit(f"{path}: no stats lines")
    return records


def plot_load(records, pass_, out):
    rows = sorted((r for r in records if r.get("pass", 0) == pass_), key=lambda r: r["rank"])
    if not rows:
        sys.exit(f"no stats lines of pass {pass_}")
    ranks = [r["rank"] for r in rows]
    load = [r["routed_per_expert"] for r in rows]  # [rank][expert]
    experts = max(len(v) for v in load)
    load = [v + [0] * (experts - len(v)) for v in load]
    computed = [sum(r.get("rows_per_local_expert", [])) for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(min(4 + 0.25 * experts, 20), 1.5 + 0.4 * len(ranks)),
                                 gridspec_kw={"width_ratios": [5, 1]}, squeeze=True)
    im = ax.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("source rank")
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_title(f"rows routed per (rank, expert), pass {pass_}")
    fig.colorbar(im, ax=ax, label="rows")
    bx.barh(range(len(ranks)), computed, color="#2ca02c")
    bx.set_ylim(len(ranks) - 0.5, -0.5)
    bx.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    bx.set_xlabel("rows computed")
    bx.set_title("expert load")
    drops = sum(r.get("dropped", 0) for r in rows)
    rounds = max(r.get("rounds", 1) for r in rows)
    fig.suptitle(f"dropped {drops}, exchange rounds {rounds}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def spans_from_trace(path):
    """(rank, stage, start s, duration s, label) of every slice of the trace."""
    with open(path) as f:
        trace = json.load(f)
    spans = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") == "pass":
            continue
        a = e.get("args", {})
        label = f"c{a['chunk']}" + (f".{a['round']}" if a.get("round") else "") if "chunk" in a else ""
        spans.append((e["pid"], e["name"], e["ts"] * 1e-6, e["dur"] * 1e-6, label))
    return spans


def spans_from_stats(records, pass_):
    spans = []
    for r in records:
        if r.get("pass", 0) != pass_:
            continue
        for s in STAGES:
            d = r["time"].get(s) or 0
            if d > 0:
                spans.append((r["rank"], s, r["started"] + r["began"][s], d, ""))
    return spans


def plot_timeline(spans, out, title):
    if not spans:
        sys.exit("nothing to draw on the timeline")
    t0 = min(s[2] for s in spans)
    ranks = sorted({s[0] for s in spans})
    lane = {s: i for i, s in enumerate(STAGES)}
    fig, ax = plt.subplots(figsize=(12, 1 + 1.2 * len(ranks)))
    h = 0.8 / len(STAGES)
    seen = {}
    for rank, stage, start, dur, label in spans:
        y = ranks.index(rank) + lane.get(stage, 0) * h - 0.4
        # Pipelined exchanges overlap: alternate units between the two halves of the lane.
        n = seen.get((rank, stage), 0)
        seen[(rank, stage)] = n + 1
        sub = h / 2 if label else h
        ax.barh(y + (n % 2) * sub if label else y, dur * 1e3, left=(start - t0) * 1e3, height=sub,
                color=COLORS.get(stage, "k"), align="edge", edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel("ms")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[s]) for s in STAGES]
    ax.legend(handles, STAGES, ncol=len(STAGES), fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stats", help="stats JSON lines (write_stats_json)")
    p.add_argument("--trace", help="Chrome trace (write_trace_json) for the timeline")
    p.add_argument("--pass", dest="pass_", type=int, default=None, help="pass to draw (default: last)")
    p.add_argument("--out", default="epmoe", help="output prefix (default: epmoe)")
    args = p.parse_args()
    records = read_stats(args.stats)
    pass_ = args.pass_ if args.pass_ is not None else max(r.get("pass", 0) for r in records)
    plot_load(records, pass_, f"{args.out}_load.png")
    if args.trace:
        spans, title = spans_from_trace(args.trace), "stages per rank (every pass in the trace)"
    else:
        spans, title = spans_from_stats(records, pass_), f"stages per rank, pass {pass_}"
    plot_timeline(spans, f"{args.out}_timeline.png", title)
    print(f"wrote {args.out}_load.png and {args.out}_timeline.png")


if __name__ == "__main__":
    main()
