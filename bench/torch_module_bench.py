#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.torch.MoE against transformers' MixtralSparseMoeBlock, in one process.

Three sides run the same Mixtral-like block (softmax top-k, SwiGLU experts, the same weights):
  hf     transformers' MixtralSparseMoeBlock (a loop over the experts; autograd backward);
  epmoe  the torch module, epmoe.torch.MoE: y, losses = moe(x), then y.backward(dy);
  raw    the module's C++ layer called directly, without torch's autograd or the module's
         Python: moe._layer.forward(x, y) and moe._layer.backward(dy, dx, grads, 0, 0, 0, False),
         outputs and gradient buffers allocated once.
"forward" times the forward under torch.inference_mode(); "train" times forward + backward
(dx and every weight's gradient; gradients set to None between steps, untimed, so both write
them fresh). HF/epmoe is the speedup, epmoe/raw - 1 the module's overhead (the Python/torch
boundary: autograd, the module's checks, its output and gradient allocations).

Fresh memory costs a page fault per 4 KiB on first touch, and glibc maps every allocation
over 32 MB afresh (unmapping it on free): the module's gradients ([experts, F, H], 117 MB each
at the Mixtral shape) fault every step, HF's per-expert ones (15 MB) mostly come back from the
heap. The JSON has each side's minor faults per pass; --keep-memory runs with glibc keeping
freed memory (as jemalloc, tcmalloc or PyTorch's GPU allocator would), which takes that cost
away from every side.

Fairness follows compare_torch.py (whose helpers this imports): the same threads
(torch.set_num_threads, OPENBLAS_NUM_THREADS) and OpenBLAS kernels (OPENBLAS_CORETYPE:
SkylakeX only where the CPU has AVX-512) for every side, as they share one process and its
BLAS; a 96 MB read evicts the caches before every timed pass; 4 batches of tokens cycled;
the sides alternate within each repetition (their order reversed every other one); medians
of >= --min-reps repetitions and >= --min-seconds. The outputs of hf and epmoe are checked to
agree before anything is timed.

    PYTHONPATH=build/py/python build/venv/bin/python bench/torch_module_bench.py
        [--shape mixtral|tiny] [--tokens 1,16,128,1024,4096] [--modes forward,train]
        [--threads N] [--coretype auto] [--keep-memory] [--json out.json] [--smoke]

Goals (printed PASS/MISS; the exit status does not depend on them): HF/epmoe >= 1.5x at every
T, overhead < 5% at T >= 128. Exits 77 (CTest's skip code) without torch, transformers or the
epmoe package.
"""
import argparse
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_torch as ct  # noqa: E402 - the shapes, BLAS settings, machine and timing helpers

SKIP = 77
SHAPES = {"mixtral": ct.SHAPES["mixtral"], "tiny": ct.SHAPES["tiny-mixtral"]}
GOALS = {"speedup_min": 1.5, "overhead_max_at_T_ge_128": 0.05}
SIDES = ("hf", "epmoe", "raw")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="1,16,128,1024,4096", help="tokens per pass (T)")
    p.add_argument("--modes", default="forward,train", help="forward, train or both")
    ct.add_fairness_args(p)
    p.add_argument("--fused", action="store_true",
                   help="the module with fuse_grad_accumulation=True: gradients written into "
                        "p.grad, buffers the module keeps when p.grad is None (no fresh pages "
                        "per step)")
    p.add_argument("--keep-memory", action="store_true",
                   help="run with glibc keeping freed memory for reuse (MALLOC_MMAP_MAX_=0, "
                        "MALLOC_TRIM_THRESHOLD_): fresh gradient and output tensors then cost "
                        "no page faults, as under a caching allocator")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shape, T = 1, 16, two repetitions: checks that it runs")
    a = p.parse_args()
    if a.smoke:
        a.shape = "tiny"
        if a.tokens == p.get_default("tokens"):
            a.tokens = "1,16"
        a.min_reps, a.max_reps, a.min_seconds = 2, 2, 0.0
        a.wait_idle, a.busy_retries = 0.0, 0
    a.modes = [m for m in a.modes.split(",") if m]
    if not a.modes or set(a.modes) - {"forward", "train"}:
        p.error(f"--modes {','.join(a.modes)}: forward, train or both")
    try:
        a.tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {a.tokens}: a comma-separated list of integers")
    if not a.tokens or min(a.tokens) < 1:
        p.error("--tokens: each T must be >= 1")
    return a


def build(torch, spec, max_tokens, fused=False):
    """The HF block and the epmoe module with the same weights: compare_torch's (the C++
    benchmark's scales: experts U(-1,1)/sqrt(fan-in), gate logits of std ~2)."""
    from epmoe import hf as epmoe_hf
    from epmoe.torch import MoE
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    H, Fw, E, K = spec["hidden"], spec["ffn"], spec["experts"], spec["top_k"]
    ref = ct.build_torch_layer(torch, spec)  # per-expert Linears (w1, w3, w2) and a gate
    logical = {"gate": ref.gate.weight.detach(),
               **{w: torch.stack([getattr(e, w).weight.detach() for e in ref.experts])
                  for w in ("w1", "w3", "w2")}}
    # transformers 5's block with its reference loop over the experts ("eager"; its other
    # experts implementations are issue 35's benchmark).
    cfg = MixtralConfig(hidden_size=H, intermediate_size=Fw, num_local_experts=E,
                        num_experts_per_tok=K, hidden_act="silu", router_jitter_noise=0.0,
                        experts_implementation="eager")
    hf = MixtralSparseMoeBlock(cfg)
    hf.load_state_dict(epmoe_hf.hf_state_dict("mixtral", logical, cfg))
    del ref
    moe = MoE(H, Fw, E, K, router="softmax", expert="swiglu", max_tokens=max_tokens,
              fuse_grad_accumulation=fused)
    moe.load_logical(logical)
    return hf, moe


def hf_y(out):
    """The block's output [1, T, H] (transformers 4 returned (y, router logits))."""
    return out[0] if isinstance(out, tuple) else out


def check_same(torch, hf, moe, spec):
    """hf and epmoe give the same output (fp32 reductions in other orders: ~1e-6)."""
    x = ct.token_batches(torch, 64, spec["hidden"], 7)[0]
    with torch.inference_mode():
        a = hf_y(hf(x.view(1, *x.shape)))[0]
        b = moe(x)[0]
    diff = float((a - b).abs().max() / a.abs().max())
    if not diff <= 1e-4:
        sys.exit(f"torch_module_bench: epmoe and HF outputs differ (max relative {diff:.2e}): "
                 "they would not compare the same thing")
    return diff


class Sides:
    """The timed passes of one point: each side's one(i) returns seconds of pass i."""

    def __init__(self, torch, hf, moe, spec, T, mode, flush):
        H = spec["hidden"]
        self.torch, self.hf, self.moe, self.mode, self.flush = torch, hf, moe, mode, flush
        train = mode == "train"
        self.xs = [x.requires_grad_(train) for x in ct.token_batches(torch, T, H, 100)]
        self.dys = ct.token_batches(torch, T, H, 200)
        # raw: the layer's own buffers, allocated once (as the C++ benchmark does)
        self.y = torch.empty(T, H)
        self.dx = torch.empty(T, H)
        grads = {n: torch.empty_like(getattr(moe, n)) for n in moe._param_names}
        self.per_rank = moe._rank_grads(grads, False) if train else None
        hf.train(train)
        moe.train(train)

    def _timed(self, f):
        """(seconds, minor page faults) of f(), after a cache eviction."""
        self.flush.sum()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        f()
        t = time.perf_counter() - t0
        return t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    def hf_pass(self, i):
        x, dy = self.xs[i % 4], self.dys[i % 4]
        xv = x.view(1, *x.shape)
        if self.mode == "forward":
            with self.torch.inference_mode():
                return self._timed(lambda: self.hf(xv))
        self.hf.zero_grad(set_to_none=True)
        x.grad = None
        return self._timed(lambda: hf_y(self.hf(xv)).backward(dy.view(1, *dy.shape)))

    def epmoe_pass(self, i):
        x, dy = self.xs[i % 4], self.dys[i % 4]
        if self.mode == "forward":
            with self.torch.inference_mode():
                return self._timed(lambda: self.moe(x))
        self.moe.zero_grad(set_to_none=True)
        x.grad = None
        return self._timed(lambda: self.moe(x)[0].backward(dy))

    def raw_pass(self, i):
        x, dy, layer = self.xs[i % 4].detach(), self.dys[i % 4], self.moe._layer
        if self.mode == "forward":
            return self._timed(lambda: layer.forward(x, self.y))

        def step():
            layer.forward(x, self.y)
            layer.backward(dy, self.dx, self.per_rank, 0.0, 0.0, 0.0, False)
        return self._timed(step)

    def one(self, i):
        """Every side once, in an order that flips each repetition (i < 0: warm-up)."""
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        return {s: getattr(self, s + "_pass")(max(i, 0)) for s in order}


def measure(torch, args, hf, moe, spec, T, mode, flush):
    sides = Sides(torch, hf, moe, spec, T, mode, flush)
    reps = ct.repeat(args, sides.one)
    ms = {s: ct.median([r[s][0] for r in reps]) * 1e3 for s in SIDES}
    # Fresh memory (gradients, outputs) costs a page fault per 4 KiB on first touch.
    faults = {s: ct.median([r[s][1] for r in reps]) for s in SIDES}
    return {"mode": mode, "tokens": T, "hf_ms": ms["hf"], "epmoe_ms": ms["epmoe"],
            "raw_ms": ms["raw"], "speedup": ms["hf"] / ms["epmoe"],
            "overhead": ms["epmoe"] / ms["raw"] - 1, "reps": len(reps),
            "minor_page_faults": faults}


def goals(points):
    """(mode, T, what, value, want, met) for each goal that applies."""
    out = []
    for p in points:
        want = GOALS["speedup_min"]
        out.append((p["mode"], p["tokens"], "HF / epmoe", p["speedup"], f">= {want}x",
                    p["speedup"] >= want))
        if p["tokens"] >= 128:
            most = GOALS["overhead_max_at_T_ge_128"]
            out.append((p["mode"], p["tokens"], "module overhead (epmoe / raw - 1)",
                        p["overhead"], f"< {100 * most:.0f}%", p["overhead"] < most))
    return out


def main():
    args = parse_args()
    if args.keep_memory and os.environ.get("MALLOC_MMAP_MAX_") != "0":
        # glibc reads these at start: run again with them. Above 32 MB it otherwise maps each
        # allocation afresh and unmaps it on free, so every step's new tensors fault again.
        os.environ.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
        os.execv(sys.executable, [sys.executable] + sys.argv)
    coretype = ct.set_environment(args)  # before torch (and its OpenBLAS) loads
    try:
        import torch
        import transformers  # noqa: F401
        import epmoe.torch  # noqa: F401
    except ImportError as e:
        print(f"torch_module_bench: SKIP: {e} (needs torch, transformers and the epmoe package: "
              "cmake --build build/py, PYTHONPATH=build/py/python)")
        return SKIP
    torch.set_num_threads(args.threads)
    spec = SHAPES[args.shape]
    hf, moe = build(torch, spec, max(args.tokens + [64]), args.fused)  # 64: check_same's batch
    diff = check_same(torch, hf, moe, spec)
    flush = torch.ones(96 << 18)  # compare_torch's cache eviction: a 96 MB read
    blas = ct.openblas_in_process()
    cpu = ct.cpu_model()
    avx512 = "avx512f" in ct.cpu_flags()
    print(f"machine: {cpu}, {os.cpu_count()} logical CPUs, AVX-512 {'yes' if avx512 else 'no'}; "
          f"{args.threads} threads (torch {torch.get_num_threads()}); "
          f"OPENBLAS_CORETYPE={coretype or '(unset: OpenBLAS picks)'}; "
          f"OMP_WAIT_POLICY={ct.omp_wait_policy()}")
    cores = sorted({f"{b['core']} ({b['threads']} threads)" for b in blas})  # one per library
    print(f"torch {torch.__version__}, transformers {transformers_version()}; BLAS "
          f"{', '.join(cores) or 'unknown'}")
    allocator = ("glibc keeping freed memory (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_)"
                 if os.environ.get("MALLOC_MMAP_MAX_") == "0" else "glibc defaults")
    print(f"allocator: {allocator}; module gradients: "
          f"{'fused into p.grad (kept buffers)' if args.fused else 'new tensors per step (autograd)'}")
    print(f"shape {args.shape}: hidden {spec['hidden']}, ffn {spec['ffn']}, {spec['experts']} "
          f"experts, top-{spec['top_k']}, fp32, one process; outputs agree (max relative "
          f"difference {diff:.1e})\n")
    print(f"{'mode':<8} {'T':>5} {'HF ms':>10} {'epmoe ms':>10} {'raw ms':>10} {'HF/epmoe':>9} "
          f"{'overhead':>9} {'reps':>5}")

    points = []
    for mode in args.modes:
        for T in args.tokens:
            p = None
            for _ in range(1 + args.busy_retries):
                idle = ct.wait_idle(args.wait_idle)
                with ct.others_meter() as others:
                    q = measure(torch, args, hf, moe, spec, T, mode, flush)
                q.update(idle_before=idle, other_processes_cpu_share=others.share)
                if p is None or others.share < p["other_processes_cpu_share"]:
                    p = q
                if others.share <= 0.05:
                    break
            busy = (f"  (machine busy: others used {100 * p['other_processes_cpu_share']:.0f}% "
                    "of the CPUs)") if p["other_processes_cpu_share"] > 0.05 else ""
            print(f"{mode:<8} {T:>5} {p['hf_ms']:>10.3f} {p['epmoe_ms']:>10.3f} "
                  f"{p['raw_ms']:>10.3f} {p['speedup']:>8.2f}x {100 * p['overhead']:>8.1f}% "
                  f"{p['reps']:>5}{busy}", flush=True)
            points.append(p)

    checks = goals(points)
    print("\ngoals:")
    for mode, T, what, value, want, ok in checks:
        shown = f"{100 * value:.1f}%" if "overhead" in what else f"{value:.2f}x"
        print(f"  {'PASS' if ok else 'MISS'} {mode:<7} T={T:<5} {what}: {shown} ({want})")

    if args.json:
        result = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": {"cpu_model": cpu, "logical_cpus": os.cpu_count(), "avx512": avx512},
            "threads": args.threads, "openblas_coretype": coretype, "allocator": allocator,
            "omp_wait_policy": ct.omp_wait_policy(),
            "fuse_grad_accumulation": args.fused,
            "torch": {"version": torch.__version__, "threads": torch.get_num_threads(),
                      "blas": blas},
            "transformers": transformers_version(),
            "shape": dict(spec, name=args.shape), "outputs_max_rel_diff": diff,
            "points": points,
            "goals": [{"mode": m, "tokens": t, "what": w, "value": v, "want": want, "met": ok}
                      for m, t, w, v, want, ok in checks],
        }
        ct.write_json(args.json, result)
    return 0


def transformers_version():
    import transformers
    return transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
