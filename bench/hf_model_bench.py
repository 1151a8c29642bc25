#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Whole transformers 5 model on 2 processes: epmoe.hf.expert_parallel against transformers'
own expert parallelism, per forward pass and in greedy generate (tokens/s, 1 and 2 processes).

Two gloo processes (torch.multiprocessing), the same seeded MixtralForCausalLM on each
(hf_common.seeded_model: no download, eos_token_id=None). The models:
  hf:all_to_all, hf:all_reduce   the model distributed by transformers
        (DistributedConfig(tp_size=2, ep_size=2, ep_implementation=...)): attention split by
        heads over the 2 processes (transformers' default tp_plan; tp_plan={} is refused), each
        process 4 of the 8 experts, run with --experts-impl (grouped_mm);
  epmoe  a copy of the model with epmoe.hf.expert_parallel(model, WORLD): attention, router,
        norms replicated (every process runs the whole batch), each experts call split in
        halves, epmoe's exchange on each half, the outputs all-gathered;
  1 process (generate only, process 0 alone while process 1 waits in a gloo barrier, which
        does not spin): the unmodified model with --experts-impl and with eager, and
        epmoe.hf.use_epmoe(copy) (every expert in one process), with --single-threads threads.
Part "steps": model(input_ids, use_cache=False).logits on a [T, 1] batch (decode: T sequences of
one token; each experts call sees T rows, as in a decode step of T sequences, without the
cache's attention, which is transformers' own on every side) and on [1, T] (prefill). Part
"generate": model.generate(prompt [B, P], max_new_tokens=N, greedy); tokens/s = B*N / time.
Before timing, every side's logits (steps) or tokens (generate) are checked against the
unmodified model in one process (logits within 1e-4 of max |logit|; tokens equal). The sides
run in turn within each repetition (order reversed every other one), each after a 96 MB read
and a barrier; a pass's time is the slower process's; medians.

    PYTHONPATH=build/py/python build/venv/bin/python bench/hf_model_bench.py
        [--parts steps,generate] [--decode 1,4,16,64] [--prefill 1024] [--layers 1]
        [--new-tokens 32 --prompt 8 --batch 1] [--json out.json] [--smoke]

Goal (steps, PASS/MISS): best HF / epmoe >= 1.5x at every T. Exits 77 without torch,
transformers 5, gloo or the epmoe package.
"""
import argparse
import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_torch as ct  # noqa: E402
import hf_common as hc  # noqa: E402

SKIP = 77
GOAL = 1.5
TOLERANCE = 1e-4  # max |logits - reference| / max |reference|


def ints(p, what, s):
    try:
        v = [int(t) for t in s.split(",") if t]
    except ValueError:
        p.error(f"{what} {s}: a comma-separated list of integers")
    if v and min(v) < 1:
        p.error(f"{what}: each must be >= 1")
    return v


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="steps,generate", help="steps, generate or both")
    p.add_argument("--decode", default="1,4,16,64", help="T of the [T, 1] passes")
    p.add_argument("--prefill", default="1024", help="T of the [1, T] passes ('' for none)")
    p.add_argument("--new-tokens", type=int, default=32, help="generate: new tokens")
    p.add_argument("--prompt", type=int, default=8, help="generate: prompt length")
    p.add_argument("--batch", type=int, default=1, help="generate: sequences")
    p.add_argument("--single-threads", type=int, default=os.cpu_count() or 1,
                   help="generate: threads of the 1-process sides (default: all CPUs)")
    hc.add_model_args(p)
    ct.add_fairness_args(p)
    p.set_defaults(threads=1, min_reps=5, max_reps=30, min_seconds=1.0, wait_idle=30.0)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model: decode T=1, prefill T=16, 4 new tokens, 2 repetitions")
    p.add_argument("--markdown", metavar="JSON", help="print the README tables of an earlier "
                   "run's JSON and exit")
    a = p.parse_args(argv)
    if a.smoke:
        hc.smoke_shape(a)
        for k, v in (("decode", "1"), ("prefill", "16"), ("new_tokens", 4)):
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
        a.min_reps, a.max_reps, a.min_seconds, a.wait_idle = 2, 2, 0.0, 0.0
    a.parts = a.parts.split(",")
    if not a.parts or set(a.parts) - {"steps", "generate"}:
        p.error(f"--parts {','.join(a.parts)}: steps, generate or both")
    a.points = ([("decode", T) for T in ints(p, "--decode", a.decode)] +
                [("prefill", T) for T in ints(p, "--prefill", a.prefill)])
    if a.experts % 2:
        p.error(f"--experts {a.experts}: must split over 2 processes")
    return a


# --- the models -------------------------------------------------------------------------------

def epmoe_stages(model):
    """Stage times (ms) of epmoe's last experts calls, summed over the layers."""
    from epmoe import hf_models
    out = {}
    for _, m in hf_models.experts_modules(model):
        for k, v in m.__dict__["_epmoe"]["experts"].stats()["time"].items():
            out[k] = out.get(k, 0.0) + v * 1e3
    return out


def ids_for(torch, kind, T, seed, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (T, 1) if kind == "decode" else (1, T), generator=g)


def logits_of(torch, model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# --- part 1: forward passes ---------------------------------------------------------------------

def steps(torch, dist, args, ref, models, flush, rank):
    sides = [f"hf:{i}" for i in hc.EP_IMPLS] + ["epmoe"]
    points = []
    if rank == 0:
        print(f"\n{'pass':>14} {'all_to_all ms':>14} {'all_reduce ms':>14} {'epmoe ms':>10} "
              f"{'HF/epmoe':>9}  epmoe experts stages (process 0)")
    for kind, T in args.points:
        xs = [ids_for(torch, kind, T, 100 + j) for j in range(4)]  # the same on both processes
        want = logits_of(torch, ref, xs[0])
        diffs = {s: rel(logits_of(torch, models[s], xs[0]), want) for s in sides}
        bad = {s: d for s, d in diffs.items() if not d <= TOLERANCE}
        if bad:
            raise SystemExit(f"hf_model_bench: {kind} T={T}: {bad}: logits differ from the "
                             f"unmodified model's (> {TOLERANCE} of max |logit|)")
        if rank == 0 and args.wait_idle > 0:
            ct.wait_idle(args.wait_idle)
        dist.barrier()
        stages = []

        def one(i):
            order = sides if i % 2 == 0 else sides[::-1]
            x = xs[max(i, 0) % 4]
            r = {s: hc.timed(torch, dist, flush,
                             lambda: models[s](input_ids=x, use_cache=False)) for s in order}
            stages.append(epmoe_stages(models["epmoe"]))
            return r
        with hc.pair_meter(torch, dist) as others:
            reps = ct.repeat(args, one)
        ms = {s: ct.median([r[s] for r in reps]) * 1e3 for s in sides}
        hf = {s[3:]: ms[s] for s in sides if s != "epmoe"}
        best = min(hf, key=hf.get)
        st = {k: ct.median([s[k] for s in stages[1:]]) for k in stages[0]}
        p = {"kind": kind, "tokens": T, "hf_ms": hf, "best": best, "best_ms": hf[best],
             "epmoe_ms": ms["epmoe"], "speedup": hf[best] / ms["epmoe"], "epmoe_stage_ms": st,
             "reps": len(reps), "logits_max_rel_diff": diffs,
             "other_processes_cpu_share": others.share}
        points.append(p)
        if rank == 0:
            busy = f"  (busy: others {100 * others.share:.0f}%)" if others.share > 0.05 else ""
            print(f"{kind + ' T=' + str(T):>14} {hf['all_to_all']:>14.2f} "
                  f"{hf['all_reduce']:>14.2f} "
                  f"{ms['epmoe']:>10.2f} {p['speedup']:>8.2f}x  {stage_line(st)}{busy}", flush=True)
    return points


def stage_line(st):
    """'total 9.1: experts 4.0, dispatch 3.2, combine 1.1 ms': the largest stages."""
    t = {k: v for k, v in st.items() if k != "total"}
    top = sorted(t, key=t.get, reverse=True)[:3]
    return (f"total {st.get('total', sum(t.values())):.1f}: " +
            ", ".join(f"{k} {t[k]:.1f}" for k in top) + " ms")


# --- part 2: generate ---------------------------------------------------------------------------

def generate(torch, dist, args, ref, models, flush, rank):
    from epmoe import hf
    single = hf.use_epmoe(copy.deepcopy(ref), max_tokens=args.batch * args.prompt + 1)
    impl = args.experts_impl
    gen_sides = {f"1p:{impl}": (1, ref, impl), "1p:eager": (1, ref, "eager"),
                 "1p:epmoe": (1, single, None), "2p:epmoe": (2, models["epmoe"], None),
                 **{f"2p:hf:{i}": (2, models[f"hf:{i}"], None) for i in hc.EP_IMPLS}}
    names = list(gen_sides)
    prompt = torch.randint(3, 512, (args.batch, args.prompt),
                           generator=torch.Generator().manual_seed(7))

    def run(name):
        ranks, model, set_impl = gen_sides[name]
        if set_impl:
            model.set_experts_implementation(set_impl)
        return model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)

    def one_side(name):
        ranks = gen_sides[name][0]
        if ranks == 1:
            hc.set_threads(torch, args.single_threads)
        try:
            return hc.timed(torch, dist, flush, lambda: run(name), ranks)
        finally:
            hc.set_threads(torch, args.threads)

    with torch.inference_mode():
        ref.set_experts_implementation(impl)
        want = ref.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        same = {}
        for n in names:
            if gen_sides[n][0] == 2 or rank == 0:
                same[n] = bool(torch.equal(run(n), want))
    bad = [n for n, ok in same.items() if not ok]
    if bad:
        raise SystemExit(f"hf_model_bench: generate: {bad} give other tokens than the unmodified "
                         "model")
    if rank == 0 and args.wait_idle > 0:
        ct.wait_idle(args.wait_idle)
    dist.barrier()

    def one(i):
        order = names if i % 2 == 0 else names[::-1]
        return {n: one_side(n) for n in order}
    with hc.pair_meter(torch, dist) as others:
        reps = ct.repeat(args, one)
    new = args.batch * args.new_tokens
    res = {n: {"processes": gen_sides[n][0], "ms": ct.median([r[n] for r in reps]) * 1e3}
           for n in names}
    for n in names:
        res[n]["tokens_per_s"] = new / res[n]["ms"] * 1e3
    if rank == 0:
        print(f"\ngenerate: prompt [{args.batch}, {args.prompt}], {args.new_tokens} new tokens, "
              f"greedy; tokens equal to the unmodified model's on every side; 1-process sides: "
              f"{args.single_threads} threads")
        print(f"{'side':>16} {'processes':>9} {'ms':>10} {'tokens/s':>9}")
        for n in names:
            print(f"{n:>16} {res[n]['processes']:>9} {res[n]['ms']:>10.1f} "
                  f"{res[n]['tokens_per_s']:>9.1f}")
        print(f"  (others' CPU share {100 * others.share:.0f}%, {len(reps)} repetitions)")
    return {"sides": res, "prompt": [args.batch, args.prompt], "new_tokens": args.new_tokens,
            "single_threads": args.single_threads, "reps": len(reps),
            "other_processes_cpu_share": others.share}


# --- the processes ------------------------------------------------------------------------------

def worker(rank, args, port):
    dist = hc.init_worker(rank, port)
    import torch
    from epmoe import hf
    torch.set_num_threads(args.threads)
    ref = hc.seeded_model(torch, args)
    models = {f"hf:{i}": hc.hf_distributed(torch, args, ref, i) for i in hc.EP_IMPLS}
    rows = max([T for _, T in args.points] + [args.batch * args.prompt]) + 1
    models["epmoe"] = hf.expert_parallel(copy.deepcopy(ref), dist.group.WORLD, max_tokens=rows)
    if rank == 0:
        local = models["hf:all_to_all"].model.layers[0].mlp.experts
        print(f"each process: {local.num_experts} of {args.experts} experts per layer "
              f"(transformers: experts {args.experts_impl}; epmoe: "
              f"{hf.local_experts(models['epmoe'])}"
              f", {hf.expert_bytes(models['epmoe']) >> 20} MiB)", flush=True)
    flush = torch.ones(96 << 18)
    out = {}
    if "steps" in args.parts:
        out["points"] = steps(torch, dist, args, ref, models, flush, rank)
    if "generate" in args.parts:
        out["generate"] = generate(torch, dist, args, ref, models, flush, rank)
    if rank == 0:
        hc.write_out(args, out)
    dist.barrier()
    dist.destroy_process_group()


def markdown(result):
    out = []
    if result.get("points"):
        out += ["| pass | all_to_all ms | all_reduce ms | epmoe ms | best HF / epmoe | epmoe's "
                "experts stages (ms) | others' CPU share |", "|---|---:|---:|---:|---:|---|---:|"]
        for p in result["points"]:
            ratio = f"{p['speedup']:.2f}x"
            out.append(f"| {p['kind']} T={p['tokens']} | {p['hf_ms']['all_to_all']:.2f} | "
                       f"{p['hf_ms']['all_reduce']:.2f} | {p['epmoe_ms']:.2f} | " +
                       (f"**{ratio}**" if p["speedup"] >= result["goal"] else ratio) +
                       f" | {stage_line(p['epmoe_stage_ms'])[:-3]} | "
                       f"{100 * p['other_processes_cpu_share']:.0f}% |")
    g = result.get("generate")
    if g:
        out += ["", f"generate, prompt {g['prompt'][0]} x {g['prompt'][1]}, {g['new_tokens']} "
                f"new tokens (others' CPU share {100 * g['other_processes_cpu_share']:.0f}%):", "",
                "| side | processes | ms | tokens/s |", "|---|---:|---:|---:|"]
        for n, s in g["sides"].items():
            out.append(f"| {n} | {s['processes']} | {s['ms']:.1f} | {s['tokens_per_s']:.1f} |")
    return "\n".join(out)


def main(argv=None):
    args = parse_args(argv)
    if hc.hb.print_markdown(args, markdown):
        return 0
    coretype = ct.set_environment(args)
    found = hc.distributed_or_skip("hf_model_bench")
    if found is None:
        return SKIP
    torch, transformers = found
    hc.header(torch, args, coretype, transformers)
    print(f"model: {hc.describe(args)}; transformers: DistributedConfig(tp_size=2, ep_size=2, "
          f"ep_implementation=all_to_all | all_reduce); epmoe: hf.expert_parallel(model, WORLD)")
    out = hc.spawn(worker, args, HERE)
    points = out.get("points", [])
    if points:
        print(f"\ngoal: best transformers EP / epmoe.hf.expert_parallel >= {GOAL}x at every pass")
        for p in points:
            print(f"  {'PASS' if p['speedup'] >= GOAL else 'MISS'} {p['kind']:<7} "
                  f"T={p['tokens']:<5} {p['speedup']:.2f}x against {p['best']}")
    if args.json:
        ct.write_json(args.json, dict(hc.run_info(torch, args, coretype, transformers, sys),
                                      goal=GOAL, tolerance=TOLERANCE, **out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
