#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Trains a tiny MoE language model whose MLPs are epmoe.torch.MoE, on 1 or more processes.

The model: token and position embeddings, a few pre-norm transformer blocks (RMSNorm, causal
self-attention, RMSNorm, an MoE MLP: softmax top-k router over SwiGLU experts, Mixtral's), a
final RMSNorm and an untied head (--tie: tied to the embedding). The data is generated here:
several "languages", each with its own token range and tag token, of three kinds that need
different computation (a sparse Markov chain; x[t+1] = x[t] + x[t-1] mod V; counting by a
per-sequence step), so experts can specialise by language.

Parallelism: data parallel for the dense parameters and the router's gate (every process
holds a copy; their gradients are summed with one all_reduce per step, as DDP would), expert
parallel for the experts (group=WORLD: each process holds experts/N of them, tokens travel
over gloo's all-to-all; an expert's gradient arrives complete on its process). Each process
backpropagates loss_r / N, so the step is the gradient of the processes' mean loss.

    python examples/python/train_tiny_moe.py [--procs 2] [--steps 40] [--compare-hf] [--out DIR]
    torchrun --nproc_per_node 2 examples/python/train_tiny_moe.py [...]

(with build/venv/bin/python and PYTHONPATH=build/default/python, where the epmoe package is
built). Prints per step the
loss, the auxiliary (load-balancing) loss and each layer's share of assignments per expert
(all processes' tokens); at the end writes loss.png, expert_load.png and history.json to
--out (default: <temp>/epmoe_train_tiny_moe).

--compare-hf trains the same model again with transformers' MixtralSparseMoeBlock in place of
epmoe's (same initial weights, data, seeds; the HF block is replicated on every process, so
all its gradients are summed) and exits 1 unless the two loss curves agree within --hf-rtol.
The auxiliary loss is the same on both sides: epmoe's losses.aux is alpha * E * sum_i f_i P_i
over this process's tokens (f_i = assignments to i / (tokens * K), P_i = mean router
probability of i); transformers' load_balancing_loss_func on one layer's logits is
E * sum_i (K f_i) P_i, so the HF side uses it times alpha / K.
"""
import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=2,
                   help="processes to spawn (ignored under torchrun, which sets them)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=128, help="each expert's hidden width")
    p.add_argument("--experts", type=int, default=4, help="a multiple of the processes")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--languages", type=int, default=4)
    p.add_argument("--language-vocab", type=int, default=16, help="tokens of each language")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per process and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-coef", type=float, default=0.01,
                   help="alpha of the load-balancing loss (epmoe's aux_loss_coef)")
    p.add_argument("--tie", action="store_true", help="tie the head to the token embedding")
    p.add_argument("--schedule", default="sequential", choices=["sequential", "pipelined"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per process (default: CPUs / processes)")
    p.add_argument("--compare-hf", action="store_true",
                   help="also train with transformers' MixtralSparseMoeBlock; exit 1 unless "
                        "the loss curves agree within --hf-rtol")
    p.add_argument("--hf-rtol", type=float, default=1e-4,
                   help="largest relative difference of the loss curves allowed")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "epmoe_train_tiny_moe"),
                   help="folder for loss.png, expert_load.png, history.json")
    p.add_argument("--no-plots", action="store_true", help="skip the plots (no matplotlib)")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds a collective may wait for the other processes")
    a = p.parse_args(argv)
    if a.hidden % a.heads:
        p.error(f"--hidden {a.hidden} must be a multiple of --heads {a.heads}")
    if not 1 <= a.top_k <= a.experts:
        p.error(f"--top-k {a.top_k} must be in 1..--experts ({a.experts})")
    if a.steps < 1 or a.procs < 1 or a.seq < 3:
        p.error("--steps and --procs must be >= 1, --seq >= 3")
    return a


# --- data -----------------------------------------------------------------------------------

class Languages:
    """Sequences [tag, x1, x2, ...] of one language each: token ids 0..N-1 are the N tags,
    language l owns ids N + l*V .. N + (l+1)*V - 1. Kinds by l % 3: a Markov chain where each
    token has two successors (3:1), a Fibonacci sequence mod V, counting by a step (1..3)
    chosen per sequence. The rules come from the seed; each (step, rank) has its own batch."""

    KINDS = ("markov", "fibonacci", "count")

    def __init__(self, languages, vocab, seed):
        self.n, self.v = languages, vocab
        self.size = languages * (vocab + 1)
        g = torch.Generator().manual_seed(seed)
        self.successors = [torch.randint(0, vocab, (vocab, 2), generator=g)
                           for _ in range(languages)]
        self.seed = seed

    def batch(self, sequences, length, step, rank):
        """inputs, targets [sequences, length - 1] (next-token prediction)."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1009 + rank)
        out = torch.empty(sequences, length, dtype=torch.long)
        for b in range(sequences):
            lang = int(torch.randint(0, self.n, (1,), generator=g))
            kind = self.KINDS[lang % len(self.KINDS)]
            x = [int(t) for t in torch.randint(0, self.v, (2,), generator=g)]
            coins = torch.rand(length, generator=g)
            stride = int(torch.randint(1, 4, (1,), generator=g))
            while len(x) < length - 1:
                if kind == "markov":
                    x.append(int(self.successors[lang][x[-1], 0 if coins[len(x)] < 0.75 else 1]))
                elif kind == "fibonacci":
                    x.append((x[-1] + x[-2]) % self.v)
                else:
                    x.append((x[-1] + stride) % self.v)
            out[b, 0] = lang
            out[b, 1:] = torch.tensor(x) + self.n + lang * self.v
        return out[:, :-1].contiguous(), out[:, 1:].contiguous()


# --- model ----------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head self-attention, written out (every step of it visible)."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = (t.view(B, S, self.heads, H // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(H, dim=-1))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(H // self.heads)
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, S, H))


class EpmoeMLP(nn.Module):
    """The MoE MLP on epmoe: returns y, the aux loss, this process's assignments per expert."""

    def __init__(self, a, group):
        super().__init__()
        from epmoe.torch import MoE
        self.moe = MoE(a.hidden, a.ffn, a.experts, a.top_k, router="softmax", expert="swiglu",
                       schedule=a.schedule, aux_loss_coef=a.aux_coef,
                       max_tokens=a.batch * (a.seq - 1), group=group)

    def forward(self, h):
        y, losses = self.moe(h)
        load = torch.tensor(self.moe.stats()["routed_per_expert"], dtype=torch.float64)
        return y, losses.aux, load

    def load_logical(self, w):
        self.moe.load_logical(w)

    def expert_parameters(self):
        """The parameters this process alone holds (not data parallel)."""
        return [self.moe.w1, self.moe.w3, self.moe.w2]


class HFMLP(nn.Module):
    """transformers' Mixtral block, the same interface as EpmoeMLP (see the module doc for the
    aux loss)."""

    def __init__(self, a):
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral import modeling_mixtral
        # eager: transformers' reference loop over the experts.
        self.cfg = MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ffn,
                                 num_local_experts=a.experts, num_experts_per_tok=a.top_k,
                                 hidden_act="silu", router_jitter_noise=0.0,
                                 experts_implementation="eager")
        self.block = modeling_mixtral.MixtralSparseMoeBlock(self.cfg)
        self.balance = modeling_mixtral.load_balancing_loss_func
        self.experts, self.top_k, self.alpha = a.experts, a.top_k, a.aux_coef
        # transformers 5's block returns y alone: its router's logits come from a hook.
        self._logits = None
        self.block.gate.register_forward_hook(lambda m, i, out: setattr(self, "_logits", out[0]))

    def forward(self, h):
        y = self.block(h)
        logits = self._logits
        aux = self.balance((logits,), self.experts, self.top_k) * (self.alpha / self.top_k)
        ids = logits.detach().softmax(dim=-1).topk(self.top_k, dim=-1).indices
        load = torch.bincount(ids.flatten(), minlength=self.experts).to(torch.float64)
        return y, aux, load

    @torch.no_grad()
    def load_logical(self, w):
        from epmoe import hf  # the logical tensors in the block's names and fused layout
        self.block.load_state_dict(hf.hf_state_dict("mixtral", w, self.cfg))

    def expert_parameters(self):
        return []  # replicated on every process: data parallel like the rest


class Block(nn.Module):
    def __init__(self, a, mlp):
        super().__init__()
        self.norm1, self.attn = RMSNorm(a.hidden), Attention(a.hidden, a.heads)
        self.norm2, self.mlp = RMSNorm(a.hidden), mlp

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        y, aux, load = self.mlp(self.norm2(x))
        return x + y, aux, load


class TinyMoELM(nn.Module):
    def __init__(self, a, vocab, make_mlp):
        super().__init__()
        self.embed = nn.Embedding(vocab, a.hidden)
        self.pos = nn.Embedding(a.seq, a.hidden)
        self.blocks = nn.ModuleList(Block(a, make_mlp()) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden)
        self.head = None if a.tie else nn.Linear(a.hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        aux, loads = 0.0, []
        for block in self.blocks:
            x, a, load = block(x)
            aux, loads = aux + a, loads + [load]
        x = self.norm(x)
        logits = self.head(x) if self.head is not None else x @ self.embed.weight.t()
        return logits, aux, torch.stack(loads)

    def dense_parameters(self):
        """(name, parameter) of everything outside the MoE MLPs, sorted by name."""
        return sorted((n, p) for n, p in self.named_parameters() if ".mlp." not in n)

    def replicated_parameters(self):
        """What data parallelism sums the gradients of: all but the held experts."""
        held = {id(p) for b in self.blocks for p in b.mlp.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in held]


@torch.no_grad()
def initialise(model, a, seed):
    """The same weights for any MLP kind and on every process: one generator, parameters in a
    fixed order; the MoE's as full logical tensors (gate [E,H], w1/w3 [E,F,H], w2 [E,H,F])."""
    g = torch.Generator().manual_seed(seed)

    def uniform(*shape):  # nn.Linear's default, U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        return (torch.rand(*shape, generator=g) * 2 - 1) / math.sqrt(shape[-1])

    for name, p in model.dense_parameters():
        if name.startswith(("embed", "pos")):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        elif p.dim() == 1:
            p.fill_(1.0)  # norms
        else:
            p.copy_(uniform(*p.shape))
    E, H, Fw = a.experts, a.hidden, a.ffn
    for block in model.blocks:
        block.mlp.load_logical({"gate": uniform(E, H), "w1": uniform(E, Fw, H),
                                "w3": uniform(E, Fw, H), "w2": uniform(E, H, Fw)})


# --- training -------------------------------------------------------------------------------

def train(model, a, data, rank, world, label):
    """Adam on mean over processes of (cross entropy + aux); returns one record per step."""
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    replicated = model.replicated_parameters()
    history = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        inputs, targets = data.batch(a.batch, a.seq, step, rank)
        logits, aux, load = model(inputs)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        ((ce + aux) / world).backward()
        for p in model.parameters():
            # An HF expert that got no token has no gradient; epmoe writes zeros. Zeros on both
            # sides keep Adam's update (its moments still move) the same.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        figures = torch.cat([torch.stack([ce.detach(), aux.detach()]).double(), load.flatten()])
        if world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in replicated])
            dist.all_reduce(flat)  # one call: the sum over processes, as DDP's buckets
            at = 0
            for p in replicated:
                p.grad.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()
            dist.all_reduce(figures)
        opt.step()
        ce_mean, aux_mean = (figures[:2] / world).tolist()
        counts = figures[2:].view(load.shape)
        share = counts / counts.sum(dim=1, keepdim=True)
        history.append({"step": step, "loss": ce_mean + aux_mean, "ce": ce_mean,
                        "aux": aux_mean, "load": counts.tolist(), "share": share.tolist(),
                        "ms": (time.perf_counter() - t0) * 1e3})
        if rank == 0:
            loads = "  ".join(f"L{i} " + " ".join(f"{100 * s:3.0f}" for s in row)
                              for i, row in enumerate(share.tolist()))
            print(f"[{label}] step {step:3d}  loss {ce_mean + aux_mean:.5f}  aux {aux_mean:.5f}"
                  f"  load % {loads}  {history[-1]['ms']:.0f} ms", flush=True)
    return history


def plot(out, a, runs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for label, hist in runs.items():
        style = "-" if label == "epmoe" else "--"
        steps = [h["step"] for h in hist]
        ax[0].plot(steps, [h["loss"] for h in hist], style, label=label)
        ax[1].plot(steps, [h["aux"] for h in hist], style, label=label)
    ax[0].set(xlabel="step", ylabel="loss (cross entropy + aux)", title="training loss")
    ax[1].set(xlabel="step", ylabel="aux loss (sum over layers)",
              title=f"load-balancing loss (alpha {a.aux_coef})")
    for x in ax:
        x.legend()
        x.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=100)
    plt.close(fig)

    hist = runs["epmoe"]
    share = torch.tensor([h["share"] for h in hist])  # [steps, layers, E]
    fig, ax = plt.subplots(a.layers, 1, figsize=(8, 1 + 1.6 * a.layers), squeeze=False)
    for layer in range(a.layers):
        im = ax[layer, 0].imshow(share[:, layer, :].T.numpy(), aspect="auto", cmap="viridis",
                                 vmin=0, vmax=max(0.5, float(share.max())),
                                 interpolation="nearest")
        ax[layer, 0].set(ylabel=f"layer {layer}\nexpert", yticks=range(a.experts))
        fig.colorbar(im, ax=ax[layer, 0], label="share of assignments")
    ax[-1, 0].set_xlabel("step")
    ax[0, 0].set_title(f"load per expert (all processes' tokens; even = {1 / a.experts:.2f})")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "expert_load.png"), dpi=100)
    plt.close(fig)


class Mismatch(Exception):
    pass


def worker(rank, world, init_method, a):
    """One process: join the group (world > 1), train epmoe (and HF), report, plot."""
    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // world))
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=a.timeout))
        group = dist.group.WORLD
    try:
        data = Languages(a.languages, a.language_vocab, a.seed)
        runs = {}
        model = TinyMoELM(a, data.size, lambda: EpmoeMLP(a, group))
        initialise(model, a, a.seed)
        if rank == 0:
            held = [b.mlp.moe.expert_ids.tolist() for b in model.blocks][0]
            procs = f"{world} processes (gloo)" if world > 1 else "1 process"
            print(f"{procs}; {a.layers} blocks, hidden {a.hidden}, "
                  f"{a.experts} experts (top-{a.top_k}, ffn {a.ffn}; process 0 holds {held}), "
                  f"vocab {data.size}, {a.batch}x{a.seq - 1} tokens per process and step, "
                  f"{torch.get_num_threads()} threads", flush=True)
        runs["epmoe"] = train(model, a, data, rank, world, "epmoe")
        if a.compare_hf:
            hf = TinyMoELM(a, data.size, lambda: HFMLP(a))
            initialise(hf, a, a.seed)
            runs["hf"] = train(hf, a, data, rank, world, "hf")
        return report(rank, a, runs)
    finally:
        if world > 1:
            dist.destroy_process_group()


def report(rank, a, runs):
    """Rank 0 writes the files, checks the run (the figures are all-reduced: every rank has
    the same) and raises Mismatch when it fails; the other ranks just end (a rank that fails
    first would get the others killed before rank 0 reports)."""
    ep = runs["epmoe"]
    bad = [h["step"] for h in ep if not math.isfinite(h["loss"])]
    summary = {"first_loss": ep[0]["loss"], "last_loss": ep[-1]["loss"], "nonfinite_steps": bad}
    if "hf" in runs:
        rel = {k: max(abs(e[k] - h[k]) / max(abs(h[k]), 1e-30) for e, h in zip(ep, runs["hf"]))
               for k in ("loss", "ce", "aux")}
        summary.update(hf_max_rel_diff=rel, hf_rtol=a.hf_rtol, hf_agrees=rel["loss"] <= a.hf_rtol)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "history.json"), "w") as f:
            json.dump({"args": vars(a), "summary": summary, "runs": runs}, f, indent=1)
        if not a.no_plots:
            plot(a.out, a, runs)
        print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over {a.steps} "
              f"steps; wrote {a.out}/history.json" +
              ("" if a.no_plots else ", loss.png, expert_load.png"))
        if "hf" in runs:
            r = summary["hf_max_rel_diff"]
            print(f"epmoe vs transformers' MixtralSparseMoeBlock: max relative difference of "
                  f"the loss curves {r['loss']:.2e} (cross entropy {r['ce']:.2e}, aux "
                  f"{r['aux']:.2e}); allowed {a.hf_rtol:.0e}: "
                  f"{'agree' if summary['hf_agrees'] else 'DIFFER'}", flush=True)
    if rank != 0:
        return summary
    if bad:
        raise Mismatch(f"loss not finite at steps {bad}")
    if "hf" in runs and not summary["hf_agrees"]:
        raise Mismatch(f"epmoe and HF loss curves differ by "
                       f"{summary['hf_max_rel_diff']['loss']:.2e} (relative), over --hf-rtol "
                       f"{a.hf_rtol:.0e}")
    return summary


def _spawned(rank, world, init_method, a):
    try:
        worker(rank, world, init_method, a)
    except Mismatch as e:
        print(f"train_tiny_moe: rank {rank}: FAIL: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def main(argv=None):
    a = parse_args(argv)
    if not a.no_plots:
        try:
            import matplotlib  # noqa: F401 - fail now, not after training
        except ImportError:
            sys.exit("train_tiny_moe: matplotlib is needed for the plots (apt install "
                     "python3-matplotlib, or pip) or pass --no-plots")
    if a.compare_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            sys.exit("train_tiny_moe: --compare-hf needs transformers (pip install transformers)")
    try:
        import epmoe.torch  # noqa: F401
    except ImportError as e:
        sys.exit(f"train_tiny_moe: cannot import epmoe.torch ({e}): build it (cmake --build "
                 "build/py) and put build/py/python on PYTHONPATH")

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun started us
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _check_experts(a, world)
        try:
            worker(rank, world, "env://", a)
        except Mismatch as e:
            print(f"train_tiny_moe: rank {rank}: FAIL: {e}", file=sys.stderr, flush=True)
            return 1
        return 0
    _check_experts(a, a.procs)
    if a.procs == 1:
        try:
            worker(0, 1, None, a)
        except Mismatch as e:
            print(f"train_tiny_moe: FAIL: {e}", file=sys.stderr)
            return 1
        return 0
    # Threads of each process's BLAS: inherited by the spawned processes.
    per = str(a.threads or max(1, (os.cpu_count() or 1) // a.procs))
    os.environ.setdefault("OMP_NUM_THREADS", per)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", per)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_spawned, args=(a.procs, "file://" + os.path.join(tmp, "rdv"), a),
                               nprocs=a.procs, join=True, start_method="spawn")
        except Exception as e:  # noqa: BLE001 - a process failed: say which, exit nonzero
            print(f"train_tiny_moe: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    return 0


def _check_experts(a, world):
    if a.experts % world:
        sys.exit(f"train_tiny_moe: --experts {a.experts} must be a multiple of the processes "
                 f"({world})")


if __name__ == "__main__":
    sys.exit(main())
