#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""A decode loop of a tiny MoE model's MoE layers on gloo processes, plain and with two-batch
overlap (epmoe.torch.MoE's split phase: moe.start(x) / moe.finish(h)).

Each step runs two micro-batches of T tokens per process through L layers; a layer is a
stand-in for attention (a fixed wait: an accelerator's attention kernel leaves the host idle)
then an epmoe MoE layer. Plain: per layer, A's attention and MoE pass, then B's. Overlap: A's
attention, start(A), B's attention while A's dispatch is in flight on the group, start(B),
finish(A), finish(B). Prints per T the step times side by side, tokens/s, and whether the two
schedules' outputs agree (fp32 rounding: each in-flight pass has its own buffers); exit 1 if
not.

    python examples/python/decode_overlap.py [--procs 2] [--tokens 1,4,16,64] [--layers 4]
                                             [--exchange flat|low_latency]

(with build/venv/bin/python and PYTHONPATH=build/default/python, where epmoe is built.)
"""
import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--tokens", default="1,4,16,64", help="tokens per process per micro-batch")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1792)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--attention-ms", type=float, default=1.0, help="the stand-in's wait")
    p.add_argument("--exchange", default="flat", choices=["flat", "low_latency"],
                   help="low_latency: fixed slots, start posts its one round and returns")
    p.add_argument("--timeout", type=float, default=60)
    return p.parse_args()


def run(rank, world, args):
    from epmoe.torch import MoE
    tokens = [int(t) for t in args.tokens.split(",")]
    wait = args.attention_ms * 1e-3
    ok = True
    if rank == 0:
        print(f"decode: {args.layers} layers, {world} gloo processes, H {args.hidden}, "
              f"FFN {args.ffn}, {args.experts} experts, top-{args.top_k}, attention stand-in "
              f"{args.attention_ms} ms, {args.exchange} exchange")
        print(f"{'T':>4} {'plain ms':>9} {'overlap ms':>11} {'ratio':>6} {'plain tok/s':>12} "
              f"{'overlap tok/s':>14} {'agree':>6}")
    for T in tokens:
        # Every process builds the same model, then keeps its experts; max_tokens = T: the
        # low-latency exchange's fixed slots are sized by it (a server sizes it to its batch).
        torch.manual_seed(0)
        layers = [MoE(args.hidden, args.ffn, args.experts, args.top_k, group=dist.group.WORLD,
                      max_tokens=T, exchange=args.exchange).eval() for _ in range(args.layers)]
        torch.manual_seed(100 + rank)
        x0 = [torch.randn(T, args.hidden) for _ in range(2)]
        times, outs = [], []
        for overlap in (False, True):
            total = 0.0
            for step in range(-2, args.steps):  # two warm-up steps
                x = [t.clone() for t in x0]
                dist.barrier()
                t0 = time.perf_counter()
                with torch.no_grad():
                    for moe in layers:
                        if not overlap:
                            for m in range(2):
                                time.sleep(wait)  # attention
                                x[m] = x[m] + moe(x[m])[0]
                        else:
                            time.sleep(wait)
                            a = moe.start(x[0])
                            time.sleep(wait)  # A's dispatch in flight
                            b = moe.start(x[1])
                            x[0] = x[0] + moe.finish(a)
                            x[1] = x[1] + moe.finish(b)
                if step >= 0:
                    total += time.perf_counter() - t0
            times.append(total / args.steps)
            outs.append(x)
        err = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                  for a, b in zip(outs[0], outs[1]) if b.numel())
        agree = all(bool(torch.isfinite(t).all()) for t in outs[1]) and err <= 1e-4
        ok = ok and agree
        if rank == 0:
            n = 2 * T * world
            print(f"{T:>4} {times[0] * 1e3:>9.3f} {times[1] * 1e3:>11.3f} "
                  f"{times[1] / times[0]:>6.3f} {n / times[0]:>12.0f} {n / times[1]:>14.0f} "
                  f"{'yes' if agree else 'NO':>6}", flush=True)
    return ok


def worker(rank, world, path, args, failed):
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        if not run(rank, world, args):
            failed.set()
    finally:
        dist.destroy_process_group()


def main():
    args = parse()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        ok = run(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        sys.exit(0 if ok else 1)
    ctx = mp.get_context("spawn")
    failed = ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.procs, os.path.join(tmp, "rendezvous"), args,
                                         failed), nprocs=args.procs, start_method="spawn")
    sys.exit(1 if failed.is_set() else 0)


if __name__ == "__main__":
    main()
