#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""PyTorch eager Mixtral-style sparse MoE block on the GPU, at epmoe_cuda_bench's shapes.

The block is written the way Hugging Face's MixtralSparseMoeBlock is: router softmax in fp32,
top-2, renormalised; a loop over the experts with index_select / index_add_; SwiGLU experts;
bf16 weights and activations. Each T is timed with CUDA events (median of --reps after
warm-up). With --epmoe FILE (epmoe_cuda_bench --json), prints torch_ms / epmoe_ms per T.

    python3 bench/cuda/torch_mixtral.py [--smoke] [--reps N] [--tokens 16,512,8192]
                                        [--epmoe bench.json] [--json out.json]

Exits 77 when PyTorch or a CUDA device is missing.
"""
import argparse
import json
import statistics
import sys

TARGET_T, TARGET_RATIO = 8192, 2.0  # issue 8: >= 2x faster than this block at T = 8192


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 3 passes")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", default="16,512,8192")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--epmoe", help="epmoe_cuda_bench --json output: print the ratios")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    if a.smoke:
        a.reps, a.warmup, a.tokens, a.hidden, a.ffn = 3, 1, "16,64", 256, 512
    a.tokens = [int(t) for t in a.tokens.split(",")]
    return a


def main():
    a = parse()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"torch_mixtral: no PyTorch ({e}): skipped")
        return 77
    if not torch.cuda.is_available():
        print("torch_mixtral: PyTorch sees no CUDA device: skipped")
        return 77

    dev, dt = torch.device("cuda"), torch.bfloat16
    H, Fw, E, K = a.hidden, a.ffn, a.experts, 2
    g = torch.Generator(device=dev).manual_seed(0)

    def uniform(*shape, scale):  # the epmoe bench's scales: random, never zeros
        return ((torch.rand(*shape, generator=g, device=dev) * 2 - 1) * scale).to(dt)

    gate = uniform(E, H, scale=4 / H**0.5)
    w1 = uniform(E, Fw, H, scale=1 / H**0.5)
    w3 = uniform(E, Fw, H, scale=1 / H**0.5)
    w2 = uniform(E, H, Fw, scale=1 / Fw**0.5)

    def block(x):
        logits = F.linear(x, gate)
        p = torch.softmax(logits, dim=1, dtype=torch.float)
        weight, chosen = torch.topk(p, K, dim=-1)
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, num_classes=E).permute(2, 1, 0)  # [E, K, T]
        for e in range(E):
            k, tok = torch.where(mask[e])
            xe = x.index_select(0, tok)
            h = F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e])
            ye = F.linear(h, w2[e]) * weight[tok, k, None]
            out.index_add_(0, tok, ye.to(x.dtype))
        return out

    points = []
    with torch.inference_mode():
        for T in a.tokens:
            x = uniform(T, H, scale=1.0)
            for _ in range(a.warmup):
                y = block(x)
            torch.cuda.synchronize()
            ms = []
            for _ in range(a.reps):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                y = block(x)
                stop.record()
                stop.synchronize()
                ms.append(start.elapsed_time(stop))
            if not torch.isfinite(y).all():
                print(f"torch_mixtral: output not finite at T={T}", file=sys.stderr)
                return 1
            points.append({"tokens": T, "torch_ms": statistics.median(ms)})
            print(f"torch eager Mixtral block  T={T:6d}  {points[-1]['torch_ms']:9.3f} ms "
                  f"(median of {a.reps})")

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"hidden": H, "ffn": Fw, "experts": E, "top_k": K, "dtype": "bf16"},
              "smoke": a.smoke, "reps": a.reps, "points": points}

    if a.epmoe:
        with open(a.epmoe) as f:
            ep = json.load(f)
        modes = {(r["tokens"], r["mode"]): r["total_ms"] for r in ep.get("layer", [])}
        print(f"\n{'T':>6} {'torch ms':>10} {'epmoe dyn':>10} {'ratio':>7} {'static graph':>13}"
              f" {'ratio':>7}")
        for pt in points:
            T = pt["tokens"]
            dyn, graph = modes.get((T, "dynamic")), modes.get((T, "static_graph"))
            pt["epmoe_dynamic_ms"], pt["epmoe_static_graph_ms"] = dyn, graph
            pt["ratio_dynamic"] = pt["torch_ms"] / dyn if dyn else None
            pt["ratio_static_graph"] = pt["torch_ms"] / graph if graph else None
            line = f"{T:6d} {pt['torch_ms']:10.3f}"
            line += f" {dyn:10.3f} {pt['ratio_dynamic']:6.2f}x" if dyn else f" {'-':>10} {'-':>7}"
            line += (f" {graph:13.3f} {pt['ratio_static_graph']:6.2f}x" if graph
                     else f" {'-':>13} {'-':>7}")
            if T == TARGET_T and dyn:
                line += "  target >= 2x (dropless): " + (
                    "met" if pt["ratio_dynamic"] >= TARGET_RATIO else "MISSED")
            print(line)
        result["target"] = {"tokens": TARGET_T, "ratio": TARGET_RATIO}

    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
