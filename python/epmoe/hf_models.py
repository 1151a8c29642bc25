# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Whole transformers 5 models whose experts run in epmoe (docs/pytorch.md, "Whole models").

    model = AutoModelForCausalLM.from_config(config)        # float32, on the CPU
    epmoe.hf.expert_parallel(model, dist.group.WORLD)       # each rank keeps E/R experts
    model.generate(ids, ...)                                # every rank, the same inputs

transformers 5 dispatches each `*Experts` module's forward(hidden [T, H], top_k_index [T, K],
top_k_weights [T, K]) through its experts registry (transformers.integrations.moe); this module
registers an "epmoe" implementation there and switches the model to it. The router, shared
experts, attention and dense layers stay transformers' own, replicated on every rank: every
rank runs the same tokens, and the experts function hands each rank 1/R of the rows, runs
epmoe's exchange on that share (epmoe.torch.Experts) and all-gathers the outputs.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import torch as _et  # first: it imports .experts, which imports it back
from .experts import LAYOUTS

__all__ = ["IMPLEMENTATION", "register", "use_epmoe", "expert_parallel", "experts_modules",
           "local_experts", "expert_bytes"]

IMPLEMENTATION = "epmoe"  # the name in transformers' experts registry


def _err(what: str) -> str:
    return f"epmoe.hf: {what}"


# --- rows: each rank's share of the replicated tokens ----------------------------------------

def _shares(T: int, R: int):
    """Rows per rank: T split as evenly as possible, the first ranks one more."""
    base, extra = divmod(T, R)
    return [base + (r < extra) for r in range(R)]


def _gather_rows(t: torch.Tensor, counts, group) -> torch.Tensor:
    """Every rank's rows in rank order (all_gather needs equal sizes: padded to the largest)."""
    import torch.distributed as dist

    n = max(counts)
    pad = t.new_zeros((n - t.shape[0],) + tuple(t.shape[1:]))
    parts = [t.new_empty((n,) + tuple(t.shape[1:])) for _ in counts]
    dist.all_gather(parts, torch.cat([t, pad]).contiguous(), group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


class _TakeShare(torch.autograd.Function):
    """Forward: this rank's rows of a replicated [T, ...] tensor. Backward: every rank's share
    of the gradient gathered, so the replicated layers upstream see the whole batch's."""

    @staticmethod
    def forward(ctx, t, group, counts, rank):
        ctx.group, ctx.counts = group, counts
        start = sum(counts[:rank])
        return t[start:start + counts[rank]]

    @staticmethod
    def backward(ctx, g):
        return _gather_rows(g.contiguous(), ctx.counts, ctx.group), None, None, None


class _GatherShares(torch.autograd.Function):
    """Forward: the ranks' output rows gathered into the replicated [T, H]. Backward: this
    rank's rows of the gradient (every rank holds the same one: no sum over ranks)."""

    @staticmethod
    def forward(ctx, y, group, counts, rank):
        ctx.start, ctx.n = sum(counts[:rank]), counts[rank]
        return _gather_rows(y, counts, group)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.start:ctx.start + ctx.n], None, None, None


# --- the experts implementation ---------------------------------------------------------------

def _experts_forward(self, hidden_states, top_k_index, top_k_weights, **kwargs):
    """transformers' experts contract: [T, H], [T, K] global expert ids, [T, K] -> [T, H]."""
    st = self.__dict__.get("_epmoe")
    if st is None:
        raise RuntimeError(_err(f"{type(self).__name__} has no epmoe experts: call "
                                "epmoe.hf.use_epmoe(model) (or expert_parallel) on the model "
                                "before switching it to experts_implementation='epmoe'"))
    ex, group = st["experts"], st["group"]
    if ex.training != self.training:  # eval packs the expert weights, train reads them
        ex.train(self.training)
    x, ids, w = hidden_states, top_k_index, top_k_weights
    if "fp8" in st:  # the codes' dequantised values (loaded again when the codes change)
        if _fp8_key(self) != st["fp8"][0]:
            st["fp8"] = _load_fp8(self, ex)
        tensors = st["fp8"][1]
    else:
        tensors = [getattr(self, n) for n in LAYOUTS[ex.layout]]
    if group is None:
        return ex(x, ids, w, *tensors)
    R, r = group.size(), group.rank()
    counts = _shares(x.shape[0], R)
    start = sum(counts[:r])
    # T < R (a decode step) leaves a rank no rows: it still takes part in every collective
    # call (the exchange, the gathers, their backward) with an empty share.
    xs = _TakeShare.apply(x, group, counts, r)
    ws = _TakeShare.apply(w, group, counts, r)
    ys = ex(xs, ids[start:start + counts[r]], ws, *tensors)
    return _GatherShares.apply(ys, group, counts, r)


def register():
    """Registers the "epmoe" experts implementation with transformers (idempotent), in the
    experts registry and in FP8Experts' own."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, _experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # (a transformers without FP8 experts)
        return
    FP8ExpertsInterface.register(IMPLEMENTATION, _experts_forward)


# --- FP8 / FP4 experts (transformers' FineGrainedFP8Config): the codes packed as they are ---------

_FP8_TENSORS = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")


def _is_fp8(m) -> bool:
    """FP8Experts' codes: e4m3 (expert_dtype "fp8") or two e2m1 a byte (int8, "fp4")."""
    dtype = getattr(m.gate_up_proj, "dtype", None)
    return dtype == torch.float8_e4m3fn or (dtype == torch.int8 and
                                            hasattr(m, "gate_up_proj_scale_inv"))


def _e8m0(scale: torch.Tensor, where: str) -> torch.Tensor:
    """FP4 experts' per-32-input scales as E8M0 bytes (mxfp4's): ue8m0 (float8_e8m0fnu) as it
    is, float32 when every scale is a power of two (else ValueError: not MXFP4)."""
    if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        return scale.view(torch.uint8)
    s = scale.float()
    mant, e = torch.frexp(s)  # s = mant 2^e, mant in [0.5, 1)
    if not bool(((mant == 0.5) & (e >= -126) & (e <= 128)).all()):
        raise ValueError(_err(f"{where}: float scales that are not powers of two in [2^-127, "
                              "2^127]: epmoe's mxfp4 copies hold E8M0 scales"))
    return (e - 1 + 127).to(torch.uint8)


def _fp8_key(m):
    return tuple((getattr(m, n).data_ptr(), getattr(m, n)._version) for n in _FP8_TENSORS)


def _load_fp8(m, ex):
    """(the codes' key, []): ex's packed copies hold m's fp8 codes and scales as they are, the
    only copy epmoe keeps (codes only: its forwards are given no tensors)."""
    from .quantised import Quantised

    gu, down = m.gate_up_proj.detach(), m.down_proj.detach()
    gs, ds = m.gate_up_proj_scale_inv.detach(), m.down_proj_scale_inv.detach()
    if gu.dtype == torch.int8:  # FP4: two e2m1 a byte, low nibble first, a scale per 32 inputs
        q = {"gate_up_proj": Quantised("mxfp4", gu.view(torch.uint8), _e8m0(gs, "gate_up_proj")),
             "down_proj": Quantised("mxfp4", down.view(torch.uint8), _e8m0(ds, "down_proj"))}
    else:
        q = {"gate_up_proj": Quantised("fp8", gu, gs.float()),
             "down_proj": Quantised("fp8", down, ds.float())}
    ex.load_quantised(q)
    return _fp8_key(m), []


def _check_fp8(where: str, m):
    """transformers' FP8Experts: e4m3 codes with 128 x 128 scale_inv blocks, or FP4 (two e2m1
    a byte, an E8M0 scale per 32 inputs: mxfp4), dynamic activations, SwiGLU (DeepSeek-V4's
    clamp at 10: deepseek_v4); else ValueError."""
    from .hf import _act_name
    from .hf_fused import _DSV4_LIMIT

    block = getattr(m, "block_size", None)
    fp8_blocks = () if m.gate_up_proj.dtype == torch.int8 else (  # (FP4: a scale per 32 inputs)
        ("block_size", tuple(block) if block is not None else None, (128, 128),
         "epmoe's fp8 blocks are 128 x 128"),)
    for attr, got, want, rule in fp8_blocks + (
            ("activation_scheme", getattr(m, "activation_scheme", "dynamic"), "dynamic",
             "static activation scales are not applied"),
            ("has_bias", bool(getattr(m, "has_bias", False)), False, "no biases"),
            ("gate_softcap", getattr(m, "gate_softcap", None), None, "no softcapped gate"),
            ("swiglu_alpha", getattr(m, "swiglu_alpha", None), None, "no GPT-OSS gate")):
        if got != want:
            raise ValueError(_err(f"{where}: {attr} = {got!r}: {rule} ({want!r})"))
    limit = getattr(m, "limit", None)
    if limit is not None and float(limit) != _DSV4_LIMIT:
        raise ValueError(_err(f"{where}: limit = {limit!r}: epmoe's deepseek_v4 expert clamps "
                              f"at {_DSV4_LIMIT}"))
    if _act_name(m.act_fn) != "silu":
        raise ValueError(_err(f"{where}: act_fn = {_act_name(m.act_fn)!r}: epmoe's experts "
                              "compute silu"))
    if m.gate_up_proj.device.type != "cpu":
        raise TypeError(_err(f"{where}: fp8 experts on {m.gate_up_proj.device}: load the "
                             "checkpoint onto the CPU first (epmoe reads the codes there)"))
    return ("swiglu" if limit is None else "deepseek_v4"), "gate_up"


# --- finding and checking the experts ---------------------------------------------------------

def experts_modules(model):
    """[(name, module)] of the model's transformers 5 experts modules (those its experts
    registry dispatches: fused gate_up_proj and down_proj)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "is_concatenated") and isinstance(getattr(m, "down_proj", None),
                                                            torch.Tensor)]


def _check_gpt_oss(where: str, m):
    """GptOssExperts: transposed, interleaved, biased, the clamped gate of expert::gpt_oss."""
    from .hf import _GPT_OSS_ALPHA, _GPT_OSS_LIMIT

    for attr, want in (("alpha", _GPT_OSS_ALPHA), ("limit", _GPT_OSS_LIMIT)):
        if abs(float(getattr(m, attr)) - want) > 1e-6:
            raise ValueError(_err(f"{where}: {attr} = {getattr(m, attr)!r} (swiglu_{attr}): "
                                  f"epmoe's gpt_oss expert computes {want}"))
    gu, down = m.gate_up_proj, m.down_proj
    E, H, F2 = gu.shape
    if tuple(down.shape) != (E, F2 // 2, H) or tuple(m.gate_up_proj_bias.shape) != (E, F2) \
            or tuple(m.down_proj_bias.shape) != (E, H):
        raise ValueError(_err(f"{where}: gate_up_proj {tuple(gu.shape)}, down_proj "
                              f"{tuple(down.shape)}: must be [E, H, 2F] and [E, F, H] with "
                              "biases [E, 2F] and [E, H]"))
    for t in (gu, down, m.gate_up_proj_bias, m.down_proj_bias):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(_err(f"{where}: expert weights are {t.dtype} on {t.device}: epmoe "
                                 "computes in float32 on the CPU"))
    return "gpt_oss", "gpt_oss"


# Experts whose own _apply_gate is SwiGLU computed in float32: SwiGLU itself for the float32
# model epmoe requires.
_FP32_SWIGLU_GATES = ("BeamExperts",)
# Experts whose own _apply_gate is DeepSeek-V4's clamped SwiGLU, silu(min(gate, limit)) *
# clamp(up, ±limit), on SwiGLU's fused tensors: class -> the attribute holding the limit.
_DSV4_GATES = {"DeepseekV4Experts": "limit", "HYV4Experts": "swiglu_limit"}


def _check(name: str, m):
    """The (expert, layout) of epmoe.torch.Experts computing m: act(x W_gate) * (x W_up) W_down
    with SiLU and no biases (DeepSeek-V4's and HY-V4's with the gate and up clamped at 10), or
    GPT-OSS's experts (LAYOUTS["gpt_oss"]); else ValueError."""
    from transformers.integrations.moe import _default_apply_gate

    from .hf import _act_name
    from .hf_fused import _DSV4_LIMIT

    cls = type(m).__name__
    where = f"{name} ({cls})"
    if cls == "GptOssExperts":
        return _check_gpt_oss(where, m)
    if _is_fp8(m):
        return _check_fp8(where, m)
    expert = "swiglu"
    if cls in _DSV4_GATES:
        attr = _DSV4_GATES[cls]
        if float(getattr(m, attr)) != _DSV4_LIMIT:
            raise ValueError(_err(f"{where}: {attr} = {getattr(m, attr)!r}: epmoe's deepseek_v4 "
                                  f"expert clamps at {_DSV4_LIMIT}"))
        expert = "deepseek_v4"
    for flag, want, rule in (("has_gate", True, "epmoe's experts are gated (SwiGLU)"),
                             ("has_bias", False, "epmoe's experts have no biases"),
                             ("is_transposed", False, "gate_up_proj must be [E, 2F, H]"),
                             ("is_concatenated", True, "gate rows then up rows, not interleaved"),
                             ("has_post_expert_norm", False, "no norm after each expert")):
        if bool(getattr(m, flag, want)) != want:
            raise ValueError(_err(f"{where}: {flag} = {not want}: {rule}"))
    if expert == "swiglu" and cls not in _FP32_SWIGLU_GATES and \
            getattr(type(m), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        raise ValueError(_err(f"{where}: its own _apply_gate (a clamped or custom gate): "
                              "epmoe's experts compute silu(gate) * up"))
    fn = getattr(m, "act_fn", None)
    act = fn.__name__ if callable(fn) and hasattr(fn, "__name__") else _act_name(fn)  # F.silu
    if fn is None and cls == "HYV4Experts":  # its _apply_gate calls F.silu
        act = "silu"
    if act != "silu":
        raise ValueError(_err(f"{where}: act_fn = {act!r}: epmoe's swiglu experts compute silu"))
    gu, down = m.gate_up_proj, m.down_proj
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[1] != 2 * down.shape[2] \
            or gu.shape[2] != down.shape[1] or gu.shape[0] != down.shape[0]:
        raise ValueError(_err(f"{where}: gate_up_proj {tuple(gu.shape)} and down_proj "
                              f"{tuple(down.shape)}: must be [E, 2F, H] and [E, H, F]"))
    if gu.dtype != torch.float32 or down.dtype != torch.float32 or gu.device.type != "cpu":
        raise TypeError(_err(f"{where}: expert weights are {gu.dtype} on {gu.device}: epmoe "
                             "computes in float32 on the CPU"))
    return expert, "gate_up"


def _top_k(name: str, m, model) -> int:
    """K from the router beside the experts (its top_k), else the config."""
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    for child in parent.children():
        k = getattr(child, "top_k", None)
        if child is not m and isinstance(k, int):
            return k
    for field in ("num_experts_per_tok", "moe_topk", "top_k"):
        k = getattr(getattr(m, "config", None), field, None)
        if isinstance(k, int):
            return k
    raise ValueError(_err(f"{name}: no router with an int top_k beside it and no "
                          "num_experts_per_tok in its config: pass top_k="))


# --- switching a model ---------------------------------------------------------------------------

def use_epmoe(model, group=None, *, placement: Union[str, Sequence[int]] = "block",
              exchange: str = "flat", max_tokens: int = 4096, exchange_timeout: float = 600.0,
              pack_weights: Union[bool, str] = "auto", top_k: Optional[int] = None):
    """Runs the experts of a transformers 5 model in epmoe (returns the model, changed in place).

    Registers the "epmoe" experts implementation, builds an epmoe.torch.Experts per experts
    module and switches the model to it (model.set_experts_implementation("epmoe")).
    group: a torch.distributed process group of R ranks: each rank then keeps only its
    experts' slices of gate_up_proj [L, 2F, H] and down_proj [L, H, F] (L = E/R; new
    Parameters, the full tensors freed once nothing else holds them: build optimizers
    after this call), every rank must run the same inputs (the rest of the model is
    replicated), and each experts call computes 1/R of the rows on each rank. Every rank
    calls this with the same model, in the same order (the experts modules share one
    exchange group of their own, made here: the layers run one after another). placement, exchange, max_tokens (rows per rank and pass), exchange_timeout,
    pack_weights: epmoe.torch.Experts's. top_k: K where no router beside the experts has it.
    Raises ValueError (TypeError for dtypes) naming the module and the rule for experts
    epmoe cannot compute (biases, a custom gate, another activation, other layouts)."""
    found = experts_modules(model)
    if not found:
        raise ValueError(_err(f"{type(model).__name__} has no transformers 5 experts modules "
                              "(a fused gate_up_proj / down_proj with an experts registry)"))
    for name, m in found:
        if "_epmoe" in m.__dict__:  # a second call would slice the slices again
            raise ValueError(_err(f"{name}: already runs in epmoe (use_epmoe was called on "
                                  "this model)"))
    kinds = [_check(name, m) for name, m in found]
    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(_err(f"{type(model).__name__} is not a transformers PreTrainedModel"))
    register()
    R = group.size() if group is not None else 1
    rank = group.rank() if group is not None else 0
    shared = None  # the first module's exchange group, for all (one gloo group, not one a layer)
    for (name, m), (expert, layout) in zip(found, kinds):
        E = m.gate_up_proj.shape[0]
        H, F = m.down_proj.shape[1:] if layout == "gate_up" else m.down_proj.shape[:0:-1]
        F *= 2 if m.down_proj.dtype == torch.int8 else 1  # (FP4: two inputs a byte)
        if E % R:
            raise ValueError(_err(f"{name}: {E} experts: must be a multiple of the group's "
                                  f"{R} ranks"))
        K = top_k or _top_k(name, model=model, m=m)
        fp8 = _is_fp8(m)
        ex = _et.Experts(H, F, E, K, expert=expert, layout=layout, group=group,
                        placement=placement, exchange=exchange, max_tokens=max_tokens,
                        exchange_timeout=exchange_timeout,
                        pack_weights="auto" if fp8 else pack_weights, exchange_group=shared)
        shared = ex._exchange[0]
        ex.train(m.training)
        L = E // R
        held = [int(e) for e in ex.phy_to_log[rank * L:(rank + 1) * L]]  # this rank's slots
        if group is not None:  # keep this rank's slots, in slot order
            idx = torch.tensor(held, dtype=torch.long)
            with torch.no_grad():
                for pname in _FP8_TENSORS if fp8 else LAYOUTS[layout]:
                    old = getattr(m, pname)
                    setattr(m, pname, torch.nn.Parameter(old.detach().index_select(0, idx),
                                                         requires_grad=old.requires_grad))
        # Outside the module tree: no new state_dict keys or parameters.
        m.__dict__["_epmoe"] = dict(experts=ex, group=group, held=held, experts_total=E)
        if fp8:  # (collective: the layer is built here)
            m.__dict__["_epmoe"]["fp8"] = _load_fp8(m, ex)
    model.set_experts_implementation(IMPLEMENTATION)
    return model


def expert_parallel(model, group, **kw):
    """use_epmoe(model, group, **kw): the experts split over the process group's ranks."""
    if group is None:
        raise ValueError(_err("expert_parallel needs a process group (use_epmoe(model) for "
                              "one process)"))
    return use_epmoe(model, group, **kw)


def local_experts(model) -> dict:
    """{experts module name: the logical expert of each slot this rank holds}."""
    return {n: list(m.__dict__["_epmoe"]["held"]) for n, m in experts_modules(model)
            if "_epmoe" in m.__dict__}


def expert_bytes(model) -> int:
    """Bytes of the routed experts' parameters this rank holds (numel * element_size)."""
    return sum(p.numel() * p.element_size() for _, m in experts_modules(model)
               for p in m.parameters(recurse=False))
