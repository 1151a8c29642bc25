#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Expert parallelism on 2 processes: transformers 5's own against epmoe's, at the MoE block.

Two gloo processes (torch.multiprocessing), the same seeded tiny Mixtral model on each. The
sides, interleaved within each repetition (the order reversed every other one):
  hf:all_to_all, hf:all_reduce   a decoder layer's MixtralSparseMoeBlock of the model distributed
        by transformers (DistributedConfig(tp_size=2, ep_size=2, ep_implementation=...), applied
        with prepare_distribute_model / maybe_distribute_model): each process holds 4 of the 8
        experts, its experts run with --experts-impl (grouped_mm by default). Under tp_size=2 the
        two processes share one batch of T tokens: all_to_all splits it in halves, exchanges the
        (token, expert) rows, and all-gathers the outputs; all_reduce runs each process's experts
        on all T tokens (off-rank routes masked) and sums the outputs;
  epmoe  MoE.from_hf(block, group=WORLD) (4 experts per process, packed weights in eval mode) on
        the same split: each process passes its half of the T tokens (the first process the extra
        one when T is odd), and an all_gather gives both processes all T outputs, as all_to_all does.
Every side's output is checked against the undistributed block before anything is timed. A
pass's time is the slower process's (barrier, cache eviction, then the pass; the max over the
processes); medians of the repetitions. Each process runs --threads torch threads (default 1:
the 2 processes take the 2 cores) and as many OpenBLAS threads.

    PYTHONPATH=build/py/python build/venv/bin/python bench/hf_ep_bench.py
        [--tokens 1,4,16,64,1024] [--hidden 1024 --ffn 3584 --experts 8 --top-k 2]
        [--json out.json] [--smoke]

T: the batch both processes share (decode: T = 1, 4, 16, 64 sequences of one new token;
prefill: T = 1024). Goal (PASS/MISS): best HF / epmoe >= 1.5x at every T. Exits 77 without
torch, transformers 5, gloo or the epmoe package.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_torch as ct  # noqa: E402
import hf_common as hc  # noqa: E402 - the model, transformers' EP, the 2 processes

SKIP = 77
GOAL = 1.5
EP_IMPLS = hc.EP_IMPLS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,4,16,64,1024", help="the shared batch T")
    hc.add_model_args(p)
    ct.add_fairness_args(p)
    p.set_defaults(threads=1, min_reps=5, max_reps=30, min_seconds=1.0, wait_idle=30.0)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--smoke", action="store_true", help="a tiny model, T = 1, 16, 2 repetitions")
    p.add_argument("--markdown", metavar="JSON", help="print the table of an earlier run's JSON "
                   "(README form) and exit")
    a = p.parse_args(argv)
    if a.smoke:
        hc.smoke_shape(a)
        if a.tokens == p.get_default("tokens"):
            a.tokens = "1,16"
        a.min_reps, a.max_reps, a.min_seconds, a.wait_idle = 2, 2, 0.0, 0.0
    try:
        a.tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {a.tokens}: a comma-separated list of integers")
    if not a.tokens or min(a.tokens) < 1:
        p.error("--tokens: each T must be >= 1")
    if a.experts % 2:
        p.error(f"--experts {a.experts}: must split over 2 processes")
    return a


def distributed_block(torch, args, ref, ep_impl):
    return hc.hf_distributed(torch, args, ref, ep_impl).model.layers[0].mlp


def halves(T, rank):
    first = (T + 1) // 2
    return (0, first) if rank == 0 else (first, T)


class Sides:
    def __init__(self, torch, dist, blocks, moe, args, T, flush):
        self.torch, self.dist, self.blocks, self.moe, self.flush = torch, dist, blocks, moe, flush
        self.T, self.H = T, args.hidden
        self.xs = ct.token_batches(torch, T, args.hidden, 100)  # the same on both processes
        self.rows = (T + 1) // 2
        self.gather = [torch.empty(self.rows, args.hidden) for _ in range(2)]
        self.sides = [f"hf:{i}" for i in blocks] + ["epmoe"]

    def forward(self, side, x):
        torch = self.torch
        if side != "epmoe":
            out = self.blocks[side[3:]](x.view(1, *x.shape))
            return (out[0] if isinstance(out, tuple) else out).view(self.T, self.H)
        lo, hi = halves(self.T, self.dist.get_rank())
        y = self.moe(x[lo:hi])[0]
        if hi - lo < self.rows:  # the second half of an odd T: one row short
            y = torch.cat([y, y.new_zeros(self.rows - (hi - lo), self.H)])
        self.dist.all_gather(self.gather, y.contiguous())
        return torch.cat(self.gather)[:self.T]

    def run(self, side, i):
        torch, dist = self.torch, self.dist
        x = self.xs[i % 4]
        self.flush.sum()
        dist.barrier()
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.forward(side, x)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def one(self, i):
        order = self.sides if i % 2 == 0 else self.sides[::-1]
        return {s: self.run(s, max(i, 0)) for s in order}


def check_same(torch, sides, ref_block):
    x = sides.xs[0]
    with torch.inference_mode():
        want = ref_block(x.view(1, *x.shape)).view(sides.T, sides.H)
        out = {s: float((sides.forward(s, x) - want).abs().max() / want.abs().max())
               for s in sides.sides}
    bad = {s: d for s, d in out.items() if not d <= 1e-4}
    if bad:
        raise SystemExit(f"hf_ep_bench: T={sides.T}: {bad} differ from the undistributed block "
                         "(max relative > 1e-4): they would not compare the same thing")
    return out


def worker(rank, args, port):
    dist = hc.init_worker(rank, port)
    import torch
    from epmoe.torch import MoE
    torch.set_num_threads(args.threads)
    ref = hc.seeded_model(torch, args)
    ref_block = ref.model.layers[0].mlp
    blocks = {impl: distributed_block(torch, args, ref, impl) for impl in EP_IMPLS}
    local = blocks["all_to_all"].experts
    moe = MoE.from_hf(ref_block, group=dist.group.WORLD, max_tokens=max(args.tokens) + 1)
    del ref.model.embed_tokens, ref.lm_head
    flush = torch.ones(96 << 18)
    points = []
    if rank == 0:
        print(f"each process: {local.num_experts} of {args.experts} experts (transformers: "
              f"gate_up_proj {type(local.gate_up_proj).__name__} local "
              f"{list(getattr(local.gate_up_proj, 'to_local', lambda: local.gate_up_proj)().shape)}"
              f"; epmoe: w1 {list(moe.w1.shape)}), experts implementation {args.experts_impl}")
        print(f"\n{'T':>5} {'all_to_all ms':>14} {'all_reduce ms':>14} {'best HF':>11} "
              f"{'epmoe ms':>10} {'HF/epmoe':>9}  epmoe stages (process 0)")
    for T in args.tokens:
        sides = Sides(torch, dist, blocks, moe, args, T, flush)
        diffs = check_same(torch, sides, ref_block)
        if rank == 0 and args.wait_idle > 0:
            ct.wait_idle(args.wait_idle)
        dist.barrier()
        with hc.pair_meter(torch, dist) as others:
            stages = []
            def one(i):  # noqa: E306 - the epmoe stages of this process, after each repetition
                r = sides.one(i)
                stages.append(dict(moe.stats()["time"]))
                return r
            reps = ct.repeat(args, one)
        ms = {s: ct.median([r[s] for r in reps]) * 1e3 for s in sides.sides}
        hf = {s[3:]: v for s, v in ms.items() if s != "epmoe"}
        best = min(hf, key=hf.get)
        st = {k: ct.median([s[k] for s in stages[1:]]) * 1e3 for k in stages[0]}
        p = {"tokens": T, "hf_ms": hf, "best": best, "best_ms": hf[best], "epmoe_ms": ms["epmoe"],
             "speedup": hf[best] / ms["epmoe"], "epmoe_stage_ms": st, "reps": len(reps),
             "outputs_max_rel_diff": diffs, "other_processes_cpu_share": others.share}
        points.append(p)
        if rank == 0:
            import hf_block_bench as hb
            busy = (f"  (busy: others {100 * others.share:.0f}%)" if others.share > 0.05 else "")
            print(f"{T:>5} {hf['all_to_all']:>14.3f} {hf['all_reduce']:>14.3f} {best:>11} "
                  f"{ms['epmoe']:>10.3f} {p['speedup']:>8.2f}x  {hb.dominant(st)}{busy}", flush=True)
    if rank == 0:
        hc.write_out(args, points)
    dist.barrier()
    dist.destroy_process_group()


def markdown(result):
    out = ["| T | all_to_all ms | all_reduce ms | epmoe ms | best HF / epmoe | epmoe's largest stage "
           "| others' CPU share |", "|---:|---:|---:|---:|---:|---|---:|"]
    import hf_block_bench as hb
    for p in result["points"]:
        ratio = f"{p['speedup']:.2f}x"
        out.append(f"| {p['tokens']} | {p['hf_ms']['all_to_all']:.2f} | {p['hf_ms']['all_reduce']:.2f} "
                   f"| {p['epmoe_ms']:.2f} | " + (f"**{ratio}**" if p["speedup"] >= result["goal"]
                                                 else ratio) +
                   f" | {hb.dominant(p['epmoe_stage_ms'])} | {100 * p['other_processes_cpu_share']:.0f}% |")
    return "\n".join(out)


def main(argv=None):
    args = parse_args(argv)
    if hc.hb.print_markdown(args, markdown):
        return 0
    coretype = ct.set_environment(args)
    found = hc.distributed_or_skip("hf_ep_bench")
    if found is None:
        return SKIP
    torch, transformers = found
    hc.header(torch, args, coretype, transformers)
    print(f"model: {hc.describe(args)}; transformers: DistributedConfig(tp_size=2, ep_size=2, "
          f"ep_implementation=all_to_all | all_reduce)")
    points = hc.spawn(worker, args, HERE)
    print(f"\ngoal: best transformers EP / epmoe EP >= {GOAL}x at every T")
    for p in points:
        print(f"  {'PASS' if p['speedup'] >= GOAL else 'MISS'} T={p['tokens']:<5} "
              f"{p['speedup']:.2f}x against {p['best']}")
    if args.json:
        ct.write_json(args.json, dict(hc.run_info(torch, args, coretype, transformers, sys),
                                      goal=GOAL, points=points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
