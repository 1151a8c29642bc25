# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe's quantised experts against the anchors, side by side in one run (issue 37).

  python bench/anchors/anchors.py [--shapes mixtral,deepseek] [--tokens 1,16,128]
      [--rounds 3] [--reps 5] [--threads 1] [--engines epmoe,kt,llama.cpp] [--json FILE]
      [--smoke] [--from-json FILE]

Three engines time the experts stage (SwiGLU: gate, up, down) on quant_bench's shapes:
  epmoe      build/<dir>/bench/epmoe_bench_quant (its three tables: fp32/bf16/int8,
             the group-wise formats, fp8_block/mxfp4), OPENBLAS_NUM_THREADS=threads;
  kt         kt_bench.py in kt-kernel's venv (bench/anchors/install.sh), CPUInfer(kt-threads)
             (compute threads, plus its busy-waiting dispatcher: threads - 1 by default);
  llama.cpp  ggml_moe (ggml's MUL_MAT_ID graph, built by install.sh), n_threads=threads.
Every engine evicts the caches with the same read (--flush-mb) before each timed call, warms
up, and reports the median of --reps calls; the engines run one after another, their order
rotated every round, and each point is the median over --rounds rounds (the machine's drift
reaches all three alike). The table: time, MB of weights + scales the call reads (the active
experts'), GB/s = MB / time, and anchor ms / epmoe ms (> 1: epmoe ahead).
Only the standard library here: the engines' own processes carry their dependencies.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# quant_bench.cpp's shapes (H, F, E, k), kept equal by hand.
SHAPES = {
    "mixtral": (4096, 1792, 8, 2),
    "deepseek": (7168, 1024, 16, 8),
    "tiny": (256, 128, 4, 2),
}
# Rows of the table: a format class and, per engine, the formats that stand for it.
CLASSES = [
    ("bf16", {"epmoe": ["bf16"], "kt": ["bf16"], "llama.cpp": ["bf16"]}),
    ("int8/Q8_0", {"epmoe": ["int8"], "kt": ["int8", "q8_0"], "llama.cpp": ["q8_0"]}),
    ("int4/Q4", {"epmoe": ["int4_g32", "int4_g128"], "kt": ["int4_g32", "q4_0", "q4_k"],
                 "llama.cpp": ["q4_0", "q4_k"]}),
    ("fp8", {"epmoe": ["fp8_block"], "kt": ["fp8"], "llama.cpp": []}),
    ("mxfp4", {"epmoe": ["mxfp4"], "kt": ["mxfp4"], "llama.cpp": ["mxfp4"]}),
]
NUM = r"([-\d.]+)"


def parse_quant_bench(text, H, F):
    """epmoe_bench_quant's three tables -> records (engine epmoe)."""
    out, table = [], None
    path = {}
    m = re.search(r"kernels: fp32 .*?; bf16 (.*?); int8 (.*)", text)
    if m:
        path["bf16"], path["int8"] = m.group(1), m.group(2)
    for line in text.splitlines():
        if "group-wise formats," in line:
            path["group"] = line.split("group-wise formats, ", 1)[1]
        if "against fp8_block and mxfp4 (kernel" in line:  # "(kernel K; mxfp4 M)" or "(kernel K)"
            kernels = line.split("(kernel ", 1)[1][:-1]
            path["fp8"], _, mx = kernels.partition("; mxfp4 ")
            path["mxfp4"] = mx or path["fp8"]
        if line.lstrip().startswith("T active"):
            table = "main" if "fp32 ms" in line else "group" if "format" in line else "mini"
            continue
        parts = [p.split() for p in line.split("|")]
        if table is None or len(parts) < 2 or len(parts[0]) != 3 or not parts[0][0].isdigit():
            continue
        T, active = int(parts[0][0]), int(parts[0][1])
        dense = 3 * F * H * active  # weights of the active experts, one byte each
        rec = lambda fmt, ms, nbytes, p: out.append(
            {"engine": "epmoe", "format": fmt, "T": T, "ms": float(ms), "bytes": nbytes,
             "active": active, "path": p})
        if table == "main":
            rec("bf16", parts[1][1], 2 * dense, path.get("bf16", ""))
            rec("int8", parts[1][2], float(parts[3][0]) * 1e6, path.get("int8", ""))
        elif table == "group":
            fmt = parts[1][0].replace("int8_group_g32", "int8_g32")
            if fmt != "bf16" and not fmt.endswith("_ao"):  # (act order: no anchor has it)
                rec(fmt, parts[1][1], float(parts[1][3]) * 1e6, path.get("group", ""))
        else:
            rec("fp8_block", parts[1][1], float(parts[3][0]) * 1e6, path.get("fp8", ""))
            # MXFP4: half a byte a weight and one e8m0 byte per 32 (quantisation.md)
            rec("mxfp4", parts[1][2], dense * (0.5 + 1 / 32), path.get("mxfp4", ""))
    return out


def json_lines(text):
    return [json.loads(l) for l in text.splitlines() if l.startswith("{")]


def run(cmd, env=None, timeout=3600):
    full = dict(os.environ, **(env or {}))
    p = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.stderr.write(f"{cmd[0]} exited {p.returncode}:\n{p.stderr[-2000:]}\n")
    return p.stdout


def engine_epmoe(a, shape, tokens):
    H, F, E, k = SHAPES[shape]
    cmd = [a.epmoe_bin, "--flush-mb", str(a.flush_mb), "--reps", str(a.reps)]
    cmd += ["--smoke"] if a.smoke else ["--shapes", shape, "--tokens", tokens]
    return parse_quant_bench(run(cmd, {"OPENBLAS_NUM_THREADS": str(a.threads)}), H, F)


def engine_kt(a, shape, tokens):
    H, F, E, k = SHAPES[shape]
    fmts = sorted({f for _, e in CLASSES for f in e["kt"]})
    cmd = [a.kt_python, os.path.join(HERE, "kt_bench.py"), "--shape", f"{H},{F},{E},{k}",
           "--tokens", tokens, "--reps", str(a.reps), "--threads", str(a.kt_threads),
           "--flush-mb", str(a.flush_mb), "--formats", ",".join(fmts)]
    env = {"KT_KERNEL_CPU_VARIANT": a.kt_variant} if a.kt_variant else None
    return json_lines(run(cmd, env))


def engine_ggml(a, shape, tokens):
    H, F, E, k = SHAPES[shape]
    fmts = sorted({f for _, e in CLASSES for f in e["llama.cpp"]})
    cmd = [a.ggml_bin, "--shape", f"{H},{F},{E},{k}", "--tokens", tokens, "--reps",
           str(a.reps), "--threads", str(a.threads), "--flush-mb", str(a.flush_mb),
           "--formats", ",".join(fmts)]
    return json_lines(run(cmd))


ENGINES = {"epmoe": engine_epmoe, "kt": engine_kt, "llama.cpp": engine_ggml}


def cpu_line():
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    used = [x for x in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if x in flags]
    return f"{model}, {os.cpu_count()} logical CPUs, flags: {' '.join(used)}"


def table(records, shapes, tokens):
    """Median over rounds per (shape, engine, format, T); one block per shape and T."""
    by = {}
    for r in records:
        if "ms" in r:
            by.setdefault((r["shape"], r["engine"], r["format"], r["T"]), []).append(r)
    med = {key: dict(rs[0], ms=statistics.median(x["ms"] for x in rs), rounds=len(rs))
           for key, rs in by.items()}
    lines = []
    for shape in shapes:
        H, F, E, k = SHAPES[shape]
        lines.append(f"\n{shape}: H {H}, F {F}, E {E}, top-{k}")
        lines.append(f"{'T':>4} {'class':<10} {'engine':<9} {'format':<10} {'ms':>9} {'MB':>7} "
                     f"{'GB/s':>6} {'anchor/epmoe':>12}")
        for T in tokens:
            for name, per in CLASSES:
                ours = [med[(shape, "epmoe", f, T)] for f in per["epmoe"] if (shape, "epmoe", f, T) in med]
                base = ours[0]["ms"] if ours else None
                for eng in ("epmoe", "kt", "llama.cpp"):
                    for f in per[eng]:
                        r = med.get((shape, eng, f, T))
                        if not r:
                            continue
                        ratio = "" if eng == "epmoe" or base is None else f"{r['ms'] / base:.2f}x"
                        lines.append(f"{T:>4} {name:<10} {eng:<9} {f:<10} {r['ms']:>9.3f} "
                                     f"{r['bytes'] / 1e6:>7.1f} {r['bytes'] / r['ms'] / 1e6:>6.1f} "
                                     f"{ratio:>12}")
    return "\n".join(lines), med


def markdown(med, shapes, tokens):
    """One row per shape, T and class: epmoe's first format against each anchor's fastest."""
    out = ["| shape | T | class | epmoe ms (GB/s) | kt-kernel: fastest, ms (GB/s) | x | "
           "llama.cpp: fastest, ms (GB/s) | x |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for shape in shapes:
        for T in tokens:
            for name, per in CLASSES:
                ours = med.get((shape, "epmoe", per["epmoe"][0], T))
                if not ours:
                    continue
                cells = [f"{ours['ms']:.2f} ({ours['bytes'] / ours['ms'] / 1e6:.1f})"]
                for eng in ("kt", "llama.cpp"):
                    rs = [med[(shape, eng, f, T)] for f in per[eng] if (shape, eng, f, T) in med]
                    if not rs:
                        cells += ["—", ""]
                        continue
                    b = min(rs, key=lambda r: r["ms"])
                    x = b["ms"] / ours["ms"]
                    cells += [f"{b['format']} {b['ms']:.2f} ({b['bytes'] / b['ms'] / 1e6:.1f})",
                              f"**{x:.2f}x**" if x >= 1 else f"{x:.2f}x"]
                out.append(f"| {shape} | {T} | {name} ({per['epmoe'][0]}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="mixtral,deepseek")
    ap.add_argument("--tokens", default="1,16,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kt-threads", type=int, help="CPUInfer(n); default threads - 1, at least 1 "
                    "(its dispatcher busy-waits on a core of its own)")
    ap.add_argument("--kt-variant", help="KT_KERNEL_CPU_VARIANT (amx, avx512_bf16, ...); "
                    "default: kt-kernel's own pick for the CPU")
    ap.add_argument("--flush-mb", type=int, default=512)
    ap.add_argument("--engines", default="epmoe,kt,llama.cpp")
    ap.add_argument("--epmoe-bin", default=os.path.join(ROOT, "build", "bench", "epmoe_bench_quant"))
    ap.add_argument("--kt-python", default=os.path.join(ROOT, "build", "anchors", "kt", "bin", "python"))
    ap.add_argument("--ggml-bin", default=os.path.join(ROOT, "build", "anchors", "ggml_moe"))
    ap.add_argument("--json", help="write every round's records here")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, one round, one rep")
    ap.add_argument("--from-json", help="print the tables of an earlier run's --json, run nothing")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            records = json.load(f)["records"]
        shapes = list(dict.fromkeys(r["shape"] for r in records))
        tokens = sorted({r["T"] for r in records if "T" in r})
        text, med = table(records, shapes, tokens)
        print(text + "\n\n" + markdown(med, shapes, tokens))
        return 0
    if a.smoke:
        a.shapes, a.tokens, a.rounds, a.reps, a.flush_mb = "tiny", "1,16", 1, 1, 8
    a.kt_threads = a.kt_threads or max(1, a.threads - 1)
    engines = a.engines.split(",")
    have = {"epmoe": a.epmoe_bin, "kt": a.kt_python, "llama.cpp": a.ggml_bin}
    for e in list(engines):
        if not os.path.exists(have[e]):
            print(f"{e}: {have[e]} not found (bench/anchors/install.sh builds the anchors); left out")
            engines.remove(e)
    if "epmoe" not in engines:
        return 77  # nothing to compare against (CTest's SKIP_RETURN_CODE)
    shapes = a.shapes.split(",")
    tokens = [int(t) for t in a.tokens.split(",")]
    print("anchors: the experts stage per format, epmoe against kt-kernel and llama.cpp")
    print(f"CPU: {cpu_line()}; load average {os.getloadavg()[0]:.1f} at the start")
    print(f"threads: epmoe and llama.cpp {a.threads}, kt-kernel CPUInfer({a.kt_threads}) (+ its "
          f"dispatcher); cache eviction {a.flush_mb} MB "
          f"before every call; median of {a.reps} calls, then of {a.rounds} rounds")
    records = []
    for shape in shapes:
        for rnd in range(a.rounds):
            order = engines[rnd % len(engines):] + engines[: rnd % len(engines)]
            for e in order:
                for r in ENGINES[e](a, shape, a.tokens):
                    records.append(dict(r, shape=shape, round=rnd))
    for e in engines:
        paths = sorted({(r["format"], r["path"]) for r in records if r["engine"] == e and "path" in r})
        print(f"{e} kernels: " + "; ".join(f"{f}: {p}" for f, p in paths))
    errors = [r for r in records if "error" in r]
    for r in errors:
        print(f"{r['engine']} {r['format']}: could not run ({r['error']})")
    bad = [r for r in records if r.get("finite") is False]
    for r in bad:
        print(f"{r['engine']} {r['format']} T={r['T']}: a non-finite output")
    text, med = table(records, shapes, tokens)
    print(text + "\n\n" + markdown(med, shapes, tokens))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"records": records}, f, indent=1)
    # Every epmoe format of the table parsed at every T (a changed quant_bench table shows here).
    missing = [(f, T) for _, per in CLASSES for f in per["epmoe"] for T in tokens
               if (shapes[0], "epmoe", f, T) not in med]
    for f, T in missing:
        print(f"epmoe {f} T={T}: no row in epmoe_bench_quant's output")
    ok = not missing and not bad
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
