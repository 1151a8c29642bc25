# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.torch.MoE: the expert-parallel MoE layer as a torch.nn.Module (docs/pytorch.md).

The module owns its parameters (torch Parameters; the layer reads them in place, no copy)
and runs epmoe's C++ layer for forward and, through autograd, backward. Its ranks are a
torch.distributed process group (each process holds its experts; tokens travel over the
group's all-to-all) or, in one process, `ranks` threads.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from . import _codes, _epmoe, _ops
from . import split as _split
from ._packing import (DISPATCH_ROWS, _pack_format, _pack_option, _packs, _refuse_training,
                       _viewable)
from .quantised import give, plan_given
from ._ranks import (EXPERT_TENSORS, GATE_BIAS_ROUTERS, _check_sizes, _exchange_group,
                     _placement_table, _shape, _table_args)

__all__ = ["MoE", "Experts", "RouterLosses", "menu", "CommError", "CommTimeout", "CommAborted"]

# A failed exchange (RuntimeErrors): CommTimeout past exchange_timeout, CommAborted when a
# peer failed (or this module failed earlier: it refuses every later call).
CommError, CommTimeout, CommAborted = _epmoe.CommError, _epmoe.CommTimeout, _epmoe.CommAborted


class RouterLosses(NamedTuple):
    """The router's losses of the last pass, as torch scalars that carry gradient: the
    load-balancing loss (times aux_loss_coef), its per-sequence form and the z-loss. Over this
    process's tokens (with thread ranks, the mean of the ranks')."""

    aux: torch.Tensor
    seq_aux: torch.Tensor
    z: torch.Tensor


def menu():
    """The precompiled bundles (router, top_k, expert, capacity, schedule)."""
    return _epmoe.menu()


class MoE(nn.Module):
    """The MoE block: a router over `experts` FFN experts, top_k per token, optionally shared
    experts, on expert-parallel ranks.

    Policies come from the precompiled menu (epmoe.menu()): router in softmax (renormalised
    top-k: Mixtral, Qwen3, OLMoE/Qwen norm_topk_prob, DBRX, Granite, JetMoE), softmax_raw (the
    top-k probabilities as they are: Qwen1.5/2-MoE, Jamba, OLMoE, Switch), sigmoid_bias
    (DeepSeek-V3, LFM2-MoE with eps), sqrtsoftplus_bias (DeepSeek-V4), sqrtsoftplus_table
    (DeepSeek-V4's hash layers: router_table [vocab, K], forward(x, token_ids)), softmax_bias
    (ERNIE 4.5 with norm_min), logit_sigmoid (Kolibri), llama4 (top-k of the logits, σ(logit)
    scaling each expert's input: Llama 4), longcat_flash (softmax over experts + zero_experts,
    selection on p + router_bias, times scaling: LongCat-Flash), sparsemixer (PhiMoE, forward
    only), sinkhorn, gpt_oss; the scored routers' weights are divided by max(sum + eps,
    norm_min) when `normalize`; expert in swiglu, mlp_relu, mlp_relu_bias, gpt_oss,
    deepseek_v4 (clamped SwiGLU); capacity in dropless, factor, padded; schedule in
    sequential, pipelined;
    exchange in flat, dedup (a token sends one row to each rank holding any of its experts),
    hierarchical (one row per node of `ranks_per_node` consecutive ranks crosses between
    nodes, fanned out inside the node; docs/architecture.md), low_latency (fixed slots of
    max_tokens x min(top_k, local experts) rows per rank pair, one all-to-all per direction
    and no counts round: decode steps; inference only; docs/decode.md). An unknown
    combination raises ValueError listing the menu.

    Ranks: `group` a torch.distributed ProcessGroup (this process holds experts/R of them;
    every process calls forward and backward together), or `ranks` threads of this process
    (the module then holds every expert). With a group the layer exchanges on
    `exchange_group`: by default a group of its own over the same ranks (made here with
    torch.distributed.new_group, so every process must build the module; the user's
    collectives on `group`, DDP's, may be in flight meanwhile), or the one passed (`group`
    itself to share it). exchange_timeout: seconds an exchange waits for its peers before
    raising CommTimeout (0: no deadline); a rank that fails mid-pass makes its peers' waits
    raise CommAborted (docs/pytorch.md, "Errors"). zero_experts: Z zero-computation (identity)
    experts (LongCat-Flash): the router scores E + Z; a token's pick e >= E adds weight * x and
    sends no row. Parameters: gate [E + Z, H]; w1, w3 [L, F, H], w2
    [L, H, F] (this process's slots in slot order; `expert_ids` names each slot's expert);
    shared_w1/_w3/_w2 [N, Fs, H] ...; shared_gate [N, H]; output_bias [H]; gate_bias [E + Z]
    (router="gpt_oss": the bias on the gate's logits, replicated like the gate).

    pack_weights: whether the layer keeps packed copies of the expert weights (a second copy,
    laid out for its CPU kernel, which reads each weight once per pass at any batch size).
    "auto" (the default): packed while the module is in eval mode, the parameters read
    directly in train mode (repacking after every optimizer step costs more than it saves:
    one read and write of every expert weight, 81 ms for 8 Mixtral experts on a 2-core EPYC).
    True: packed in both modes; "bf16": packed, rounded to bf16 (half the bytes a pass reads;
    the parameters, activations and sums stay fp32), in both modes; "int8": packed as int8
    per output channel with an fp32 scale each (a quarter of the bytes; activations quantised
    per token on AVX512-VNNI; docs/quantisation.md), inference only: a forward in training
    mode raises (call .eval()); group-wise, inference only too: "int4", "int4_g128" (a scale
    per 32 / 128 inputs), "int4_asym", "int4_asym_g128" (and an offset: GPTQ, AWQ, Q4_K),
    "int8_g32" (Q8_0), "..._g<group>"; "fp8": FP8 e4m3fn with an fp32 scale per 128 x 128
    block, and "mxfp4": E2M1 with an E8M0 scale per 32 inputs (both computed as bf16 on
    AVX512-BF16), inference only; all quantised at pack time, or loaded as a checkpoint stores
    them (load_quantised); False: never. Packed
    copies are made again before a forward whenever an expert parameter changed in place (an
    optimizer step, load_state_dict: torch's version counter) or was replaced; a change that
    bypasses the version counter (writing through `p.data`) needs `pack_weights()`.

    dispatch_rows: how the dispatch carries the tokens to the expert ranks: "activations" (the
    default: float32 rows) or "int8" (each token quantised once to int8 with one float32 scale
    per row, about a quarter of the bytes; the experts compute on the dequantised rows, the
    combine stays float32; docs/wire.md), inference only:
    a forward in training mode raises (call .eval()).

    values=False: the routed experts' weight matrices are left uninitialised (their memory
    untouched, so not resident) for load_quantised(tensors, values=False) to replace by codes;
    a forward before that raises (docs/codes-only.md).
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, *,
                 router: str = "softmax", expert: str = "swiglu", capacity: str = "dropless",
                 schedule: str = "sequential", exchange: str = "flat", ranks_per_node: int = 0,
                 placement: Union[str, Sequence[int]] = "block",
                 capacity_factor: float = 1.0, chunks: int = 0, shared_experts: int = 0,
                 zero_experts: int = 0,
                 shared_ffn: int = 0, shared_gate: bool = False, output_bias: bool = False,
                 groups: int = 1, top_groups: int = 1, norm_p: float = 1.0, scaling: float = 1.0,
                 group_by: str = "top2_sum", normalize: Optional[bool] = None,
                 group_mask: str = "minus_inf",
                 router_bias: Optional[Sequence[float]] = None, bias_update: float = 0.0,
                 eps: float = 0.0, norm_min: float = 0.0, router_table=None,
                 jitter_eps: float = 0.01, aux_loss_coef: float = 0.01, seq_len: int = 0,
                 max_tokens: int = 4096, max_recv_rows: int = 0, recompute: bool = False,
                 fuse_grad_accumulation: bool = False, pack_weights: Union[bool, str] = "auto",
                 exchange_timeout: float = 600.0, dispatch_rows: str = "activations",
                 group=None, exchange_group=None, ranks: Optional[int] = None,
                 values: bool = True):
        super().__init__()
        self._key = _ops.register(self)  # (first: it imports torch._dynamo, before any collective)
        R = _check_sizes(hidden, ffn, experts, top_k, max_tokens, expert, group, exchange_group,
                         ranks)
        rank = group.rank() if group is not None else 0
        if group_by not in ("top2_sum", "max"):
            raise ValueError(f"epmoe: group_by = {group_by!r}: must be 'top2_sum' or 'max'")
        if group_mask not in ("minus_inf", "zero"):
            raise ValueError(f"epmoe: group_mask = {group_mask!r}: must be 'minus_inf' or 'zero'")
        if router in ("llama4", "longcat_flash"):  # their weights are not renormalised
            if normalize:
                raise ValueError(f"epmoe: normalize = True: router {router!r} does not "
                                 "renormalise its weights")
            normalize = False
        normalize = True if normalize is None else normalize
        if int(zero_experts) < 0:
            raise ValueError(f"epmoe: zero_experts = {zero_experts}: must be >= 0")
        if router_bias is not None and len(router_bias) != experts + int(zero_experts):
            raise ValueError(f"epmoe: router_bias has {len(router_bias)} values: must have one per "
                             f"scored expert (experts + zero_experts = "
                             f"{experts + int(zero_experts)})")
        if dispatch_rows not in DISPATCH_ROWS:
            raise ValueError(f"epmoe: dispatch_rows = {dispatch_rows!r}: must be 'activations' "
                             "or 'int8'")
        self.dispatch_rows = dispatch_rows
        if exchange not in ("flat", "dedup", "hierarchical", "low_latency"):
            raise ValueError(f"epmoe: exchange = {exchange!r}: must be 'flat', 'dedup', "
                             "'hierarchical' or 'low_latency'")
        entry = dict(router=router, top_k=int(top_k), expert=expert, capacity=capacity,
                     schedule=schedule, exchange=exchange)
        found = [b for b in _epmoe.menu() if all(b[k] == v for k, v in entry.items())]
        trains = bool(found and found[0]["trains"])
        self.hidden, self.ffn, self.experts, self.top_k = hidden, ffn, experts, top_k
        self.ranks, self.rank, self.group = R, rank, group
        self.shared_experts, self.shared_ffn = shared_experts, shared_ffn or ffn
        self.zero_experts = int(zero_experts)
        self.expert_kind, self.bundle = expert, entry
        self.config = dict(hidden=hidden, ffn=ffn, experts=experts, zero_experts=int(zero_experts),
                           top_k=top_k,
                           max_tokens=max_tokens, capacity_factor=float(capacity_factor),
                           shared_experts=shared_experts, shared_ffn=shared_ffn,
                           shared_gate=bool(shared_gate), output_bias=bool(output_bias),
                           aux_loss_coef=float(aux_loss_coef), seq_len=seq_len, chunks=chunks,
                           max_recv_rows=int(max_recv_rows), ranks_per_node=int(ranks_per_node),
                           training=trains, recompute=bool(recompute),
                           dispatch_rows=dispatch_rows,
                           exchange_timeout=float(exchange_timeout))
        self.router_args = dict(groups=groups, top_groups=top_groups, norm_p=float(norm_p),
                                scaling=float(scaling), group_by_max=group_by == "max",
                                normalize=bool(normalize), group_mask_zero=group_mask == "zero",
                                gamma=float(bias_update),
                                bias=None if router_bias is None else [float(b) for b in router_bias],
                                jitter_eps=float(jitter_eps), eps=float(eps),
                                norm_min=float(norm_min), **_table_args(router_table, top_k))
        self.phy_to_log = _placement_table(placement, experts, R)
        L = experts // R
        held = self.phy_to_log if group is None else self.phy_to_log[rank * L:(rank + 1) * L]
        self.register_buffer("expert_ids", torch.tensor(held, dtype=torch.long), persistent=False)

        n = len(held)
        scored = experts + self.zero_experts  # the router scores the zero experts too
        self.gate = nn.Parameter(torch.empty(scored, hidden))
        if router in GATE_BIAS_ROUTERS:
            self.gate_bias = nn.Parameter(torch.empty(scored))
        for name in EXPERT_TENSORS[expert]:
            setattr(self, name, nn.Parameter(torch.empty(_shape(name, n, hidden, ffn))))
        if shared_experts:
            for name in EXPERT_TENSORS[expert]:
                setattr(self, "shared_" + name, nn.Parameter(
                    torch.empty(_shape(name, shared_experts, hidden, self.shared_ffn))))
        if shared_gate:
            self.shared_gate = nn.Parameter(torch.empty(shared_experts, hidden))
        if output_bias:
            self.output_bias = nn.Parameter(torch.empty(hidden))
        self._param_names = [name for name, _ in self.named_parameters(recurse=False)]
        self._codes_only = False if values else "pending"  # True: codes only (epmoe/_codes.py)
        self.reset_parameters()
        self.fuse_grad_accumulation = bool(fuse_grad_accumulation)
        self._grad_cache = {}  # fused: the p.grad buffers this module lends
        self._scratch = {}     # thread ranks 1..R-1: their shares of the replicated gradients
        self._passes = 0
        self._consumed = 0
        self._bound = None
        self.exchange_group, store, abort_key = (
            _exchange_group(group, exchange_group, float(exchange_timeout)) if group is not None
            else (None, None, ""))
        self._make_layer = lambda: _epmoe.Layer(  # (split.py builds its lanes with it)
            entry, self.config, self.phy_to_log, self.router_args, self._rank_weights(),
            self.exchange_group, 0 if group is not None else R, store, abort_key)
        self._layer = self._make_layer()
        self._bound = self._pointers()
        self._pack = _pack_option(pack_weights)
        self._packed_versions = None  # packed at the first forward that packs
        self._given = None  # load_quantised: ({(name, expert): Quantised}, versions after)

    @property
    def packed(self) -> bool:
        """Whether the last forward read packed copies of the expert weights."""
        return self._packed_versions is not None

    def _wants_packing(self) -> bool:
        _refuse_training(self._pack, self.training)
        return _packs(self._pack, self.training)

    def pack_weights(self):
        """Packs the expert weights again now (after writing them through `p.data`, which torch's
        version counter does not see); a no-op when this mode reads the parameters."""
        if self._wants_packing() and not self._codes_only:  # (codes only: nothing to pack)
            self._layer.pack(True, _pack_format(self._pack))
            self._packed_versions = self._versions()
            if self._given and self._given[1] == self._packed_versions:
                give(self, self._given[0])  # the checkpoint's values, not requantised ones
            else:
                self._given = None  # the parameters changed since: their values now

    def load_quantised(self, tensors: dict, *, source: str = "tensors", values: bool = True):
        """The packed copies hold a checkpoint's quantised expert weights as they are (no
        re-quantisation; docs/quantisation.md, "Loaders"); the parameters take them
        dequantised. tensors maps keys to epmoe.quantised.Quantised values, all in one format:
        (name, expert): one matrix [N, K] of a logical expert held here; name: every expert's
        matrices stacked [E, N, K] in logical order (shared_...: [N_shared, ...]). name: "w1",
        "w3", "w2" (the expert's tensors) or "shared_w1" .... Group-wise formats (from_gptq,
        from_awq, from_gguf): either key, in the format pack_weights names. "fp8"
        (Quantised("fp8", float8_e4m3fn or uint8 codes, float32 scale_inv)) and "mxfp4"
        (Quantised("mxfp4", uint8 blocks, uint8 E8M0 scales)): either key (one matrix at a
        time: every expert held here); the module then packs as that format. A wrong name, shape, dtype or format raises ValueError (KeyError:
        an fp8 / mxfp4 name that is no expert tensor); a NaN code or scale, ValueError from the
        layer. A later change of the parameters packs their values again (quantising them).
        values=False: codes only, for serving (docs/codes-only.md): every
        expert weight matrix given, the packed codes become the only copy and the expert
        weight parameters are dropped (biases stay); inference only, once per module."""
        from .quantised import load_quantised

        load_quantised(self, tensors, source, values)

    @torch.no_grad()
    def _load_grouped(self, tensors: dict):
        """load_quantised in a group-wise format: {(name, expert): Quantised [N, K]}."""
        given = dict(self._given[0]) if self._given and self._versions() == self._given[1] else {}
        for name, slot, t in plan_given(self, tensors):  # (every entry checked first)
            getattr(self, name)[slot].copy_(t.dequantise())
            given[(name, slot)] = t
        self._given = (given, self._versions())
        if not self.training:  # (else the first forward in eval mode packs them)
            self.pack_weights()

    def _versions(self):
        kinds = EXPERT_TENSORS[self.expert_kind]
        names = [n for n in self._param_names if n in kinds or n[len("shared_"):] in kinds]
        return tuple(getattr(self, n)._version for n in names)

    # --- Hugging Face blocks (epmoe/hf.py, docs/pytorch.md) --------------------------------
    @classmethod
    def from_hf(cls, block, *, shared_mlp=None, **kw) -> "MoE":
        """The MoE computing what a transformers MoE block computes, with its weights; kw (any
        MoE argument: group or ranks, schedule, capacity, ...) adds to or overrides what the
        block implies. shared_mlp: GraniteMoE-shared's decoder-layer shared MLP."""
        from .hf import from_hf

        return from_hf(block, shared_mlp=shared_mlp, **kw)

    @classmethod
    def from_hf_state_dict(cls, state_dict, hf_config, family: str, prefix: str = "",
                           **kw) -> "MoE":
        """The same from a model's state dict: the block's tensors under `prefix`, the model's
        config, and the family (transformers' model_type, e.g. "mixtral")."""
        from .hf import from_hf_state_dict

        return from_hf_state_dict(state_dict, hf_config, family, prefix, **kw)

    # --- parameters ---------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None):
        """nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)); biases zero. Use one
        generator seed on every rank (the gate is replicated) or load a state dict."""
        for name in self._param_names:
            p = getattr(self, name)
            if _codes.unloaded(self, name):
                continue
            if name in ("output_bias", "gate_bias") or name.endswith(("b1", "b2", "b3")):
                p.zero_()
            else:
                fan_in = p.shape[-1]
                p.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in), generator=generator)

    @torch.no_grad()
    def load_logical(self, tensors: dict, *, source: str = "tensors"):
        """Copies full, logical-order tensors into this module's parameters: gate [E + Z, H];
        w1, w3 [E, F, H], w2 [E, H, F], b1 [E, 1, F], b2 [E, 1, H] (every expert: this
        module keeps the slots it holds, expert_ids); shared_w1 ... [N, ...]; shared_gate
        [N, H]; output_bias [H]. Every parameter must be given; a missing key raises KeyError
        and a wrong shape ValueError, each naming the key, before anything is copied."""
        planned = []
        for name in self._param_names:
            if _codes.unloaded(self, name):  # (values=False: the codes come later)
                continue
            if name not in tensors:
                raise KeyError(f"epmoe: {source}: no tensor for {name!r} (this MoE needs "
                               f"{', '.join(self._param_names)})")
            t = torch.as_tensor(tensors[name])
            p = getattr(self, name)
            routed = name in EXPERT_TENSORS[self.expert_kind]
            want = (self.experts,) + tuple(p.shape[1:]) if routed else tuple(p.shape)
            if tuple(t.shape) != want:
                raise ValueError(f"epmoe: {source}[{name!r}] has shape {tuple(t.shape)}: must be "
                                 f"{want}")
            planned.append((p, t[self.expert_ids] if routed else t))
        for p, t in planned:
            p.copy_(t)

    @torch.no_grad()
    def _experts(self, prefix: str, first: int, n: int):  # (None: codes only's, kept by the layer)
        return [getattr(self, prefix + name)[first:first + n] if hasattr(self, prefix + name)
                else None for name in EXPERT_TENSORS[self.expert_kind]]

    def _rank_weights(self):
        """One dict of views per local rank (thread ranks: each rank's slots of the tensors)."""
        local = self._layer_ranks()
        L = self.experts // self.ranks
        out = []
        for r in range(local):
            w = {"gate": self.gate, "experts": self._experts("", r * L, L)}
            if hasattr(self, "gate_bias"):
                w["gate_bias"] = self.gate_bias
            if self.shared_experts:
                w["shared"] = self._experts("shared_", 0, self.shared_experts)
            if self.config["shared_gate"]:
                w["shared_gate"] = self.shared_gate
            if self.config["output_bias"]:
                w["output_bias"] = self.output_bias
            out.append({k: (v.detach() if isinstance(v, torch.Tensor)
                            else [t if t is None else t.detach() for t in v])
                        for k, v in w.items()})
        return out

    def _layer_ranks(self):
        return 1 if self.group is not None else self.ranks

    def _pointers(self):
        return tuple(getattr(self, n).data_ptr() for n in self._param_names)

    def _grad_targets(self, fused: bool):
        """Where each parameter's gradient is written, and whether the layer adds into it. Not
        fused: new tensors, which autograd hands to p.grad (or adds there). Fused: p.grad
        itself — added into when it exists; when it is None, a buffer this module keeps
        (allocated once, so no step pays for fresh pages) becomes p.grad and is overwritten."""
        names = self._param_names
        if not fused:
            return {n: torch.empty_like(getattr(self, n)) for n in names}, False
        params = [getattr(self, n) for n in names]
        have = [p.grad is not None for p in params]
        for n, p, h in zip(names, params, have):
            if h:
                g = p.grad
                if g.shape != p.shape or g.dtype != p.dtype or not g.is_contiguous() or g.device != p.device:
                    raise RuntimeError(f"epmoe: {n}.grad is {tuple(g.shape)} {g.dtype}, contiguous "
                                       f"{g.is_contiguous()}: fused gradient accumulation adds "
                                       "into it and needs it shaped, typed and laid out as the "
                                       "parameter")
                continue
            buf = self._grad_cache.get(n)
            if buf is None:
                buf = self._grad_cache[n] = torch.empty_like(p)
            if any(have):
                buf.zero_()  # the layer adds into every target this step
            p.grad = buf
        return {n: p.grad for n, p in zip(names, params)}, any(have)

    def _rank_grads(self, grads, accumulate: bool):
        """Each local rank's views of the gradient targets: its slots of the routed experts;
        for the replicated ones rank 0 the target itself, the other thread ranks scratch this
        module keeps (summed into the target afterwards)."""
        L = self.experts // self.ranks
        kinds = EXPERT_TENSORS[self.expert_kind]
        per_rank = []
        for r in range(self._layer_ranks()):
            def own(name):
                if r == 0:
                    return grads[name]
                key = (r, name)
                buf = self._scratch.get(key)
                if buf is None:
                    buf = self._scratch[key] = torch.empty_like(grads[name])
                if accumulate:
                    buf.zero_()
                return buf
            g = {"gate": own("gate"),  # no routed experts' gradients: frozen (no dW)
                 "experts": [grads[k][r * L:(r + 1) * L] for k in kinds if k in grads]}
            if self.shared_experts:
                g["shared"] = [own("shared_" + k) for k in kinds]
            if self.config["shared_gate"]:
                g["shared_gate"] = own("shared_gate")
            if self.config["output_bias"]:
                g["output_bias"] = own("output_bias")
            if "gate_bias" in grads:
                g["gate_bias"] = own("gate_bias")
            per_rank.append(g)
        return per_rank

    def _sum_replicated(self, grads, per_rank):
        kinds = EXPERT_TENSORS[self.expert_kind]
        for g in per_rank[1:]:
            grads["gate"] += g["gate"]
            for i, k in enumerate(kinds):
                if self.shared_experts:
                    grads["shared_" + k] += g["shared"][i]
            for k in ("shared_gate", "output_bias", "gate_bias"):
                if k in g:
                    grads[k] += g[k]

    def _mean_losses(self):
        rows = self._layer.losses()
        n = len(rows)
        return tuple(sum(r[i] for r in rows) / n for i in range(3))

    # --- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, token_ids: Optional[torch.Tensor] = None):
        """y, losses = moe(x): x [..., hidden] on the CPU (float32; bf16/fp16 inputs, as
        autocast makes them, are computed in float32 and y is returned in x's dtype); y the
        same shape; losses a RouterLosses of torch scalars. Collective over the ranks. Runs
        as the custom op epmoe::moe_forward (torch.compile keeps it in one graph); under
        no_grad / inference_mode, or with nothing requiring grad, the layer keeps nothing
        for a backward. token_ids [...] (x's leading shape): the tokens' vocabulary ids, which
        a table router (router="sqrtsoftplus_table", DeepSeek-V4's hash layers) routes by."""
        if self.dispatch_rows != "activations" and self.training:
            raise RuntimeError(f"epmoe: dispatch_rows = {self.dispatch_rows!r} is for inference "
                               "(forward only) and the module is in training mode: call "
                               ".eval(), or dispatch_rows='activations' to train")
        shape, dtype = x.shape, x.dtype
        flat = x.reshape(-1, shape[-1])
        if flat.dtype in (torch.bfloat16, torch.float16):  # autocast's: computed in float32
            flat = flat.float()
        params = [getattr(self, n) for n in self._param_names]
        ids = None if token_ids is None else token_ids.reshape(-1).to(torch.int64).contiguous()
        if self.fuse_grad_accumulation:
            y, aux, seq, z = _ops.FusedMoEFunction.apply(self, flat.contiguous(), ids, *params)
        else:
            y, aux, seq, z, _ = _ops.run(self, flat.contiguous(), params, None, None,
                                         _ops.wants_backward(flat, params), ids)
        return y.to(dtype).view(shape), RouterLosses(aux, seq, z)

    def start(self, x: torch.Tensor):
        """Split phase, for two-batch overlap (epmoe/split.py): posts y = moe(x)'s dispatch and
        returns a handle; finish(handle) returns y. Inference only."""
        return _split.start(self, x)

    def finish(self, handle) -> torch.Tensor:
        return _split.finish(self, handle)

    # The custom op's implementations (epmoe/_ops.py), on real tensors.
    def _op_forward(self, x, params, ids, weights, keep, token_ids=None):
        self._prepare()
        y = torch.empty_like(x) if _viewable(x) else torch.empty(0)
        self._layer.forward(x, y, ids, weights, keep, token_ids)
        self._passes += 1
        aux, seq, z = self._mean_losses()
        return [y, x.new_tensor(aux), x.new_tensor(seq), x.new_tensor(z),
                torch.tensor(self._passes)]

    def _op_backward(self, dy, losses, x, pass_id, params, weights, wanted, routing_grad):
        self._take_pass(int(pass_id))
        kinds = EXPERT_TENSORS[self.expert_kind]
        frozen = not any(w for n, w in zip(self._param_names, wanted) if n in kinds)
        grads = {n: torch.empty_like(p) for n, p in zip(self._param_names, params)
                 if not (frozen and n in kinds)}
        dw = torch.empty_like(weights) if routing_grad else None
        dx = self._run_backward(dy, tuple(float(v) for v in losses), grads, False, dw)
        none = dy.new_empty((0,))
        return [dx, dw if dw is not None else none] + [
            grads[n] if w else none.clone() for n, w in zip(self._param_names, wanted)]

    def _take_pass(self, pass_id: int):
        if pass_id != self._passes or self._consumed == pass_id:
            raise RuntimeError(
                "epmoe: backward of a forward that is not the layer's last: the layer keeps one "
                "forward's state (call backward before the next forward of this module)")
        self._consumed = pass_id

    def _run_backward(self, dy, losses, grads, accumulate, routing_grad):
        """The layer's backward into `grads` (name -> tensor; no routed expert's: frozen);
        returns dx."""
        n = self._layer.local_ranks
        per_rank = self._rank_grads(grads, accumulate)
        dx = torch.empty_like(dy, memory_format=torch.contiguous_format)  # dy may be strided
        scale = 1.0 / n  # the losses are the ranks' mean
        self._layer.backward(dy.contiguous(), dx, per_rank, losses[0] * scale, losses[1] * scale,
                             losses[2] * scale, accumulate, routing_grad)
        self._sum_replicated(grads, per_rank)
        return dx

    def _prepare(self):
        """Before a pass: the layer reads the parameters there are now, packed as the mode
        says (again after an optimizer step changed them in place)."""
        _codes.require_loaded(self)
        if self._pointers() != self._bound:  # a parameter was replaced (load_state_dict(assign), .to())
            self._layer.rebind(self._rank_weights())
            self._bound = self._pointers()
        if not self._wants_packing():
            if self._packed_versions is not None:  # back to reading the parameters
                self._layer.pack(False)
                self._packed_versions = None
        elif self._versions() != self._packed_versions:
            self.pack_weights()  # new values since the last pack

    # --- training on a process group -----------------------------------------------------
    def expert_parameters(self):
        """The routed experts' parameters: each process holds its own, and their gradients
        are complete there (every token routed to them arrived)."""
        kinds = EXPERT_TENSORS[self.expert_kind]
        return [getattr(self, n) for n in self._param_names if n in kinds]

    def replicated_parameters(self):
        """The parameters every process holds a copy of (gate, shared experts, shared gate,
        output bias): each process's gradient covers its own tokens, so sum them over the
        group before a step (allreduce_replicated_grads, or the framework's data parallelism)."""
        kinds = EXPERT_TENSORS[self.expert_kind]
        return [getattr(self, n) for n in self._param_names if n not in kinds]

    def allreduce_replicated_grads(self):
        """Sums the replicated parameters' gradients over the group (one all_reduce each).
        Nothing to do with thread ranks: the module already summed them."""
        if self.group is None:
            return
        for p in self.replicated_parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=self.group)

    # --- load and balancing -------------------------------------------------------------
    def global_load(self):
        """Collective: the last pass's assignments per logical expert [E] and rows computed
        per rank [R], summed over every rank (one small all-to-all)."""
        per_expert, per_rank = self._layer.global_load()
        return torch.tensor(per_expert), torch.tensor(per_rank)

    def update_router_bias(self):
        """Collective, between passes: DeepSeek-V3's aux-loss-free balancing step for
        router="sigmoid_bias": bias_i += bias_update * sign(mean load - load_i) from the last
        pass's global load. Other routers raise ValueError."""
        self._layer.update_router()

    @property
    def router_bias(self) -> torch.Tensor:
        """The selection bias [E] the layer routes with (sigmoid_bias; empty otherwise)."""
        return torch.tensor(self._layer.router_bias())

    def stats(self, rank: int = 0):
        """What the last pass did on a local rank (thread ranks: which one; a process group:
        this process's): rows per expert and rank, drops, bytes, FLOPs, stage times (s)."""
        return self._layer.stats()[rank]

    def all_stats(self):
        """stats() of every local rank."""
        return self._layer.stats()

    def extra_repr(self):
        b = self.bundle
        zero = f", zero_experts={self.zero_experts}" if self.zero_experts else ""
        return (f"hidden={self.hidden}, ffn={self.ffn}, experts={self.experts}{zero}, "
                f"top_k={self.top_k}, "
                f"router={b['router']}, expert={b['expert']}, capacity={b['capacity']}, "
                f"schedule={b['schedule']}, ranks={self.ranks}")


from .experts import Experts  # noqa: E402 - experts.py reads this module's helpers
