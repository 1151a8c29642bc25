# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""transformers 5 families whose experts are the plain fused SwiGLU (gate_up_proj [E, 2F, H],
down_proj [E, H, F]) and whose router and shared expert the MoE menu expresses exactly:
DeepSeek-V2/V3 and their router's clones (GLM-4-MoE, dots1, Kimi-Linear, ...), Qwen3-Next,
Qwen3.5-MoE, MiniMax(-M2), AFMoE, HY-V3, Laguna, Flint, Hunyuan-MoE,
FlexOlmo, Mellum, Granite-MoE-hybrid/-SWA, Cohere2-MoE (docs/pytorch.md, docs/models.md).

epmoe.hf reads these through SPECS: each family's router kind, where its tensors live and
which config fields size it. The functions here are epmoe.hf's per-family parts; use hf.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Spec(NamedTuple):
    block: str              # transformers 5 class of the MoE block
    router: str             # see _router_options
    ffn: str                # config field of the experts' width F
    gate: str = "gate.weight"           # the router's weight [E, H]
    bias: Optional[str] = None          # the selection bias [E] (a buffer), if any
    shared: Optional[str] = None        # "mlp:<prefix>" ungated, "gated" (Qwen), "sibling"
    shared_width: tuple = ()  # the shared width: its field, or (the experts' F field, a count)
    # "sigmoid" routers: (config field, block attribute) of the scaling factor, of whether
    # the weights are renormalised (None: always), and of a logit softcap (must be 0)
    scale: Optional[tuple] = None
    norm: Optional[tuple] = None
    softcap: Optional[tuple] = None
    group_mask: str = "minus_inf"  # "dsv3": what a dropped group's experts score (-inf or 0)


_DSV3 = dict(router="dsv3", ffn="moe_intermediate_size", gate="gate.weight",
             bias="gate.e_score_correction_bias", shared="mlp:shared_experts.",
             shared_width=("moe_intermediate_size", "n_shared_experts"))
_QWEN_NEXT = dict(ffn="moe_intermediate_size", shared="gated",
                  shared_width=("shared_expert_intermediate_size",))
_GRANITE = dict(router="softmax", ffn="intermediate_size", gate="router.weight")

SPECS = {
    "deepseek_v3": Spec("DeepseekV3MoE", **_DSV3),
    "glm4_moe": Spec("Glm4MoeMoE", **_DSV3),
    "glm4_moe_lite": Spec("Glm4MoeLiteMoE", **_DSV3),
    "dots1": Spec("Dots1MoE", **_DSV3),
    "solar_open": Spec("SolarOpenMoE", **_DSV3),
    "exaone_moe": Spec("ExaoneMoeSparseMoEBlock", **dict(
        _DSV3, shared_width=("moe_intermediate_size", "num_shared_experts"))),
    "kimi_linear": Spec("KimiLinearMoE", **_DSV3),
    "deepseek_v32": Spec("DeepseekV32MoE", **_DSV3),
    "glm_moe_dsa": Spec("GlmMoeDsaMoE", **_DSV3),
    # A.X-K2 fills dropped groups with 0.0 ("to match the reference implementation"); its
    # Light checkpoints have no groups (n_group None).
    "axk2": Spec("AXK2MoE", **dict(_DSV3, group_mask="zero")),
    "bailing_hybrid": Spec("BailingHybridMoE", **_DSV3),
    "mimo_v2_flash": Spec("MiMoV2FlashMoE", **dict(_DSV3, shared=None, shared_width=())),
    "deepseek_v2": Spec("DeepseekV2Moe", **dict(_DSV3, router="dsv2", bias=None)),
    "qwen3_next": Spec("Qwen3NextSparseMoeBlock", router="softmax_norm", **_QWEN_NEXT),
    "qwen3_5_moe": Spec("Qwen3_5MoeSparseMoeBlock", router="softmax", **_QWEN_NEXT),
    "minimax": Spec("MiniMaxSparseMoeBlock", router="softmax", ffn="intermediate_size"),
    "minimax_m2": Spec("MiniMaxM2SparseMoeBlock", router="sigmoid", ffn="intermediate_size",
                       bias="e_score_correction_bias"),
    "afmoe": Spec("AfmoeSparseMoeBlock", router="sigmoid", ffn="moe_intermediate_size",
                  gate="router.gate.weight", bias="expert_bias", shared="mlp:shared_experts.",
                  shared_width=("moe_intermediate_size", "num_shared_experts"),
                  scale=("route_scale", "router.route_scale")),
    "hy_v3": Spec("HYV3MoE", router="sigmoid", ffn="moe_intermediate_size",
                  bias="e_score_correction_bias", shared="mlp:shared_experts.",
                  shared_width=("moe_intermediate_size", "num_shared_experts"),
                  scale=("router_scaling_factor", "gate.router_scaling_factor")),
    "laguna": Spec("LagunaSparseMoeBlock", router="sigmoid", ffn="moe_intermediate_size",
                   bias="gate.e_score_correction_bias", shared="mlp:shared_experts.",
                   shared_width=("shared_expert_intermediate_size",),
                   scale=("moe_routed_scaling_factor", "routed_scaling_factor"),
                   softcap=("moe_router_logit_softcapping", "gate.router_logit_softcapping")),
    "flint": Spec("FlintSparseMoeBlock", router="sigmoid", ffn="moe_intermediate_size",
                  shared="mlp:shared_expert.", shared_width=("shared_expert_intermediate_size",),
                  norm=("norm_topk_prob", "gate.norm_topk_prob")),
    "hunyuan_v1_moe": Spec("HunYuanMoEV1Moe", router="softmax", ffn="intermediate_size",
                           gate="gate.wg.weight", shared="mlp:shared_mlp.",
                           shared_width=("intermediate_size",)),
    "flex_olmo": Spec("FlexOlmoSparseMoeBlock", router="softmax_norm", ffn="intermediate_size"),
    "mellum": Spec("MellumSparseMoeBlock", router="softmax_norm", ffn="moe_intermediate_size"),
    "granitemoehybrid": Spec("GraniteMoeHybridMoE", shared="sibling",
                             shared_width=("shared_intermediate_size",), **_GRANITE),
    "granitemoe_swa": Spec("GraniteMoeSWAMoE", **_GRANITE),
    "cohere2_moe": Spec("Cohere2MoeSparseMoeBlock", router="cohere2", ffn="intermediate_size",
                        shared="mlp:shared_experts.",
                        shared_width=("intermediate_size", "num_shared_experts")),
}
FAMILIES = {s.block: family for family, s in SPECS.items()}

# The fields naming the experts count and top-k (the configs alias some of them).
_EXPERTS = ("num_local_experts", "n_routed_experts", "num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk")


def _first(f, names):
    for n in names:
        v = f(n, None, required=False)
        if v is not None:
            return n, v
    f(names[0])  # raises, naming the field
    raise AssertionError


def _int_field(family, f, names, require):
    name, v = _first(f, names)
    require(family, isinstance(v, int), name, v,
            "must be one int (a per-layer list: load the block with from_hf, or pass the value)")
    return v


def _router_options(family: str, spec: Spec, f, require) -> dict:
    r = spec.router
    if r == "softmax":
        return dict(router="softmax")
    if r == "softmax_norm":
        return dict(router="softmax" if f("norm_topk_prob") else "softmax_raw")
    if r == "sigmoid":  # sigmoid scores, top-k of scores (+ bias), renormalised, scaled
        o = dict(router="sigmoid_bias")
        if spec.scale:
            o["scaling"] = float(f(spec.scale[0]))
        if spec.norm:
            o["normalize"] = bool(f(spec.norm[0]))
        if spec.softcap:
            cap = f(spec.softcap[0], 0.0, required=False) or 0.0
            require(family, cap == 0.0, spec.softcap[0], cap,
                    "epmoe's router has no logit softcap (tanh): must be 0")
        return o
    if r == "dsv3":  # n_group None (A.X-K2-Light): no groups
        return dict(router="sigmoid_bias", groups=f("n_group", None, required=False) or 1,
                    top_groups=f("topk_group", None, required=False) or 1,
                    normalize=bool(f("norm_topk_prob")),
                    scaling=float(f("routed_scaling_factor")), group_mask=spec.group_mask)
    if r == "dsv2":  # softmax, no renormalisation, optional group limit (a group's best expert)
        method = f("topk_method")
        require(family, method in ("greedy", "group_limited_greedy"), "topk_method", method,
                "must be 'greedy' or 'group_limited_greedy'")
        o = dict(router="softmax_raw", scaling=float(f("routed_scaling_factor")))
        if method == "group_limited_greedy":
            o.update(groups=f("n_group"), top_groups=f("topk_group"), group_by="max")
        return o
    if r == "cohere2":
        fn = f("expert_selection_fn")
        require(family, fn in ("softmax", "sigmoid"), "expert_selection_fn", fn,
                "must be 'softmax' or 'sigmoid'")
        if fn == "softmax":  # softmax over the top-k logits = renormalised top-k softmax
            return dict(router="softmax")
        # sigmoid of the top-k logits (= top-k of sigmoid), renormalised if norm_topk_prob
        return dict(router="sigmoid_bias", normalize=bool(f("norm_topk_prob")))
    raise AssertionError(r)


def shared_ffn(spec: Spec, f) -> int:
    """The shared expert's width (0: none): the product of its config fields."""
    if spec.shared is None:
        return 0
    w = 1
    for name in spec.shared_width:
        w *= f(name)
    return int(w)


def options(family: str, f, require, act) -> dict:
    """MoE keyword arguments of a SPECS family; f reads config fields (epmoe.hf._field)."""
    spec = SPECS[family]
    act(family, "hidden_act", f("hidden_act"), "silu")
    o = dict(hidden=f("hidden_size"), ffn=f(spec.ffn),
             experts=_int_field(family, f, _EXPERTS, require),
             top_k=_int_field(family, f, _TOP_K, require), expert="swiglu")
    o.update(_router_options(family, spec, f, require))
    Fs = shared_ffn(spec, f)
    if family == "cohere2_moe" and Fs:
        how = f("shared_expert_combination_strategy")
        require(family, how in ("sum", "average"), "shared_expert_combination_strategy", how,
                "must be 'sum' or 'average'")
        if how == "average":  # (routed + shared) / 2: the routed weights halved here, the
            o["scaling"] = 0.5  # shared expert's down projection in the tensors (_shared_scale)
    if Fs:
        o.update(shared_experts=1, shared_ffn=Fs, shared_gate=spec.shared == "gated")
    return o


def _shared_keys(spec: Spec, sibling_prefix: str):
    """(gate, up, down, gate-of-the-shared-expert) keys, relative to the block's prefix, or
    (fused input_linear, output_linear) under the sibling prefix for Granite-hybrid."""
    if spec.shared == "gated":
        p = "shared_expert."
        return (p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight",
                "shared_expert_gate.weight")
    p = spec.shared[len("mlp:"):]
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight", None


def _shared_scale(family: str, o: dict) -> float:
    """Cohere2-MoE's "average" halves the shared output: folded into shared_w2."""
    return o.get("scaling", 1.0) if family == "cohere2_moe" else 1.0


def logical_tensors(family: str, get, o: dict, sibling_prefix: str) -> dict:
    """load_logical's tensors (plus router_bias [E] where the family has one)."""
    spec = SPECS[family]
    H, F, E = o["hidden"], o["ffn"], o["experts"]
    fused = get("experts.gate_up_proj", (E, 2 * F, H))
    t = dict(gate=get(spec.gate, (E, H)), w1=fused[:, :F], w3=fused[:, F:],
             w2=get("experts.down_proj", (E, H, F)))
    if spec.bias:
        t["router_bias"] = get(spec.bias, (E,))
    if o.get("shared_experts"):
        Fs = o["shared_ffn"]
        if spec.shared == "sibling":
            both = get("input_linear.weight", (2 * Fs, H), prefix=sibling_prefix)
            t.update(shared_w1=both[None, :Fs], shared_w3=both[None, Fs:],
                     shared_w2=get("output_linear.weight", (H, Fs), prefix=sibling_prefix)[None])
        else:
            g, u, d, sg = _shared_keys(spec, sibling_prefix)
            t.update(shared_w1=get(g, (Fs, H))[None], shared_w3=get(u, (Fs, H))[None],
                     shared_w2=get(d, (H, Fs))[None] * _shared_scale(family, o))
            if sg:
                t["shared_gate"] = get(sg, (1, H))
    return t


def hf_state_dict(family: str, t: dict, o: dict, sibling_prefix: str, gradients: bool):
    """(the block's keys, full keys outside it) of logical tensors t: the inverse of
    logical_tensors (router_bias only when t has it: gradients have none; a folded shared
    scale divides weights back out and multiplies gradients)."""
    spec = SPECS[family]
    out = {spec.gate: t["gate"], "experts.gate_up_proj": torch.cat([t["w1"], t["w3"]], 1),
           "experts.down_proj": t["w2"]}
    if spec.bias and "router_bias" in t:
        out[spec.bias] = t["router_bias"]
    extra = {}
    if o.get("shared_experts"):
        if spec.shared == "sibling":
            extra = {sibling_prefix + "input_linear.weight":
                     torch.cat([t["shared_w1"][0], t["shared_w3"][0]]),
                     sibling_prefix + "output_linear.weight": t["shared_w2"][0]}
        else:
            g, u, d, sg = _shared_keys(spec, sibling_prefix)
            s = _shared_scale(family, o)
            s = s if gradients else 1.0 / s
            out.update({g: t["shared_w1"][0], u: t["shared_w3"][0], d: t["shared_w2"][0] * s})
            if sg:
                out[sg] = t["shared_gate"]
    return out, extra


def _shared_fields(family, spec, b, shared_mlp, F, act, act_name, err) -> dict:
    """The config fields that give the block's shared expert width (0: none): its own width
    field, or a count of experts-wide MLPs (spec.shared_width = (the experts' F, count))."""
    if spec.shared == "sibling":  # Granite-hybrid: the decoder layer's shared_mlp, if given
        mlp = shared_mlp
        Fs, fn = (mlp.hidden_size, mlp.activation) if mlp is not None else (0, None)
    else:
        mlp = b.shared_expert if spec.shared == "gated" else getattr(
            b, spec.shared[len("mlp:"):-1], None)  # Cohere2 without shared experts: none
        Fs, fn = (mlp.gate_proj.weight.shape[0], mlp.act_fn) if mlp is not None else (0, None)
    if mlp is not None and act_name(fn) != act:
        raise ValueError(err(family, f"the shared expert's activation {act_name(fn)!r} "
                                     f"differs from the experts' {act!r}"))
    if len(spec.shared_width) == 2:  # (F, count)
        if Fs % F:
            raise ValueError(err(family, f"the shared expert's width {Fs} is not a multiple of "
                                         f"the experts' {F}"))
        return {spec.shared_width[1]: Fs // F}
    name = spec.shared_width[0]
    if name == spec.ffn:  # Hunyuan: the experts' width field sizes the shared MLP too
        if Fs != F:
            raise ValueError(err(family, f"the shared MLP's width {Fs} differs from the "
                                         f"experts' {F} (both are {name})"))
        return {}
    return {name: Fs}


def block_config(family: str, b, shared_mlp, act_name, err) -> dict:
    """The config fields options() reads, from a block's attributes and weights."""
    spec = SPECS[family]
    E, F2, H = b.experts.gate_up_proj.shape
    F = F2 // 2
    router = b.router if spec.gate.startswith("router.") else b.gate
    if not hasattr(router, "top_k"):
        router = b
    c = {"hidden_size": H, spec.ffn: F, "num_local_experts": E,
         "num_experts_per_tok": router.top_k, "hidden_act": act_name(b.experts.act_fn)}
    if spec.router in ("dsv3", "dsv2"):
        c.update(n_group=router.num_group, topk_group=router.topk_group,
                 routed_scaling_factor=router.routed_scaling_factor)
        if spec.router == "dsv3":
            c["norm_topk_prob"] = router.norm_topk_prob
        else:
            c["topk_method"] = router.topk_method
    elif spec.router == "softmax_norm":
        c["norm_topk_prob"] = router.norm_topk_prob
    elif spec.router == "sigmoid":
        for field in (spec.scale, spec.norm, spec.softcap):
            if field:
                c[field[0]] = _attr(b, field[1])
    elif spec.router == "cohere2":
        c.update(expert_selection_fn=router.expert_selection_fn,
                 norm_topk_prob=router.norm_topk_prob,
                 shared_expert_combination_strategy=getattr(
                     b, "shared_expert_combination_strategy", "sum"))
    if spec.shared is not None:
        c.update(_shared_fields(family, spec, b, shared_mlp, F, c["hidden_act"], act_name, err))
    return c


def _attr(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
