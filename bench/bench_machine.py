# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""The machine side of a fair side-by-side run (compare_torch.py and the hf_* benchmarks use
it through compare_torch): the same threads and BLAS kernels on both sides, the CPU's name and
flags, idle checks before timing, and the figures written as JSON."""
import json
import os
import time


def write_json(path, result):
    """Writes a run's figures (folders made as needed), proves they read back, says where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    with open(path) as f:
        json.load(f)
    print(f"\nwrote {path}")


def add_fairness_args(p):
    """The arguments every side-by-side run shares (torch_module_bench.py too): threads, BLAS
    kernels, torch's OpenMP wait policy, repetitions, and waiting for a quiet machine."""
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads on every side (default: all CPUs)")
    p.add_argument("--omp-wait-policy", default="passive", choices=["passive", "active", "unset"],
                   help="OMP_WAIT_POLICY for torch (default passive: with torch's default spin, "
                        "its idle OpenMP workers take the cores from its BLAS threads, which "
                        "made PyTorch up to 2x slower on 2 cores; unset keeps the environment's)")
    p.add_argument("--coretype", default="auto",
                   help="OPENBLAS_CORETYPE for every side: auto (SkylakeX when the CPU has "
                        "AVX-512, else OpenBLAS's own choice), none, or a name")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=40)
    p.add_argument("--min-seconds", type=float, default=2.0)
    p.add_argument("--wait-idle", type=float, default=300.0,
                   help="before each point, wait up to this many seconds for the machine to be "
                        "idle (other jobs skew a side-by-side run); 0: do not wait")
    p.add_argument("--busy-retries", type=int, default=1,
                   help="measure a point again, up to this many times, when other processes "
                        "used over 5%% of the CPUs while it ran; the least disturbed is kept")


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def set_environment(args):
    """The BLAS settings of both sides; must run before torch (and its OpenBLAS) loads."""
    coretype = args.coretype
    if coretype == "auto":
        # OpenBLAS's SkylakeX kernels are much faster where they run; elsewhere they crash.
        coretype = "SkylakeX" if "avx512f" in cpu_flags() else None
    elif coretype == "none":
        coretype = None
    if coretype:
        os.environ["OPENBLAS_CORETYPE"] = coretype
    else:
        os.environ.pop("OPENBLAS_CORETYPE", None)
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # PyTorch at its best: an idle OpenMP worker that spins (libgomp's default) holds a core
    # its OpenBLAS threads need (measured on 2 cores: HF's Mixtral block 2x slower at
    # T = 128 and 1024). epmoe runs no OpenMP, so the setting is PyTorch's alone.
    if args.omp_wait_policy != "unset":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    return coretype


def omp_wait_policy():
    """The OMP_WAIT_POLICY torch runs with, for reports."""
    return os.environ.get("OMP_WAIT_POLICY", "(unset: libgomp spins)")


def openblas_in_process():
    """(library path, core name, threads) of each OpenBLAS this process has loaded."""
    import ctypes
    found = []
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({l.split()[-1] for l in f if "blas" in l and "/" in l})
    except OSError:
        return found
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            name = lib.openblas_get_corename
            name.restype = ctypes.c_char_p
            found.append({"library": path, "core": name().decode(),
                          "threads": int(lib.openblas_get_num_threads())})
        except (OSError, AttributeError):
            pass
    return found


# --- is the machine ours? -------------------------------------------------------------------


def cpu_ticks():
    """(busy, total) clock ticks of all CPUs so far (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def idle_fraction(seconds):
    b0, t0 = cpu_ticks()
    time.sleep(seconds)
    b1, t1 = cpu_ticks()
    return 1.0 - (b1 - b0) / (t1 - t0) if t1 > t0 else 1.0


def wait_idle(limit):
    """Waits (up to `limit` s) until the CPUs are >= 90% idle; returns the last idle fraction."""
    if limit <= 0:
        return None
    start = time.time()
    f = idle_fraction(1.0)
    while f < 0.9 and time.time() - start < limit:
        f = idle_fraction(2.0)
    return f


class others_meter:
    """The share of the CPUs that other processes used while a point ran: all busy ticks less
    this process's and its children's CPU time."""

    def __enter__(self):
        self.b, self.t = cpu_ticks()
        self.own = sum(os.times()[:4])
        return self

    def __exit__(self, *exc):
        b, t = cpu_ticks()
        hz = os.sysconf("SC_CLK_TCK")
        own = (sum(os.times()[:4]) - self.own) * hz
        self.share = max(0.0, (b - self.b) - own) / (t - self.t) if t > self.t else 0.0


# --- the PyTorch layers ---------------------------------------------------------------------
