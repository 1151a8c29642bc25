# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Resident memory of an epmoe.torch.MoE serving a quantised checkpoint, with its values
(MoE.load_quantised(tensors): float32 parameters beside the packed codes) and codes only
(values=False), each in a fresh process: the checkpoint loaded, its tensors freed, one forward.

    build/venv/bin/python bench/codes_only_memory.py [--hidden 2048 --ffn 5632 --experts 8]

Needs the epmoe package on PYTHONPATH (build/default/python). Prints MiB resident after the
forward (after malloc_trim: live memory, not what the heap keeps of freed temporaries), less
the process's resident memory before the module was built (torch's own, and what a first
module imports)."""
import argparse
import ctypes
import gc
import json
import subprocess
import sys


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _stack(fmt, n, rows, cols, g):
    import torch
    from epmoe.quantised import Quantised

    if fmt == "mxfp4":
        nb = (cols + 31) // 32
        return Quantised(fmt, torch.randint(0, 256, (n, rows, nb * 16), generator=g,
                                            dtype=torch.uint8),
                         torch.randint(118, 126, (n, rows, nb), generator=g, dtype=torch.uint8))
    G = (cols + 127) // 128
    return Quantised(fmt, torch.randint(-8, 8, (n, rows, cols), generator=g, dtype=torch.int8),
                     0.01 * torch.ones(n, rows, G))


def _one(fmt: str, values: bool, H: int, F: int, E: int) -> dict:
    import torch
    from epmoe.torch import MoE

    torch.set_num_threads(1)
    MoE(64, 32, 8, 2, ranks=1)  # (the first module imports torch._dynamo: ~150 MiB, not counted)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _rss_mib()
    g = torch.Generator().manual_seed(0)
    moe = MoE(H, F, E, 2, ranks=1, max_tokens=16,
              pack_weights=fmt if fmt != "mxfp4" else "auto").eval()
    ckpt = {n: _stack(fmt, E, *s, g) for n, s in (("w1", (F, H)), ("w3", (F, H)), ("w2", (H, F)))}
    moe.load_quantised(ckpt, values=values)
    del ckpt
    gc.collect()
    with torch.no_grad():
        moe(torch.randn(4, H))
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # (what the heap keeps of freed temporaries)
    return {"format": fmt, "values": values, "resident_mib": round(_rss_mib() - base, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # (a child: format, values)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(_one(a.one[0], a.one[1] == "1", a.hidden, a.ffn, a.experts)))
        return
    weights = 3 * a.experts * a.hidden * a.ffn
    print(f"MoE hidden {a.hidden}, ffn {a.ffn}, {a.experts} experts: {weights / 1e6:.0f} M "
          f"weights, float32 {weights * 4 / 2**20:.0f} MiB")
    print(f"{'format':<10} {'codes bytes':>12} {'values MiB':>11} {'codes only MiB':>15} {'ratio':>6}")
    for fmt, bits in (("int4_g128", 4 + 32 / 128), ("mxfp4", 4 + 8 / 32)):
        got = {}
        for values in (True, False):
            out = subprocess.run([sys.executable, __file__, "--hidden", str(a.hidden), "--ffn",
                                  str(a.ffn), "--experts", str(a.experts), "--one", fmt,
                                  "1" if values else "0"], capture_output=True, text=True,
                                 check=True)
            got[values] = json.loads(out.stdout.strip().splitlines()[-1])["resident_mib"]
        codes = weights * bits / 8 / 2**20
        print(f"{fmt:<10} {codes:>9.0f} MiB {got[True]:>11.0f} {got[False]:>15.0f} "
              f"{got[True] / got[False]:>5.1f}x")


if __name__ == "__main__":
    main()
