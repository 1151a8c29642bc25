# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""kt-kernel's MoE (PyPI kt-kernel 0.7.2) on one shape: the experts stage per format and T.

Run in kt-kernel's own venv (bench/anchors/install.sh); anchors.py calls it and reads one
JSON line per point from stdout:
  python kt_bench.py --shape H,F,E,k --tokens 1,16,128 --formats bf16,int8,... --reps N
Each call is submit(forward_task) + sync on CPUInfer(threads); a --flush-mb read evicts the
caches before every timed call (as epmoe_bench_quant does); the median of --reps calls after
two warm-up calls. Routing: T tokens to k distinct experts each, uniformly (seeded).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from kt_kernel import kt_kernel_ext as ext

import kt_kernel

# format -> (class name, short description of the kernel it runs)
FLAVOURS = {
    "bf16": ("AMXBF16_MOE", "bf16 weights, bf16 activations"),
    "int8": ("AMXInt8_MOE", "int8 per-channel weights (quantised at load), int8 activations"),
    "int4": ("AMXInt4_MOE", "int4 per-channel weights (quantised at load)"),
    "int4_g32": ("AMXInt4_KGroup_MOE", "RAWINT4: int4 group 32, bf16 scales"),
    "int4_g128": ("AMXInt4_KGroup_MOE", "RAWINT4: int4 group 128, bf16 scales"),
    "fp8": ("AMXFP8_MOE", "FP8 e4m3, 128x128 fp32 scale_inv"),
    "mxfp4": ("AMXFP4_KGroup_MOE", "MXFP4: E2M1 group 32, e8m0 scales as bf16"),
    "q8_0": ("MOE", "llamafile GGUF Q8_0"),
    "q4_0": ("MOE", "llamafile GGUF Q4_0"),
    "q4_k": ("MOE", "llamafile GGUF Q4_K"),
}
GGML = {"q8_0": (8, 32, 34), "q4_0": (2, 32, 18), "q4_k": (12, 256, 144)}  # type, block, bytes


def route(T, E, k, seed):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    return torch.from_numpy(ids.reshape(-1)).contiguous()


class Weights:
    """Per-format packed copies of [E, F, H] gate/up and [E, H, F] down, kept alive."""

    def __init__(self, H, F, E):
        g = torch.Generator().manual_seed(7)
        self.H, self.F, self.E = H, F, E
        self.w = [
            (torch.rand(E, F, H, generator=g) * 2 - 1).div_(H**0.5).to(torch.bfloat16),
            (torch.rand(E, F, H, generator=g) * 2 - 1).div_(H**0.5).to(torch.bfloat16),
            (torch.rand(E, H, F, generator=g) * 2 - 1).div_(F**0.5).to(torch.bfloat16),
        ]
        self.keep = []

    def grouped(self, w, group, fp4):
        """(uint8 [E, N, K/2] two nibbles a byte, low first; bf16 scales [E, N, K/group])."""
        E, N, K = w.shape
        x = w.float().view(E, N, K // group, group)
        amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        if fp4:  # E2M1 codes from their values, scale a power of two (e8m0)
            scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
            grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
            y = (x / scale).clamp(-6, 6)
            code = (y.abs().unsqueeze(-1) - grid).abs().argmin(-1) | ((y < 0).to(torch.int64) << 3)
        else:  # symmetric int4 in [-8, 7] stored offset by 8
            scale = amax / 7.0
            code = (torch.round(x / scale).clamp(-8, 7) + 8).to(torch.int64)
        code = code.view(E, N, K).to(torch.uint8)
        packed = (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous()
        return packed, scale.view(E, N, K // group).to(torch.bfloat16).contiguous()

    def fp8(self, w):
        E, N, K = w.shape
        x = w.float().view(E, N // 128, 128, K // 128, 128)
        scale = x.abs().amax(dim=(2, 4), keepdim=True).clamp_min(1e-12) / 448.0
        q = (x / scale).to(torch.float8_e4m3fn).view(E, N, K).view(torch.uint8).contiguous()
        return q, scale.view(E, N // 128, K // 128).float().contiguous()

    def gguf(self, w, fmt):
        """GGUF blocks [E, N, K/block * bytes]: Q8_0/Q4_0 by the gguf package's quantiser;
        Q4_K as random nibbles under valid fp16 scales (the kernel's speed does not depend on
        the values)."""
        import gguf

        E, N, K = w.shape
        t, blk, nb = GGML[fmt]
        if fmt == "q4_k":
            rng = np.random.default_rng(3)
            raw = rng.integers(0, 256, size=(E * N * (K // blk), nb), dtype=np.uint8)
            raw[:, 0:4] = np.frombuffer(np.array([1e-3, 1e-4], np.float16).tobytes(), np.uint8)
            return torch.from_numpy(raw.reshape(E, N, -1)).contiguous()
        qt = gguf.GGMLQuantizationType.Q8_0 if fmt == "q8_0" else gguf.GGMLQuantizationType.Q4_0
        q = gguf.quants.quantize(w.float().numpy().reshape(E * N, K), qt)
        return torch.from_numpy(q.reshape(E, N, -1)).contiguous()


def build(fmt, w, cpu, k, max_len):
    H, F, E = w.H, w.F, w.E
    cls_name = FLAVOURS[fmt][0]
    mask = torch.zeros(E, dtype=torch.bool)  # no expert on a GPU
    cfg = ext.moe.MOEConfig(E, k, H, F, mask.data_ptr())
    cfg.max_len = max_len
    cfg.pool = cpu.backend_
    keep = [mask]
    if fmt in ("bf16", "int8", "int4"):
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = (t.data_ptr() for t in w.w)
        keep += w.w
    elif fmt in GGML:
        qs = [w.gguf(t, fmt) for t in w.w]
        keep += qs
        cfg.m_block = 32
        cfg.group_min_len = 10
        cfg.group_max_len = max_len
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = (t.data_ptr() for t in qs)
        cfg.gate_type = cfg.up_type = cfg.down_type = GGML[fmt][0]
        cfg.hidden_type = 30  # BF16
    else:
        if fmt == "fp8":
            packed = [w.fp8(t) for t in w.w]
            cfg.quant_config.bits, cfg.quant_config.group_size = 8, 128
        else:
            group = 128 if fmt == "int4_g128" else 32
            packed = [w.grouped(t, group, fmt == "mxfp4") for t in w.w]
            cfg.quant_config.bits, cfg.quant_config.group_size = 4, group
        cfg.quant_config.zero_point = False
        keep += packed
        cfg.gate_projs, cfg.up_projs, cfg.down_projs = (
            [[p[0][e].data_ptr() for e in range(E)]] for p in packed
        )
        cfg.gate_scales, cfg.up_scales, cfg.down_scales = (
            [[p[1][e].data_ptr() for e in range(E)]] for p in packed
        )
    moe = getattr(ext.moe, cls_name)(cfg)
    identity = torch.arange(E, dtype=torch.int64)  # physical to logical expert ids
    cpu.submit(moe.load_weights_task(identity.data_ptr()))
    cpu.sync()
    nbytes = sum(
        x.numel() * x.element_size() for p in keep[1:] for x in (p if isinstance(p, tuple) else (p,))
    )
    if fmt in ("int8", "int4"):  # quantised at load: the weights + one fp32 scale a row
        nbytes = E * (3 * F * H * (8 if fmt == "int8" else 4) // 8 + (2 * F + H) * 4)
    return moe, keep, nbytes / E


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)  # H,F,E,k
    ap.add_argument("--tokens", default="1,16,128")
    ap.add_argument("--formats", default="bf16,int8,int4_g32,fp8,mxfp4,q8_0,q4_0,q4_k")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--flush-mb", type=int, default=512)
    a = ap.parse_args()
    H, F, E, k = (int(v) for v in a.shape.split(","))
    tokens = [int(t) for t in a.tokens.split(",")]
    cpu = ext.CPUInfer(a.threads)
    w = Weights(H, F, E)
    flush = np.ones(a.flush_mb << 18, np.float32)
    max_len = max(256, -(-max(tokens) // 256) * 256)  # a multiple of every class's M step
    for fmt in a.formats.split(","):
        try:
            moe, keep, per_expert = build(fmt, w, cpu, k, max_len)
        except Exception as err:  # an unsupported class: say so and go on
            print(json.dumps({"engine": "kt", "format": fmt, "error": str(err)[:200]}), flush=True)
            continue
        for T in tokens:
            ids = route(T, E, k, 11 + T)
            gates = torch.full((T, k), 1.0 / k, dtype=torch.float32)
            x = (torch.rand(T, H, generator=torch.Generator().manual_seed(9)) * 2 - 1).to(
                torch.bfloat16
            )
            y = torch.empty(T, H, dtype=torch.bfloat16)
            bsz = torch.tensor([T], dtype=torch.int32)
            times = []
            for r in range(a.reps + 2):
                float(flush.sum())
                t0 = time.perf_counter()
                cpu.submit(
                    moe.forward_task(
                        bsz.data_ptr(), k, ids.data_ptr(), gates.data_ptr(), x.data_ptr(),
                        y.data_ptr(), False,
                    )
                )
                cpu.sync()
                if r >= 2:
                    times.append(time.perf_counter() - t0)
            ok = bool(torch.isfinite(y.float()).all())
            active = int(torch.unique(ids).numel())
            print(json.dumps({
                "engine": "kt", "format": fmt, "T": T, "ms": 1e3 * float(np.median(times)),
                "bytes": per_expert * active, "active": active, "finite": ok,
                "path": f"{FLAVOURS[fmt][0]} ({FLAVOURS[fmt][1]}), variant {kt_kernel.__cpu_variant__}",
            }), flush=True)
        del moe, keep


if __name__ == "__main__":
    sys.exit(main())
