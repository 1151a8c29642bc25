#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.torch.MoE against transformers 5's own MoE blocks, every experts implementation.

Per point (shape, dtype, mode, T) these sides run the same block, with the same weights, in one
process, interleaved within each repetition (the order reversed every other one):
  hf:grouped_mm, hf:batched_mm, hf:eager   transformers' block (MixtralSparseMoeBlock, or
        DeepseekV2Moe for the DeepSeek-like shape) with config._experts_implementation set to
        each name (transformers/integrations/moe.py: grouped_mm sorts the rows by expert and calls
        torch.nn.functional.grouped_mm; batched_mm gathers one weight matrix per (token, expert)
        and calls bmm; eager loops over the experts hit);
  epmoe  MoE.from_hf(block) (the DeepSeek-like block: the same MoE built here, epmoe.hf does not
        read DeepSeek blocks yet). fp32: eval mode reads packed weights (pack_weights="auto"),
        train mode the parameters; bf16: pack_weights="bf16" (the packed copies rounded to bf16;
        x, y, the sums and the gradients stay fp32; on a CPU with AVX512-BF16 the experts' inputs
        are rounded to bf16 for vdpbf16ps) against the HF block in bf16 (weights and activations).
"forward" times block(x) under torch.inference_mode(); "train" times forward + backward (x and
every parameter's gradient; gradients set to None between steps, untimed). The outputs (and in
train mode dx) of every side are checked against epmoe's before anything is timed. batched_mm
is skipped where its gathered weights would exceed --batched-mm-max-gb.

Fairness (compare_torch.py's helpers): torch.set_num_threads(N) and OPENBLAS_NUM_THREADS=N
(epmoe's sgemm), OMP_WAIT_POLICY=PASSIVE, a 96 MB read evicts the caches before every timed
pass, 4 batches of tokens cycled, medians.

    PYTHONPATH=build/py/python build/venv/bin/python bench/hf_block_bench.py
        [--shapes mixtral,deepseek] [--tokens 1,16,128,1024,4096] [--modes forward,train]
        [--dtypes fp32,bf16] [--impls grouped_mm,batched_mm,eager] [--json out.json] [--smoke]

Goal (PASS/MISS, the exit status does not depend on it): best HF / epmoe >= 1.5x at every point.
Exits 77 (CTest's skip) without torch, transformers or the epmoe package.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_torch as ct  # noqa: E402 - BLAS settings, machine, idle checks, timing helpers

SKIP = 77
GOAL = 1.5
IMPLS = ("grouped_mm", "batched_mm", "eager")
# DeepSeek-like: DeepSeek-V2-Lite's routing (64 experts, top-6 of a softmax, no renormalisation,
# 2 shared experts as one MLP of width 2F), scaled to H = 1024 and F = 512.
SHAPES = {
    "mixtral": dict(family="mixtral", hidden=1024, ffn=3584, experts=8, top_k=2, shared=0),
    "deepseek": dict(family="deepseek_v2", hidden=1024, ffn=512, experts=64, top_k=6, shared=2),
    "tiny-mixtral": dict(family="mixtral", hidden=64, ffn=224, experts=8, top_k=2, shared=0),
    "tiny-deepseek": dict(family="deepseek_v2", hidden=64, ffn=32, experts=16, top_k=6, shared=2),
}
TOLERANCE = {"fp32": 1e-4, "bf16": 4e-2}  # max |a - b| / max |b|


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="mixtral,deepseek", help=", ".join(SHAPES))
    p.add_argument("--tokens", default="1,16,128,1024,4096", help="tokens per pass (T)")
    p.add_argument("--modes", default="forward,train", help="forward, train or both")
    p.add_argument("--dtypes", default="fp32,bf16", help="fp32, bf16 or both")
    p.add_argument("--impls", default=",".join(IMPLS), help="transformers' experts implementations")
    p.add_argument("--batched-mm-max-gb", type=float, default=2.0,
                   help="skip batched_mm where its gathered weights (T*K expert matrices; "
                        "train: and their gradients) exceed this")
    p.add_argument("--fused", action="store_true", help="epmoe with fuse_grad_accumulation=True")
    ct.add_fairness_args(p)
    p.set_defaults(min_reps=3, max_reps=15, min_seconds=1.0, wait_idle=60.0)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, T = 1, 16, 2 repetitions")
    p.add_argument("--markdown", metavar="JSON", help="print the tables of an earlier run's JSON "
                   "(README form) and exit")
    a = p.parse_args(argv)
    if a.smoke:
        if a.shapes == p.get_default("shapes"):
            a.shapes = "tiny-mixtral,tiny-deepseek"
        if a.tokens == p.get_default("tokens"):
            a.tokens = "1,16"
        a.min_reps, a.max_reps, a.min_seconds = 2, 2, 0.0
        a.wait_idle, a.busy_retries = 0.0, 0
    a.shapes = a.shapes.split(",")
    a.modes = a.modes.split(",")
    a.dtypes = a.dtypes.split(",")
    a.impls = a.impls.split(",")
    for what, got, ok in (("--shapes", a.shapes, SHAPES), ("--modes", a.modes, ("forward", "train")),
                          ("--dtypes", a.dtypes, TOLERANCE), ("--impls", a.impls, IMPLS)):
        if not got or set(got) - set(ok):
            p.error(f"{what} {','.join(got)}: each of {', '.join(ok)}")
    try:
        a.tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {a.tokens}: a comma-separated list of integers")
    if not a.tokens or min(a.tokens) < 1:
        p.error("--tokens: each T must be >= 1")
    return a


# --- the blocks -------------------------------------------------------------------------------

def hf_block(torch, spec, seed=1):
    """transformers' block with seeded weights: experts U(-1, 1)/sqrt(fan-in), gate logits of
    std ~2 on compare_torch's tokens (values in [-1, 1], variance ~1/3)."""
    H, F, E, K = spec["hidden"], spec["ffn"], spec["experts"], spec["top_k"]
    if spec["family"] == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E,
                            num_experts_per_tok=K, hidden_act="silu", router_jitter_noise=0.0,
                            experts_implementation="grouped_mm")
        block = MixtralSparseMoeBlock(cfg)
    else:
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
        cfg = DeepseekV2Config(hidden_size=H, moe_intermediate_size=F, n_routed_experts=E,
                               num_experts_per_tok=K, n_shared_experts=spec["shared"],
                               topk_method="greedy", routed_scaling_factor=1.0, hidden_act="silu",
                               experts_implementation="grouped_mm")
        block = DeepseekV2Moe(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0.0, 2.0 / (H / 3) ** 0.5, generator=gen)
            else:
                bound = 1.0 / p.shape[-1] ** 0.5
                p.uniform_(-bound, bound, generator=gen)
    return block.eval()


def epmoe_module(torch, block, spec, max_tokens, pack, fused):
    """The epmoe module computing what the fp32 block computes, with its weights."""
    from epmoe.torch import MoE
    kw = dict(max_tokens=max_tokens, pack_weights=pack, fuse_grad_accumulation=fused)
    if spec["family"] == "mixtral":
        return MoE.from_hf(block, **kw)
    H, F, E, K, N = (spec[k] for k in ("hidden", "ffn", "experts", "top_k", "shared"))
    moe = MoE(H, F, E, K, router="softmax_raw", expert="swiglu", shared_experts=1,
              shared_ffn=N * F, scaling=1.0, **kw)
    sd = {k: v.detach() for k, v in block.state_dict().items()}
    gu = sd["experts.gate_up_proj"]
    moe.load_logical({"gate": sd["gate.weight"], "w1": gu[:, :F], "w3": gu[:, F:],
                      "w2": sd["experts.down_proj"],
                      **{f"shared_{w}": sd[f"shared_experts.{p}.weight"][None]
                         for w, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}})
    return moe


def hf_y(out):
    return out[0] if isinstance(out, tuple) else out


def batched_mm_gb(spec, T, dtype_bytes):
    """The bytes batched_mm gathers: one gate_up and one down matrix per (token, expert)."""
    return T * spec["top_k"] * 3 * spec["hidden"] * spec["ffn"] * dtype_bytes / 1e9


# --- one point --------------------------------------------------------------------------------

class Sides:
    """The timed passes of one (dtype, mode, T): run(side, i) -> (fwd s, bwd s, epmoe stages)."""

    def __init__(self, torch, block, moe, spec, dtype, mode, T, flush, impls):
        self.torch, self.block, self.moe, self.mode, self.flush = torch, block, moe, mode, flush
        self.dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        H, train = spec["hidden"], mode == "train"
        xs = ct.token_batches(torch, T, H, 100)  # multiples of 1/16: exact in bf16
        self.xs = {"hf": [x.to(self.dt).requires_grad_(train) for x in xs],
                   "epmoe": [x.clone().requires_grad_(train) for x in xs]}
        dys = ct.token_batches(torch, T, H, 200)
        self.dys = {"hf": [d.to(self.dt) for d in dys], "epmoe": dys}
        self.sides = [f"hf:{i}" for i in impls] + ["epmoe"]
        block.train(train)
        moe.train(train)

    def run(self, side, i):
        torch, train = self.torch, self.mode == "train"
        hf = side != "epmoe"
        key = "hf" if hf else "epmoe"
        x, dy = self.xs[key][i % 4], self.dys[key][i % 4]
        if hf:
            self.block.experts.config._experts_implementation = side[3:]
            f = lambda: hf_y(self.block(x.view(1, *x.shape)))[0]  # noqa: E731
        else:
            f = lambda: self.moe(x)[0]  # noqa: E731
        model = self.block if hf else self.moe
        if train:
            model.zero_grad(set_to_none=True)
            x.grad = None
        self.flush.sum()
        t0 = time.perf_counter()
        if not train:
            with torch.inference_mode():
                f()
            return time.perf_counter() - t0, 0.0, self._stages(hf)
        y = f()
        t1 = time.perf_counter()
        fwd_stages = self._stages(hf)
        t1b = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1b, fwd_stages, self._stages(hf)

    def _stages(self, hf):
        return None if hf else dict(self.moe.stats()["time"])

    def one(self, i):
        order = self.sides if i % 2 == 0 else self.sides[::-1]
        return {s: self.run(s, max(i, 0)) for s in order}


def check_same(torch, block, moe, spec, dtype, mode, impls):
    """Every side's output (train: and dx) against epmoe's; returns the largest relative
    difference per side; exits when one is past the tolerance."""
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    x = ct.token_batches(torch, 64, spec["hidden"], 7)[0]
    dy = ct.token_batches(torch, 64, spec["hidden"], 8)[0]
    train = mode == "train"
    block.train(train)
    moe.train(train)
    xe = x.clone().requires_grad_(train)
    with torch.inference_mode(not train):
        ref = moe(xe)[0]
        if train:
            ref.backward(dy)
    diffs = {}
    for impl in impls:
        block.experts.config._experts_implementation = impl
        xh = x.to(dt).clone().requires_grad_(train)  # fp32: .to() would alias x
        with torch.inference_mode(not train):
            out = hf_y(block(xh.view(1, *xh.shape)))[0]
            if train:
                out.backward(dy.to(dt))
        pairs = [(out, ref)] + ([(xh.grad, xe.grad)] if train else [])
        d = max(float((a.detach().float() - b.detach()).abs().max() / b.detach().abs().max())
                for a, b in pairs)
        diffs[impl] = d
        if not d <= TOLERANCE[dtype]:
            sys.exit(f"hf_block_bench: {spec['family']} {dtype} {mode}: hf:{impl} and epmoe differ "
                     f"(max relative {d:.2e} > {TOLERANCE[dtype]}): they would not compare the "
                     "same thing")
    block.zero_grad(set_to_none=True)
    moe.zero_grad(set_to_none=True)
    return diffs


def measure(torch, args, block, moe, spec, dtype, mode, T, flush):
    bytes_ = 2 if dtype == "bf16" else 4
    # train: the gathered weights' gradients as many bytes again
    gb = batched_mm_gb(spec, T, bytes_) * (2 if mode == "train" else 1)
    impls = [i for i in args.impls if i != "batched_mm" or gb <= args.batched_mm_max_gb]
    sides = Sides(torch, block, moe, spec, dtype, mode, T, flush, impls)
    reps = ct.repeat(args, sides.one)
    ms = {s: ct.median([r[s][0] + r[s][1] for r in reps]) * 1e3 for s in sides.sides}
    hf = {s[3:]: v for s, v in ms.items() if s != "epmoe"}
    best = min(hf, key=hf.get)
    stage_sets = [("forward", 2)] + ([("backward", 3)] if mode == "train" else [])
    stages = {name: {k: ct.median([r["epmoe"][j][k] for r in reps]) * 1e3
                     for k in reps[0]["epmoe"][j]} for name, j in stage_sets}
    point = {"dtype": dtype, "mode": mode, "tokens": T, "hf_ms": hf,
             "skipped": [i for i in args.impls if i not in impls], "best": best,
             "best_ms": hf[best], "epmoe_ms": ms["epmoe"], "speedup": hf[best] / ms["epmoe"],
             "epmoe_stage_ms": stages, "reps": len(reps)}
    if mode == "train":
        point["fwd_ms"] = {s: ct.median([r[s][0] for r in reps]) * 1e3 for s in sides.sides}
    return point


def dominant(stages):
    """'experts 80% (shared 10%)': the epmoe stages that take most of a pass."""
    t = {k: v for k, v in stages.items() if k != "total"}
    total = stages.get("total") or sum(t.values()) or 1.0
    top = sorted(t, key=t.get, reverse=True)[:2]
    return f"{top[0]} {100 * t[top[0]] / total:.0f}% ({top[1]} {100 * t[top[1]] / total:.0f}%)"


def machine_line(torch, args, coretype):
    flags = ct.cpu_flags()
    have = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (f"machine: {ct.cpu_model()}, {os.cpu_count()} logical CPUs, flags "
            f"{' '.join(have) or 'no avx512'}; {args.threads} threads (torch "
            f"{torch.get_num_threads()}, OPENBLAS_NUM_THREADS {args.threads}); OPENBLAS_CORETYPE="
            f"{coretype or '(unset)'}; OMP_WAIT_POLICY={ct.omp_wait_policy()}")


def kernel_path():
    """epmoe's expert kernel on this CPU (space/host_packed.hpp picks it at run time)."""
    flags = ct.cpu_flags()
    if "avx512f" in flags:
        return "packed AVX-512" + (" (bf16: vdpbf16ps)" if "avx512_bf16" in flags else "")
    return "packed AVX2+FMA" if {"avx2", "fma"} <= flags else "packed portable"


def run_shape(torch, args, name, flush, points):
    spec = SHAPES[name]
    base = hf_block(torch, spec)
    max_t = max(args.tokens + [64])
    for dtype in args.dtypes:
        block = base if dtype == "fp32" else hf_block(torch, spec).to(torch.bfloat16)
        moe = epmoe_module(torch, base, spec, max_t, "bf16" if dtype == "bf16" else "auto",
                           args.fused)
        for mode in args.modes:
            diffs = check_same(torch, block, moe, spec, dtype, mode, args.impls)
            print(f"\n{name} {dtype} {mode}: outputs{' and dx' if mode == 'train' else ''} agree "
                  f"(max relative difference to epmoe: "
                  f"{', '.join(f'{k} {v:.1e}' for k, v in diffs.items())})")
            print(f"{'T':>5} " + " ".join(f"{i + ' ms':>14}" for i in args.impls) +
                  f" {'best HF':>12} {'epmoe ms':>10} {'HF/epmoe':>9}  epmoe stages")
            for T in args.tokens:
                p = None
                for _ in range(1 + args.busy_retries):
                    idle = ct.wait_idle(args.wait_idle)
                    with ct.others_meter() as others:
                        q = measure(torch, args, block, moe, spec, dtype, mode, T, flush)
                    q.update(idle_before=idle, other_processes_cpu_share=others.share,
                             shape=name, outputs_max_rel_diff=diffs)
                    if p is None or others.share < p["other_processes_cpu_share"]:
                        p = q
                    if others.share <= 0.05:
                        break
                cells = " ".join(f"{p['hf_ms'][i]:>14.3f}" if i in p["hf_ms"] else f"{'skipped':>14}"
                                 for i in args.impls)
                where = "; ".join(f"{k}: {dominant(v)}" for k, v in p["epmoe_stage_ms"].items())
                busy = (f"  (busy: others {100 * p['other_processes_cpu_share']:.0f}%)"
                        if p["other_processes_cpu_share"] > 0.05 else "")
                print(f"{T:>5} {cells} {p['best']:>12} {p['epmoe_ms']:>10.3f} "
                      f"{p['speedup']:>8.2f}x  {where}{busy}", flush=True)
                points.append(p)
        del moe
        if block is not base:
            del block


def markdown(result):
    """The README's tables of a run: one per shape and mode, fp32 and bf16 side by side."""
    out = []
    pts = result["points"]
    for shape in dict.fromkeys(p["shape"] for p in pts):
        for mode in dict.fromkeys(p["mode"] for p in pts):
            rows = [p for p in pts if p["shape"] == shape and p["mode"] == mode]
            dts = list(dict.fromkeys(p["dtype"] for p in rows))
            if not rows:
                continue
            out.append(f"\n{shape}, {'forward' if mode == 'forward' else 'forward + backward'}:\n")
            out.append("| T | " + " | ".join(f"{d}: best HF | ms | epmoe ms | HF / epmoe"
                                          for d in dts) + " | others' CPU share |")
            out.append("|---:|" + "---|---:|---:|---:|" * len(dts) + "---:|")
            for T in dict.fromkeys(p["tokens"] for p in rows):
                cells = []
                for d in dts:
                    p = next((q for q in rows if q["tokens"] == T and q["dtype"] == d), None)
                    if p is None:
                        cells.append("| | |")
                        continue
                    ratio = f"{p['speedup']:.2f}x"
                    cells.append(f"{p['best']} | {p['best_ms']:.1f} | {p['epmoe_ms']:.1f} | "
                                 + (f"**{ratio}**" if p["speedup"] >= result["goal"] else ratio))
                busy = [q["other_processes_cpu_share"] for q in rows if q["tokens"] == T]
                out.append(f"| {T} | " + " | ".join(cells) + f" | {100 * max(busy):.0f}% |")
    return "\n".join(out)


def print_markdown(args, markdown) -> bool:
    """--markdown JSON: prints the README table of an earlier run (True: nothing else to do)."""
    if not args.markdown:
        return False
    import json
    with open(args.markdown) as f:
        print(markdown(json.load(f)))
    return True


def main(argv=None):
    args = parse_args(argv)
    if print_markdown(args, markdown):
        return 0
    coretype = ct.set_environment(args)  # before torch (and OpenBLAS) loads
    try:
        import torch
        import transformers
        import epmoe.torch  # noqa: F401
    except ImportError as e:
        print(f"hf_block_bench: SKIP: {e} (needs torch, transformers 5 and the epmoe package: "
              "cmake --build build/py --target _epmoe, PYTHONPATH=build/py/python)")
        return SKIP
    if int(transformers.__version__.split(".")[0]) < 5:
        print(f"hf_block_bench: SKIP: transformers {transformers.__version__} (needs 5's experts "
              "implementations)")
        return SKIP
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    flush = torch.ones(96 << 18)  # a 96 MB read evicts the caches before every timed pass
    print(machine_line(torch, args, coretype))
    blas = sorted({f"{b['core']} ({b['threads']} threads)" for b in ct.openblas_in_process()})
    print(f"torch {torch.__version__} (BLAS: {'MKL' if torch.backends.mkl.is_available() else '?'}, "
          f"oneDNN {torch.backends.mkldnn.is_available()}), transformers {transformers.__version__}; "
          f"epmoe: kernel {kernel_path()}, OpenBLAS {', '.join(blas) or '(not loaded)'}")
    for name in args.shapes:
        s = SHAPES[name]
        print(f"shape {name}: {s['family']} block, H={s['hidden']} F={s['ffn']} E={s['experts']} "
              f"top-{s['top_k']}" + (f", {s['shared']} shared experts (one MLP of width "
                                     f"{s['shared'] * s['ffn']})" if s["shared"] else ""))
    points = []
    for name in args.shapes:
        run_shape(torch, args, name, flush, points)

    print(f"\ngoal: best HF experts implementation / epmoe >= {GOAL}x at every point")
    missed = [p for p in points if p["speedup"] < GOAL]
    for p in points:
        ok = "PASS" if p["speedup"] >= GOAL else "MISS"
        print(f"  {ok} {p['shape']:<14} {p['dtype']} {p['mode']:<7} T={p['tokens']:<5} "
              f"{p['speedup']:.2f}x against {p['best']}")
    print(f"{len(points) - len(missed)} of {len(points)} points met")
    if args.json:
        ct.write_json(args.json, {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": {"cpu_model": ct.cpu_model(), "logical_cpus": os.cpu_count(),
                        "flags": sorted(f for f in ct.cpu_flags()
                                        if f.startswith(("avx512", "amx", "avx2", "fma")))},
            "threads": args.threads, "openblas_coretype": coretype,
            "omp_wait_policy": ct.omp_wait_policy(), "kernel": kernel_path(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "shapes": {n: SHAPES[n] for n in args.shapes}, "goal": GOAL, "points": points})
    return 0


if __name__ == "__main__":
    sys.exit(main())
