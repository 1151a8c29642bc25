# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the 2-process transformers benchmarks (hf_ep_bench.py, hf_model_bench.py):
the seeded Mixtral model both sides start from, transformers' own expert parallelism applied to
it, the 2 gloo processes, the threads of one pass, and the load that other jobs put on the CPUs.
"""
import json
import os
import socket
import tempfile
import time

import compare_torch as ct
import hf_block_bench as hb

EP_IMPLS = ("all_to_all", "all_reduce")


def add_model_args(p, layers=1):
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3584)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=layers, help="decoder layers")
    p.add_argument("--experts-impl", default="grouped_mm",
                   choices=["grouped_mm", "batched_mm", "eager"],
                   help="transformers' experts implementation (the unmodified model's and the "
                        "one inside its EP)")


def smoke_shape(a):
    a.hidden, a.ffn, a.experts, a.top_k = 64, 224, 8, 2


def model_config(args, impl, vocab=512):
    from transformers import MixtralConfig
    heads = max(2, args.hidden // 128)  # transformers' TP splits the heads over 2
    return MixtralConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=heads, head_dim=args.hidden // heads,
                         num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                         router_jitter_noise=0.0, experts_implementation=impl,
                         eos_token_id=None, pad_token_id=0)


def describe(args):
    heads = max(2, args.hidden // 128)  # transformers' TP splits the heads over 2
    return (f"MixtralForCausalLM, {args.layers} layer(s), H={args.hidden} F={args.ffn} "
            f"E={args.experts} top-{args.top_k}, {heads} heads of {args.hidden // heads}, "
            f"vocab 512, fp32, seeded (no download)")


def seeded_model(torch, args):
    """The same model on every process: transformers' EP keeps each process's own slice of the
    expert weights (no broadcast), so they must agree. Each layer's MoE block as
    hf_block_bench's (experts U(-1, 1)/sqrt(fan-in), gate logits of std ~2), layer l seed 1 + l."""
    from transformers import MixtralForCausalLM
    torch.manual_seed(0)
    m = MixtralForCausalLM(model_config(args, args.experts_impl)).eval()
    for i, layer in enumerate(m.model.layers):
        block = hb.hf_block(torch, dict(family="mixtral", hidden=args.hidden, ffn=args.ffn,
                                        experts=args.experts, top_k=args.top_k, shared=0), 1 + i)
        layer.mlp.load_state_dict(block.state_dict())
    return m


def hf_distributed(torch, args, ref, ep_impl):
    """The model distributed by transformers: DistributedConfig(tp_size=2, ep_size=2,
    ep_implementation=ep_impl) through prepare_distribute_model / maybe_distribute_model (its
    default tp_plan: attention split by heads, the experts 4 per process; tp_plan={} is
    refused by transformers 5.23)."""
    from transformers import MixtralForCausalLM
    from transformers.distributed import DistributedConfig
    torch.manual_seed(0)
    m = MixtralForCausalLM(model_config(args, args.experts_impl))
    m.load_state_dict(ref.state_dict())
    dc, _, mesh = MixtralForCausalLM.prepare_distribute_model(
        DistributedConfig(tp_size=2, ep_size=2, ep_implementation=ep_impl))
    return MixtralForCausalLM.maybe_distribute_model(m, dc, mesh).eval()


def set_threads(torch, n):
    """torch's threads and every loaded OpenBLAS's (epmoe's kernels take as many helpers as
    OpenBLAS has threads, read at each pass)."""
    import ctypes
    torch.set_num_threads(n)
    for b in ct.openblas_in_process():
        try:
            ctypes.CDLL(b["library"]).openblas_set_num_threads(n)
        except (OSError, AttributeError):
            pass


class pair_meter:
    """others_meter for 2 cooperating processes: the share of the CPUs used by processes other
    than both benchmark processes (each one's own CPU time is summed over the group; the other
    benchmark process is not 'others'). Every process enters and leaves together."""

    def __init__(self, torch, dist):
        self.torch, self.dist = torch, dist

    def __enter__(self):
        self.b, self.t = ct.cpu_ticks()
        self.own = sum(os.times()[:4])
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return
        b, t = ct.cpu_ticks()
        own = self.torch.tensor([(sum(os.times()[:4]) - self.own) * os.sysconf("SC_CLK_TCK")],
                                dtype=self.torch.float64)
        self.dist.all_reduce(own)
        self.share = max(0.0, (b - self.b) - float(own)) / (t - self.t) if t > self.t else 0.0


def timed(torch, dist, flush, f, ranks=2):
    """One pass: cache eviction, barrier, f(); the slower process's seconds (ranks=1: process
    0 runs f alone while the other waits, and its time is the pass's)."""
    flush.sum()
    dist.barrier()
    t0 = time.perf_counter()
    if ranks == 2 or dist.get_rank() == 0:
        with torch.inference_mode():
            f()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_worker(rank, port):
    """The environment transformers' distributed code reads, and the gloo group."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2)
    return dist


def spawn(worker, args, here):
    """Runs worker(rank, args, port) on 2 processes; what process 0 wrote to args._out."""
    import torch.multiprocessing as mp
    fd, args._out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    try:
        mp.spawn(worker, args=(args, free_port()), nprocs=2, join=True)
        with open(args._out) as f:
            return json.load(f)
    finally:
        os.unlink(args._out)


def write_out(args, obj):
    with open(args._out, "w") as f:
        json.dump(obj, f)


def header(torch, args, coretype, transformers):
    """The machine, threads, versions and kernel lines every 2-process script prints."""
    print(hb.machine_line(torch, args, coretype).replace(
        f"torch {torch.get_num_threads()},", f"torch {args.threads},"))
    print(f"2 gloo processes, {args.threads} torch thread(s) each; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; epmoe kernel {hb.kernel_path()}")


def run_info(torch, args, coretype, transformers, sys):
    """The JSON fields that say what ran where."""
    return {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": {"cpu_model": ct.cpu_model(), "logical_cpus": os.cpu_count(),
                        "flags": sorted(f for f in ct.cpu_flags()
                                        if f.startswith(("avx512", "amx", "avx2", "fma")))},
            "processes": 2, "threads_per_process": args.threads, "openblas_coretype": coretype,
            "kernel": hb.kernel_path(), "torch": torch.__version__,
            "transformers": transformers.__version__, "experts_impl": args.experts_impl,
            "shape": dict(hidden=args.hidden, ffn=args.ffn, experts=args.experts,
                          top_k=args.top_k, layers=args.layers)}


def distributed_or_skip(name):
    """(torch, transformers) with transformers 5's DistributedConfig, the epmoe package and
    gloo, or None after a SKIP line naming what is missing."""
    try:
        import torch
        import torch.distributed as dist
        import transformers
        from transformers.distributed import DistributedConfig  # noqa: F401
        import epmoe.hf  # noqa: F401
        import epmoe.torch  # noqa: F401
    except ImportError as e:
        print(f"{name}: SKIP: {e} (needs torch, transformers 5 and the epmoe package: "
              "PYTHONPATH=build/py/python)")
        return None
    if not dist.is_gloo_available():
        print(f"{name}: SKIP: torch.distributed without gloo")
        return None
    return torch, transformers
