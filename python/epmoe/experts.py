# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.torch.Experts: the routed experts alone, driven by a routing the caller computed
(docs/pytorch.md, "Experts under a framework's router").

A framework that routes itself (transformers 5's `*Experts` modules get `top_k_index` and
`top_k_weights` from their model's router) hands epmoe the tokens, their routing and its own
expert tensors; epmoe reads those in place (no copy), sends each token to the ranks holding its
experts and combines the weighted outputs at home. Differentiable in x, the routing weights and
the expert tensors (through the custom ops of epmoe/_ops.py).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from . import _epmoe, _ops
from ._ranks import EXPERT_TENSORS, _check_sizes, _exchange_group, _placement_table
from ._packing import _pack_format, _pack_option, _packs, _refuse_training, _viewable
from .quantised import FORMATS as _MINIFLOAT
from .quantised import Quantised, check_grouped, codes_of, give, layer_rows, one_format
from .quantised import split_gate_up
from .quantised import _check as check_minifloat

__all__ = ["Experts"]


class _PassState:
    """The tensors bound (pointers and strides), the versions packed, the pass counters; for
    a copied layout, the copies and the caller's tensors (pointers, versions) they hold."""

    bound = bound_params = packed = copies = copied = given = None
    codes = None  # load_quantised without tensors: the format of the codes the layer holds alone
    passes = consumed = 0

# How the caller's tensors hold each expert kind's (w1, w3, w2 | w1, w2, b1, b2 | ...).
LAYOUTS = {
    # transformers 5: gate_up_proj [E, 2F, H] (w1 = the first F rows, w3 the next), down_proj [E, H, F]
    "gate_up": ("gate_up_proj", "down_proj"),
    # transformers 5's GPT-OSS: gate_up_proj [E, H, 2F] with gate and up interleaved column by
    # column, its bias [E, 2F] likewise, down_proj [E, F, H] (transposed), down_proj_bias [E, H].
    "gpt_oss": ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
    "separate": None,  # the expert kind's own tensors, in its order (EXPERT_TENSORS)
}
# The expert kinds each fused layout holds (DeepSeek-V4's clamped SwiGLU: SwiGLU's tensors).
LAYOUT_EXPERTS = {"gate_up": ("swiglu", "deepseek_v4"), "gpt_oss": ("gpt_oss",)}
# The router of the menu entry an expert kind runs under (never run: the routing is given;
# GPT-OSS's logit bias is given as zeros).
ROUTER_OF = {"gpt_oss": "gpt_oss", "deepseek_v4": "sqrtsoftplus_bias"}
# Layouts the layer cannot read in place (interleaved columns, transposed matrices): they are
# copied into the kind's layout once per version of the caller's tensors (an optimizer step,
# an in-place load), and their gradients written back through the same views.
COPIED = ("gpt_oss",)


class Experts(nn.Module):
    """y = sum_k weights[t, k] * E_{ids[t, k]}(x[t]) over expert-parallel ranks, with the
    caller's routing and expert tensors.

    hidden, ffn, experts (E, all ranks together), top_k (K of the routing). expert: "swiglu"
    (w1, w3, w2), "deepseek_v4" (the same tensors, gate and up clamped at 10), "mlp_relu",
    "mlp_relu_bias", "gpt_oss". layout: "gate_up" (swiglu, deepseek_v4: a fused
    gate_up_proj [n, 2F, H] and down_proj [n, H, F], as transformers 5 stores them),
    "gpt_oss" (gpt_oss: GPT-OSS's interleaved, transposed tensors with their biases, copied
    into epmoe's layout once per version: LAYOUTS) or "separate" (the kind's own tensors). n: the experts this process holds — E with thread
    ranks (`ranks`), E/R on a torch.distributed `group` (this rank's slots, placement order).
    Ranks, placement, exchange, capacity, pack_weights and the deadline as epmoe.torch.MoE's.
    The tensors are read in place, float32 on the CPU; with pack_weights (the default "auto":
    in eval mode) the layer keeps a packed copy, refreshed after they change.
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, *, expert: str = "swiglu",
                 layout: str = "gate_up", capacity: str = "dropless", capacity_factor: float = 1.0,
                 schedule: str = "sequential", chunks: int = 0, exchange: str = "flat",
                 ranks_per_node: int = 0, placement: Union[str, Sequence[int]] = "block",
                 max_tokens: int = 4096, max_recv_rows: int = 0,
                 pack_weights: Union[bool, str] = "auto", exchange_timeout: float = 600.0,
                 group=None, exchange_group=None, ranks: Optional[int] = None):
        super().__init__()
        self._key = _ops.register(self)  # (first: it imports torch._dynamo, before any collective)
        R = _check_sizes(hidden, ffn, experts, top_k, max_tokens, expert, group, exchange_group,
                         ranks)
        if layout not in LAYOUTS or expert not in LAYOUT_EXPERTS.get(layout, (expert,)):
            raise ValueError(f"epmoe: layout = {layout!r}: must be 'gate_up' (swiglu, "
                             "deepseek_v4), 'gpt_oss' (gpt_oss) or 'separate'")
        self.hidden, self.ffn, self.experts, self.top_k = hidden, ffn, experts, top_k
        self.ranks, self.group, self.layout, self.expert_kind = R, group, layout, expert
        router = ROUTER_OF.get(expert, "softmax")
        self.bundle = dict(router=router, top_k=int(top_k), expert=expert, capacity=capacity,
                           schedule=schedule, exchange=exchange)
        found = [b for b in _epmoe.menu() if all(b[k] == v for k, v in self.bundle.items())]
        self.config = dict(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k,
                           max_tokens=max_tokens, capacity_factor=float(capacity_factor),
                           shared_experts=0, shared_ffn=0, shared_gate=False, output_bias=False,
                           aux_loss_coef=0.0, seq_len=0, chunks=chunks,
                           max_recv_rows=int(max_recv_rows), ranks_per_node=int(ranks_per_node),
                           training=bool(found and found[0]["trains"]), recompute=False,
                           exchange_timeout=float(exchange_timeout))
        self.phy_to_log = _placement_table(placement, experts, R)
        self.held = experts if group is None else experts // R  # experts of the tensors
        self._local = 1 if group is not None else R
        self._gate = torch.zeros(experts, hidden)  # the unused router's, and its gradient's
        self._gate_grads = [torch.empty(experts, hidden) for _ in range(self._local)]
        self._gate_bias = torch.zeros(experts) if router == "gpt_oss" else None
        self._gate_bias_grads = [torch.empty(experts) for _ in range(self._local)]
        self._exchange = (_exchange_group(group, exchange_group, float(exchange_timeout))
                          if group is not None else (None, None, ""))
        self._pack = _pack_option(pack_weights)
        self._layer = None  # built at the first call, from the tensors it is given
        # Per-pass state on a plain object: nn.Module.__setattr__ costs µs a write, per call.
        self._state = _PassState()

    def extra_repr(self):
        return (f"hidden={self.hidden}, ffn={self.ffn}, experts={self.experts}, "
                f"top_k={self.top_k}, expert={self.expert_kind}, layout={self.layout}, "
                f"ranks={self.ranks}")

    # --- the caller's tensors as the layer's views ----------------------------------------
    def _kind_tensors(self, tensors):
        """The expert kind's tensors (w1, w3, w2 ...) [n, rows, cols] from the caller's, as
        views (strided, for a COPIED layout not readable by the layer)."""
        if self.layout == "gate_up":
            gate_up, down = tensors
            F = self.ffn
            return [gate_up[:, :F], gate_up[:, F:], down]
        if self.layout == "gpt_oss":  # even columns the gate, odd ones up
            gate_up, gate_up_bias, down, down_bias = tensors
            return [gate_up[:, :, 0::2].transpose(1, 2), gate_up[:, :, 1::2].transpose(1, 2),
                    down.transpose(1, 2), gate_up_bias[:, None, 0::2],
                    gate_up_bias[:, None, 1::2], down_bias[:, None, :]]
        return list(tensors)

    def _layer_tensors(self, tensors):
        """What the layer reads: the kind's views, or their copies (COPIED layouts), made
        again only when a caller's tensor is another one or has changed (its _version)."""
        if self.layout not in COPIED:
            return [t.detach() for t in self._kind_tensors(tensors)]
        st = self._state
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        if key != st.copied:
            views = self._kind_tensors([t.detach() for t in tensors])
            if st.copies is None:
                st.copies = [v.contiguous() for v in views]
            else:  # in place: the layer stays bound to the same memory
                for c, v in zip(st.copies, views):
                    c.copy_(v)
            st.copied = key
        return st.copies

    def _check(self, tensors):
        names = LAYOUTS[self.layout] or EXPERT_TENSORS[self.expert_kind]
        if len(tensors) != len(names):
            raise ValueError(f"epmoe: Experts({self.layout}) takes {len(names)} tensors "
                             f"({', '.join(names)}), got {len(tensors)}")
        H, F, n = self.hidden, self.ffn, self.held
        gpt = self.layout == "gpt_oss"
        want = {"gate_up_proj": (n, H, 2 * F) if gpt else (n, 2 * F, H),
                "down_proj": (n, F, H) if gpt else (n, H, F),
                "gate_up_proj_bias": (n, 2 * F), "down_proj_bias": (n, H), "w1": (n, F, H),
                "w3": (n, F, H), "w2": (n, H, F), "b1": (n, 1, F), "b2": (n, 1, H)}
        for name, t in zip(names, tensors):
            if tuple(t.shape) != want[name]:
                raise ValueError(f"epmoe: {name} has shape {tuple(t.shape)}: must be "
                                 f"{want[name]} (the experts this process holds)")
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise TypeError(f"epmoe: {name} is {t.dtype} on {t.device}: the experts are "
                                "read in place as float32 on the CPU")

    def _rank_weights(self, views):
        L = self.experts // self.ranks
        out = [{"gate": self._gate, "experts": [v[r * L:(r + 1) * L] for v in views]}
               if self._local > 1 else {"gate": self._gate, "experts": views}
               for r in range(self._local)]
        if self._gate_bias is not None:
            for d in out:
                d["gate_bias"] = self._gate_bias
        return out

    def _layer_ranks(self) -> int:
        return self._local

    def _bind(self, params):
        """The layer (built at the first call: collective) reading `params`' kind tensors;
        returns them."""
        st = self._state
        if self._layer is None or tuple(t.data_ptr() for t in params) != st.bound_params:
            self._check(params)
        st.bound_params = tuple(t.data_ptr() for t in params)
        tensors = self._layer_tensors(params)
        pointers = tuple((t.data_ptr(), t.stride()) for t in tensors)
        if self._layer is None:
            group, store, key = self._exchange
            self._layer = _epmoe.Layer(self.bundle, self.config, self.phy_to_log,
                                       dict(groups=1, top_groups=1, norm_p=1.0, scaling=1.0,
                                            group_by_max=False, normalize=True,
                                            group_mask_zero=False, gamma=0.0, bias=None,
                                            jitter_eps=0.01),
                                       self._rank_weights(tensors), group,
                                       0 if self.group is not None else self.ranks, store, key)
        elif pointers != st.bound:
            self._layer.rebind(self._rank_weights(tensors))
            st.packed = st.codes = None  # (codes only ends: these tensors' values)
        st.bound = pointers
        return tensors

    def _prepare(self, params):
        st = self._state
        if st.codes and not params:  # codes only: the layer's copies are the weights
            return _refuse_training(self._pack, self.training)
        tensors = self._bind(params)
        _refuse_training(self._pack, self.training)
        packs = _packs(self._pack, self.training)
        versions = tuple(t._version for t in tensors)
        if not packs and st.packed is not None:
            self._layer.pack(False)
            st.packed = None
        elif packs and versions != st.packed:
            self._layer.pack(True, _pack_format(self._pack))
            st.packed = versions
            if st.given and st.given[1] == versions:  # the checkpoint's values, not requantised
                give(self, st.given[0])
            else:
                st.given = None  # the tensors changed since: their values now

    # --- quantised checkpoints ---------------------------------------------------------
    @torch.no_grad()
    def load_quantised(self, tensors: dict, *params: torch.Tensor):
        """The packed copies hold a checkpoint's quantised expert weights as they are (no
        re-quantisation; docs/quantisation.md, "Loaders") and `params` (this module's tensors
        in its layout, the ones the forward is then given) take them dequantised. tensors maps
        names to epmoe.quantised.Quantised stacks of the experts this process holds [n, N, K]
        (slot order), all in one format, every weight matrix given: the layout's names
        ("gate_up_proj" [n, 2F, H], gate rows then up rows, or interleaved in the gpt_oss
        layout as GPT-OSS's *_blocks; "down_proj" [n, H, F]) or the kind's ("w1", "w3",
        "w2"); mxfp4 blocks may keep GPT-OSS's [n, N, K / 32, 16]. fp8 and mxfp4: the module
        then packs as that format; group-wise formats: pack_weights must name it (packed at the
        first forward in eval mode). Collective (a first call builds the layer). Forwards with
        the same, unchanged params read the checkpoint's values; once they change (an
        optimizer step, an in-place write) their values are packed again. A wrong name, shape,
        dtype, format or value raises before anything is written.
        Without params: codes only (docs/codes-only.md): the layer's packed
        codes are the only copy of the weights and forwards are given no tensors (inference
        only; not the gpt_oss layout, whose biases are values); a later forward given tensors
        reads their values instead."""
        kinds, fmt = self._quantised_kinds(tensors, codes=not params)
        if not params:
            return self._load_codes(kinds, fmt)
        self._check(params)
        views = dict(zip(EXPERT_TENSORS[self.expert_kind], self._kind_tensors(list(params))))
        st = self._state
        if fmt in _MINIFLOAT:
            K = {n: views[n].shape[2] for n in kinds}
            plan = {n: (codes_of(t.q).contiguous(), t.scales.contiguous(), K[n])
                    for n, t in kinds.items()}
            self._bind(params)
            self._layer.load_quantised(fmt, layer_rows(self, fmt, plan))  # (checks all)
            self._pack, st.given = fmt, None
        for n, t in kinds.items():
            views[n].copy_(t.dequantise(views[n].shape[2]))
        tensors = self._bind(params)  # (a copied layout: its copies refreshed)
        versions = tuple(t._version for t in tensors)
        if fmt in _MINIFLOAT:
            st.packed = versions
            return
        st.given = ({(n, slot): t.matrix(slot) for n, t in kinds.items()
                     for slot in range(self.held)}, versions)
        if not self.training:  # (in training mode: packed at the first forward in eval)
            self._prepare(params)

    def _load_codes(self, kinds: dict, fmt: str):
        if self.layout in COPIED:
            raise ValueError(f"epmoe: load_quantised without tensors (codes only): the "
                             f"{self.layout} layout's biases are read as values: pass its "
                             "tensors")
        st = self._state
        if self._layer is None:  # built on views the codes replace: memory never touched
            H, F, n = self.hidden, self.ffn, self.held
            self._bind([torch.empty(n, 2 * F, H), torch.empty(n, H, F)] if self.layout == "gate_up"
                       else [torch.empty(n, *(F, H) if k != "w2" else (H, F))
                             for k in EXPERT_TENSORS[self.expert_kind]])
        if fmt in _MINIFLOAT:
            K = {"w1": self.hidden, "w3": self.hidden, "w2": self.ffn}
            rows = layer_rows(self, fmt, {n: (codes_of(t.q).contiguous(), t.scales.contiguous(),
                                              K[n]) for n, t in kinds.items()})
        else:
            rows = layer_rows(self, fmt, {n: Quantised(
                fmt, t.q.contiguous(), t.scales.float().contiguous(),
                None if t.offsets is None else t.offsets.float().contiguous(),
                None if t.order is None else t.order.long().contiguous())
                for n, t in kinds.items()})
        self._layer.load_quantised(fmt, rows, True)  # (checks every entry first)
        self._pack, st.codes, st.given, st.packed = fmt, fmt, None, None
        st.bound = st.bound_params = None  # (a forward given tensors binds them again)

    def _quantised_kinds(self, tensors: dict, codes: bool = False):
        """load_quantised's tensors as {kind tensor name: Quantised [n, N, K]} and their
        format, every entry checked."""
        H, F, n = self.hidden, self.ffn, self.held
        weights = {"w1": (F, H), "w3": (F, H), "w2": (H, F)}
        weights = {k: v for k, v in weights.items() if k in EXPERT_TENSORS[self.expert_kind]}
        fused = self.layout != "separate"
        names = ("gate_up_proj", "down_proj") if fused else tuple(weights)
        fmt = one_format(tensors, "load_quantised")
        if fmt not in _MINIFLOAT and self._pack != fmt and not codes:
            raise ValueError(f"epmoe: load_quantised: {fmt} tensors: pack_weights = "
                             f"{self._pack!r} must name that format")
        kinds = {}
        for key, t in tensors.items():
            if t.format == "mxfp4" and t.q.dim() == 4:  # GPT-OSS's [n, N, K / 32, 16]
                t = t._replace(q=t.q.reshape(*t.q.shape[:2], -1))
            if fused and key == "gate_up_proj":
                if t.q.dim() != 3 or t.q.shape[:2] != (n, 2 * F):
                    raise ValueError(f"epmoe: load_quantised[{key!r}] has shape "
                                     f"{tuple(t.q.shape)}: must be [{n}, {2 * F}, ...]")
                kinds["w1"], kinds["w3"] = split_gate_up(t, F, self.layout == "gpt_oss",
                                                         f"load_quantised[{key!r}]")
            elif key in names:
                kinds["w2" if fused else key] = t
            else:
                raise KeyError(f"epmoe: load_quantised: no quantised tensor {key!r} (this "
                               f"module's: {', '.join(names)})")
        missing = [k for k in names if k not in tensors]
        if missing:
            raise ValueError(f"epmoe: load_quantised: {missing[0]!r} is not given (every "
                             f"weight matrix: {', '.join(names)})")
        for key, t in kinds.items():
            rows, cols = weights[key]
            if fmt in _MINIFLOAT:
                check_minifloat(fmt, key, t.q, t.scales, n, rows, cols, "load_quantised")
            elif tuple(t.q.shape) != (n, rows, cols) or t.q.dtype != torch.int8:
                raise ValueError(f"epmoe: load_quantised[{key!r}] q is {t.q.dtype} "
                                 f"{tuple(t.q.shape)}: {fmt} wants int8 {(n, rows, cols)}")
            else:
                check_grouped(t, f"load_quantised[{key!r}]")
            if t.order is not None and (fmt in _MINIFLOAT or tuple(t.order.shape) != (n, cols)):
                raise ValueError(f"epmoe: load_quantised[{key!r}].order: an act order is a "
                                 f"group-wise format's, int64 [{n}, {cols}]")
        return kinds, fmt

    # --- forward --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *tensors: torch.Tensor) -> torch.Tensor:
        """y [T, H] = the experts of top_k_index [T, K] (global expert ids; -1: an empty
        slot), weighted by top_k_weights [T, K] (>= 0), on x [T, H]. Collective over the
        ranks: every process calls it with its own T (0 is fine). x in float32, or bf16/fp16
        computed in float32 and returned in x's dtype."""
        dtype = x.dtype
        flat = x.reshape(-1, self.hidden)
        if flat.dtype in (torch.bfloat16, torch.float16):  # autocast's: computed in float32
            flat = flat.float()
        flat = flat.contiguous()
        ids = top_k_index.reshape(flat.shape[0], self.top_k).to(torch.int32).contiguous()
        w = top_k_weights.reshape(ids.shape).float().contiguous()
        params = list(tensors)
        keep = _ops.wants_backward(flat, params) or (torch.is_grad_enabled() and w.requires_grad)
        y = _ops.run(self, flat, params, ids, w, keep)[0]
        return y.to(dtype).view(x.shape)

    # The custom op's implementations (epmoe/_ops.py), on real tensors.
    def _op_forward(self, x, params, ids, weights, keep, token_ids=None):
        self._prepare(params)
        y = torch.empty_like(x) if _viewable(x) else torch.empty(0)
        self._layer.forward(x, y, ids, weights, keep)
        self._state.passes += 1
        zero = x.new_zeros(())
        return [y, zero, zero.clone(), zero.clone(), torch.tensor(self._state.passes)]

    def _op_backward(self, dy, losses, x, pass_id, params, weights, wanted, routing_grad):
        pid = int(pass_id)
        st = self._state
        if pid != st.passes or st.consumed == pid:
            raise RuntimeError("epmoe: backward of a forward that is not the Experts' last (call "
                               "backward before the next forward of this module)")
        st.consumed = pid
        frozen = not any(wanted)
        grads = [torch.empty_like(p) for p in params] if not frozen else []
        views = self._kind_tensors(grads) if grads else []
        if views and self.layout in COPIED:  # the kind's layout, written back below
            views, back = [torch.empty_like(c) for c in self._state.copies], views
        L = self.experts // self.ranks
        per_rank = [{"gate": self._gate_grads[r],
                     "experts": [v[r * L:(r + 1) * L] for v in views] if self._local > 1 else views}
                    for r in range(self._local)]
        if self._gate_bias is not None:
            for r, d in enumerate(per_rank):
                d["gate_bias"] = self._gate_bias_grads[r]
        dx = torch.empty_like(dy)
        dw = torch.empty_like(weights) if routing_grad else None
        self._layer.backward(dy.contiguous(), dx, per_rank, 0.0, 0.0, 0.0, False, dw)
        if views and self.layout in COPIED:
            for b, v in zip(back, views):
                b.copy_(v)
        none = dy.new_empty((0,))
        return [dx, dw if dw is not None else none] + [
            grads[i] if w else none.clone() for i, w in enumerate(wanted)]

    def stats(self, rank: int = 0):
        """What the last pass did on a local rank (epmoe.torch.MoE.stats)."""
        return self._layer.stats()[rank]
