# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Hugging Face MoE blocks in epmoe.torch.MoE (docs/pytorch.md).

    moe = from_hf(model.model.layers[0].mlp)                      # a transformers 5 block
    moe = from_hf_state_dict(sd, config, "mixtral", prefix="model.layers.0.mlp.")

A family is transformers' model_type of the block (FAMILIES). options() turns its config into
MoE keyword arguments; logical_tensors() turns its state dict into load_logical()'s tensors
(transformers 5's fused gate_up_proj split into gate and up, transposed layouts copied,
per-expert Linear weights stacked);
hf_state_dict() is the inverse (weights, or gradients with gradients=True), and
module_tensors() reads a module's parameters (or their .grad) back in logical order.

Nothing here imports transformers: a block is recognised by its class name and read through
its attributes and weights (the blocks mostly do not keep their config).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping, Optional

import torch

from . import hf_fused, hf_mechanisms
from .quantised import Quantised, checkpoint_tensors

__all__ = ["FAMILIES", "family_of", "options", "logical_tensors", "hf_state_dict",
           "module_tensors", "from_hf", "from_hf_state_dict",
           # whole models (epmoe/hf_models.py)
           "use_epmoe", "expert_parallel", "local_experts", "expert_bytes"]

# transformers 5 class -> family (its model_type).
FAMILIES = {
    "MixtralSparseMoeBlock": "mixtral",
    "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "OlmoeSparseMoeBlock": "olmoe",
    "JambaSparseMoeBlock": "jamba",
    "DbrxFFN": "dbrx",
    "GraniteMoeMoE": "granitemoe",
    "GraniteMoeSharedMoE": "granitemoeshared",
    "JetMoeMoE": "jetmoe",
    "AriaTextMoELayer": "aria",
    "PhimoeSparseMoeBlock": "phimoe",
    "SwitchTransformersSparseMLP": "switch_transformers",
    "NllbMoeSparseMLP": "nllb_moe",
    **hf_fused.FAMILIES,  # DeepSeek-V2/V3, Qwen3-Next, GLM-4-MoE, ... (epmoe/hf_fused.py)
    "GptOssMLP": "gpt_oss",
    **hf_mechanisms.FAMILIES,  # LongCat-Flash, Llama 4 (epmoe/hf_mechanisms.py)
}
# GPT-OSS's gate constants, as the menu's gpt_oss expert compiles them (expert::gpt_oss_clamp).
_GPT_OSS_ALPHA, _GPT_OSS_LIMIT = 1.702, 7.0
_FAMILY_NAMES = sorted(set(FAMILIES.values()))


def _err(family: str, what: str) -> str:
    return f"epmoe.hf: {family}: {what}"


def family_of(block) -> str:
    """The family of a transformers MoE block, by its class (or a base class) name."""
    for cls in type(block).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    raise TypeError(f"epmoe.hf: {type(block).__name__} is not a supported MoE block; supported: "
                    f"{', '.join(sorted(FAMILIES))}")


def _check_family(family: str):
    if family not in _FAMILY_NAMES:
        raise ValueError(f"epmoe.hf: family = {family!r}: must be one of "
                         f"{', '.join(_FAMILY_NAMES)}")


# --- config -------------------------------------------------------------------------------

def _config(family: str, cfg):
    """The config object options() reads: a dict becomes attributes; Aria's AriaConfig its
    text_config; DBRX's ffn_config a namespace."""
    if isinstance(cfg, Mapping):
        cfg = SimpleNamespace(**cfg)
    if family == "aria" and getattr(cfg, "text_config", None) is not None:
        cfg = cfg.text_config
        if isinstance(cfg, Mapping):
            cfg = SimpleNamespace(**cfg)
    return cfg


def _field(family: str, cfg, name: str, default=None, required=True):
    obj = cfg
    for part in name.split("."):
        if isinstance(obj, Mapping):
            if part in obj:
                obj = obj[part]
                continue
        elif hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if required:
            raise ValueError(_err(family, f"the config has no {name!r} (needed for this family)"))
        return default
    return obj


def _require(family: str, ok: bool, field: str, value, rule: str):
    if not ok:
        raise ValueError(_err(family, f"{field} = {value!r}: {rule}"))


def _act(family: str, field: str, value, want: str):
    # transformers' ACT2FN: "swish" is SiLU too.
    same = {"silu": ("silu", "swish"), "relu": ("relu",)}[want]
    _require(family, value in same, field, value,
             f"epmoe's {'swiglu' if want == 'silu' else 'mlp_relu'} expert computes {want}")


def options(family: str, hf_config, **overrides) -> dict:
    """MoE keyword arguments for a block of `family` built from `hf_config` (a transformers
    config, or a dict of its fields). `overrides` replace or add arguments (group, ranks,
    schedule, capacity, ...; ffn for an NLLB-MoE block whose encoder and decoder widths
    differ). A setting epmoe cannot reproduce raises ValueError naming the field."""
    _check_family(family)
    c = _config(family, hf_config)
    f = lambda name, *a, **k: _field(family, c, name, *a, **k)  # noqa: E731
    o: dict = {}
    if family in hf_fused.SPECS:
        o = hf_fused.options(family, f, _require, _act)
    elif family in hf_mechanisms.NAMES:
        o = hf_mechanisms.options(family, f, _require, _act)
    elif family in ("mixtral", "phimoe", "granitemoe", "granitemoeshared", "jetmoe"):
        o = dict(hidden=f("hidden_size"), ffn=f("intermediate_size"),
                 experts=f("num_local_experts"), top_k=f("num_experts_per_tok"),
                 router="softmax", expert="swiglu")
        if family == "jetmoe":
            _act(family, "activation_function", f("activation_function"), "silu")
            o["output_bias"] = True
        else:
            _act(family, "hidden_act", f("hidden_act"), "silu")
        if family == "granitemoeshared" and f("shared_intermediate_size", 0, required=False):
            # The shared MLP is the decoder layer's shared_mlp (beside the block).
            o.update(shared_experts=1, shared_ffn=f("shared_intermediate_size"))
        if family == "phimoe":
            _require(family, o["top_k"] == 2, "num_experts_per_tok", o["top_k"],
                     "PhiMoE's sparsemixer routes to 2 experts")
            o.update(router="sparsemixer", jitter_eps=float(f("router_jitter_noise")))
    elif family in ("qwen2_moe", "qwen3_moe", "olmoe", "jamba"):
        ffn = f("moe_intermediate_size") if family.startswith("qwen") else f("intermediate_size")
        norm = family != "jamba" and bool(f("norm_topk_prob"))
        _act(family, "hidden_act", f("hidden_act"), "silu")
        o = dict(hidden=f("hidden_size"), ffn=ffn, experts=f("num_experts"),
                 top_k=f("num_experts_per_tok"), router="softmax" if norm else "softmax_raw",
                 expert="swiglu")
        if family == "qwen2_moe":
            o.update(shared_experts=1, shared_ffn=f("shared_expert_intermediate_size"),
                     shared_gate=True)
    elif family == "dbrx":
        act = f("ffn_config.ffn_act_fn", None, required=False) or {"name": "silu"}
        _act(family, "ffn_config.ffn_act_fn['name']", _field(family, act, "name", "silu", False),
             "silu")
        p = f("ffn_config.moe_normalize_expert_weights", None, required=False)
        o = dict(hidden=f("d_model"), ffn=f("ffn_config.ffn_hidden_size"),
                 experts=f("ffn_config.moe_num_experts"), top_k=f("ffn_config.moe_top_k"),
                 expert="swiglu")
        if p is None:  # the top-k probabilities as they are
            o["router"] = "softmax_raw"
        else:  # divided by their p-norm
            o.update(router="softmax", norm_p=float(p))
    elif family == "aria":
        _act(family, "hidden_act", f("hidden_act"), "silu")  # the shared MLP's; routed: silu
        _require(family, not f("mlp_bias", False, required=False), "mlp_bias",
                 f("mlp_bias", False, required=False), "the shared MLP must have no biases")
        F, N = f("intermediate_size"), f("moe_num_shared_experts")
        o = dict(hidden=f("hidden_size"), ffn=F, experts=f("moe_num_experts"), top_k=f("moe_topk"),
                 router="softmax", expert="swiglu")
        if N:  # Aria's N shared experts are one MLP of width N * F.
            o.update(shared_experts=1, shared_ffn=N * F)
    elif family == "switch_transformers":
        _act(family, "dense_act_fn", f("dense_act_fn"), "relu")
        _require(family, not f("router_bias", False, required=False), "router_bias", True,
                 "epmoe's gate has no bias")
        o = dict(hidden=f("d_model"), ffn=f("d_ff"), experts=f("num_experts"), top_k=1,
                 router="softmax_raw", expert="mlp_relu", capacity="dropless")
    elif family == "gpt_oss":
        alpha, limit = float(f("swiglu_alpha")), float(f("swiglu_limit"))
        _require(family, abs(alpha - _GPT_OSS_ALPHA) < 1e-6, "swiglu_alpha", alpha,
                 f"epmoe's gpt_oss expert computes alpha = {_GPT_OSS_ALPHA}")
        _require(family, limit == _GPT_OSS_LIMIT, "swiglu_limit", limit,
                 f"epmoe's gpt_oss expert clamps at {_GPT_OSS_LIMIT}")
        o = dict(hidden=f("hidden_size"), ffn=f("intermediate_size"),
                 experts=f("num_local_experts"), top_k=f("num_experts_per_tok"),
                 router="gpt_oss", expert="gpt_oss")
    elif family == "nllb_moe":
        _act(family, "activation_function", f("activation_function"), "relu")
        _require(family, not f("router_bias", False, required=False), "router_bias", True,
                 "epmoe's gate has no bias")
        policy = f("second_expert_policy", "all", required=False)
        _require(family, policy == "all", "second_expert_policy", policy,
                 "epmoe sends every token to its top-2 experts ('all'); 'random' and "
                 "'sampling' draw the second expert at random")
        enc, dec = f("encoder_ffn_dim"), f("decoder_ffn_dim")
        if enc != dec and "ffn" not in overrides:
            raise ValueError(_err(family, f"encoder_ffn_dim = {enc} and decoder_ffn_dim = {dec} "
                                          "differ: pass ffn= (the block's fc1 rows)"))
        o = dict(hidden=f("d_model"), ffn=enc, experts=f("num_experts"), top_k=2,
                 router="softmax", expert="mlp_relu_bias", capacity="dropless")
    o.update(overrides)
    return o


def _output_scale(family: str, hf_config) -> float:
    """NLLB-MoE multiplies its experts' outputs by 1 - moe_token_dropout in eval mode: the
    factor is folded into w2 and b2 (1.0 for the other families)."""
    if family != "nllb_moe":
        return 1.0
    p = float(_field(family, _config(family, hf_config), "moe_token_dropout", 0.0, required=False))
    _require(family, 0.0 <= p < 1.0, "moe_token_dropout", p, "must be in [0, 1)")
    return 1.0 - p


# --- tensors ------------------------------------------------------------------------------

def _prefix(prefix: str) -> str:
    """State-dict keys are dot-separated: "model.layers.0.mlp" reads "model.layers.0.mlp.*"."""
    return prefix + "." if prefix and not prefix.endswith(".") else prefix


def _nllb_ffn(family: str, kw: dict, state_dict, prefix: str) -> dict:
    """NLLB-MoE's encoder and decoder blocks may differ in width: take the block's from its
    first expert's fc1 rows unless ffn is given."""
    key = prefix + "experts.expert_0.fc1.weight"
    if family == "nllb_moe" and "ffn" not in kw and key in state_dict:
        return dict(kw, ffn=int(state_dict[key].shape[0]))
    return kw


def _shared_prefix(prefix: str) -> str:
    """GraniteMoE-shared's shared MLP: the block's sibling `shared_mlp` in the decoder layer."""
    head = prefix[:-1].rpartition(".")[0] if prefix.endswith(".") else ""
    return (head + "." if head else "") + "shared_mlp."


class _Reader:
    """Reads state-dict tensors, raising KeyError / ValueError that name the full key."""

    def __init__(self, family: str, state_dict, prefix: str):
        self.family, self.sd, self.prefix = family, state_dict, prefix

    def __call__(self, name: str, shape, prefix: Optional[str] = None) -> torch.Tensor:
        key = (self.prefix if prefix is None else prefix) + name
        if key not in self.sd:
            raise KeyError(_err(self.family, f"state_dict has no {key!r}"))
        t = self.sd[key]
        if not isinstance(t, torch.Tensor):
            raise ValueError(_err(self.family, f"state_dict[{key!r}] is a {type(t).__name__}, "
                                               "not a tensor"))
        if tuple(t.shape) != tuple(shape):
            raise ValueError(_err(self.family, f"state_dict[{key!r}] has shape {tuple(t.shape)}: "
                                               f"expected {tuple(shape)}"))
        return t.detach()

    def stack(self, fmt: str, E: int, shape) -> torch.Tensor:
        return torch.stack([self(fmt.format(e), shape) for e in range(E)])


# transformers 5 keeps each block's experts fused: gate_up_proj [E, 2F, H] (gate rows, then up
# rows) and down_proj [E, H, F] under experts.; the router's weight [E, H] under these keys.
_FUSED_ROUTER = {"mixtral": "gate.weight", "qwen2_moe": "gate.weight", "qwen3_moe": "gate.weight",
                 "olmoe": "gate.weight", "jamba": "router.weight", "granitemoe": "router.weight",
                 "granitemoeshared": "router.weight", "phimoe": "router.weight"}
# Qwen2-MoE's shared expert: an MLP and a sigmoid gate (Linear H -> 1).
_QWEN_SHARED = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                "shared_expert.down_proj.weight", "shared_expert_gate.weight")


def logical_tensors(family: str, state_dict: Mapping[str, torch.Tensor], hf_config,
                    prefix: str = "", *, opts: Optional[dict] = None) -> dict:
    """load_logical()'s tensors (gate [E + Z, H]; w1, w3 [E, F, H]; w2 [E, H, F]; b1, b3 [E, 1, F];
    b2 [E, 1, H]; shared_* [1, ...]; shared_gate [1, H]; output_bias [H]; gate_bias [E]) from a block's
    state dict, its keys under `prefix`. opts: the MoE options (default options(family,
    hf_config)). A missing key raises KeyError and a wrong shape ValueError, each naming the
    full key. GraniteMoE-shared's shared MLP is read under the block's sibling `shared_mlp.`."""
    _check_family(family)
    prefix = _prefix(prefix)
    o = opts if opts is not None else options(family, hf_config,
                                              **_nllb_ffn(family, {}, state_dict, prefix))
    H, F, E = o["hidden"], o["ffn"], o["experts"]
    N, Fs = o.get("shared_experts", 0), o.get("shared_ffn", 0) or F
    get = _Reader(family, state_dict, prefix)
    t: dict = {}
    if family in hf_fused.SPECS:
        t = hf_fused.logical_tensors(family, get, o, _shared_prefix(prefix))
    elif family in hf_mechanisms.NAMES:
        t = hf_mechanisms.logical_tensors(family, get, o)
    elif family in _FUSED_ROUTER:
        fused = get("experts.gate_up_proj", (E, 2 * F, H))
        t = dict(gate=get(_FUSED_ROUTER[family], (E, H)), w1=fused[:, :F], w3=fused[:, F:],
                 w2=get("experts.down_proj", (E, H, F)))
        if family == "qwen2_moe":
            sw1, sw3, sw2, sg = _QWEN_SHARED
            t.update(shared_w1=get(sw1, (Fs, H))[None], shared_w3=get(sw3, (Fs, H))[None],
                     shared_w2=get(sw2, (H, Fs))[None], shared_gate=get(sg, (1, H)))
        if N and family == "granitemoeshared":
            sp = _shared_prefix(prefix)
            shared = get("input_linear.weight", (2 * Fs, H), prefix=sp)
            t.update(shared_w1=shared[None, :Fs], shared_w3=shared[None, Fs:],
                     shared_w2=get("output_linear.weight", (H, Fs), prefix=sp)[None])
    elif family == "dbrx":
        # w1, v1 [E*F, H] (rows per expert); w2 [E*F, H] is each expert's W2 transposed.
        t = dict(gate=get("router.layer.weight", (E, H)),
                 w1=get("experts.mlp.w1", (E * F, H)).view(E, F, H),
                 w3=get("experts.mlp.v1", (E * F, H)).view(E, F, H),
                 w2=get("experts.mlp.w2", (E * F, H)).view(E, F, H).transpose(1, 2))
    elif family == "jetmoe":  # not fused by transformers 5: its own parallel experts
        fused = get("input_linear.weight", (E, 2 * F, H))  # gate rows first, then up
        t = dict(gate=get("router.layer.weight", (E, H)), w1=fused[:, :F], w3=fused[:, F:],
                 w2=get("output_linear.weight", (E, H, F)), output_bias=get("bias", (H,)))
    elif family == "aria":  # transposed ([in, out]): gate columns, then up
        fused = get("experts.gate_up_proj", (E, H, 2 * F))
        t = dict(gate=get("router.weight", (E, H)), w1=fused[:, :, :F].transpose(1, 2),
                 w3=fused[:, :, F:].transpose(1, 2),
                 w2=get("experts.down_proj", (E, F, H)).transpose(1, 2))
        if N:
            t.update(shared_w1=get("shared_experts.gate_proj.weight", (Fs, H))[None],
                     shared_w3=get("shared_experts.up_proj.weight", (Fs, H))[None],
                     shared_w2=get("shared_experts.down_proj.weight", (H, Fs))[None])
    elif family == "gpt_oss":  # [in, out], gate and up interleaved column by column
        gate_up = get("experts.gate_up_proj", (E, H, 2 * F))
        bias = get("experts.gate_up_proj_bias", (E, 2 * F))
        t = dict(gate=get("router.weight", (E, H)), gate_bias=get("router.bias", (E,)),
                 w1=gate_up[..., 0::2].transpose(1, 2), w3=gate_up[..., 1::2].transpose(1, 2),
                 w2=get("experts.down_proj", (E, F, H)).transpose(1, 2),
                 b1=bias[:, None, 0::2], b3=bias[:, None, 1::2],
                 b2=get("experts.down_proj_bias", (E, H))[:, None])
    elif family == "switch_transformers":
        t = dict(gate=get("router.classifier.weight", (E, H)),
                 w1=get.stack("experts.expert_{}.wi.weight", E, (F, H)),
                 w2=get.stack("experts.expert_{}.wo.weight", E, (H, F)))
    elif family == "nllb_moe":
        s = _output_scale(family, hf_config)
        t = dict(gate=get("router.classifier.weight", (E, H)),
                 w1=get.stack("experts.expert_{}.fc1.weight", E, (F, H)),
                 b1=get.stack("experts.expert_{}.fc1.bias", E, (F,))[:, None],
                 w2=get.stack("experts.expert_{}.fc2.weight", E, (H, F)) * s,
                 b2=get.stack("experts.expert_{}.fc2.bias", E, (H,))[:, None] * s)
    return {k: v.contiguous() for k, v in t.items()}


def hf_state_dict(family: str, tensors: Mapping[str, torch.Tensor], hf_config, prefix: str = "",
                  *, gradients: bool = False, opts: Optional[dict] = None) -> dict:
    """The inverse of logical_tensors: Hugging Face keys (under `prefix`) and layouts of
    logical tensors. gradients=True maps gradients (NLLB-MoE's folded output scale then
    multiplies instead of dividing)."""
    _check_family(family)
    prefix = _prefix(prefix)
    if opts is None:
        width = {"ffn": int(tensors["w1"].shape[1])} if family == "nllb_moe" else {}
        opts = options(family, hf_config, **width)
    H, F, E = opts["hidden"], opts["ffn"], opts["experts"]
    N = opts.get("shared_experts", 0)
    t = {k: v.detach() for k, v in tensors.items()}
    out: dict = {}
    extra: dict = {}  # keys outside the block (already full)

    def per_expert(fmt, x):
        out.update({fmt.format(e): x[e] for e in range(E)})

    if family in hf_fused.SPECS:
        out, extra = hf_fused.hf_state_dict(family, t, opts, _shared_prefix(prefix),
                                            gradients)
    elif family in hf_mechanisms.NAMES:
        out = hf_mechanisms.hf_state_dict(family, t, opts, gradients)
    elif family in _FUSED_ROUTER:
        out = {_FUSED_ROUTER[family]: t["gate"],
               "experts.gate_up_proj": torch.cat([t["w1"], t["w3"]], 1),
               "experts.down_proj": t["w2"]}
        if family == "qwen2_moe":
            out.update(zip(_QWEN_SHARED, (t["shared_w1"][0], t["shared_w3"][0],
                                          t["shared_w2"][0], t["shared_gate"])))
        if N and family == "granitemoeshared":  # full keys: the shared MLP is the block's sibling
            sp = _shared_prefix(prefix)
            extra = {sp + "input_linear.weight": torch.cat([t["shared_w1"][0], t["shared_w3"][0]]),
                     sp + "output_linear.weight": t["shared_w2"][0]}
    elif family == "dbrx":
        out = {"router.layer.weight": t["gate"], "experts.mlp.w1": t["w1"].reshape(E * F, H),
               "experts.mlp.v1": t["w3"].reshape(E * F, H),
               "experts.mlp.w2": t["w2"].transpose(1, 2).reshape(E * F, H)}
    elif family == "jetmoe":
        out = {"router.layer.weight": t["gate"],
               "input_linear.weight": torch.cat([t["w1"], t["w3"]], 1),
               "output_linear.weight": t["w2"], "bias": t["output_bias"]}
    elif family == "aria":
        out = {"router.weight": t["gate"],
               "experts.gate_up_proj": torch.cat([t["w1"], t["w3"]], 1).transpose(1, 2),
               "experts.down_proj": t["w2"].transpose(1, 2)}
        if N:
            out.update({"shared_experts.gate_proj.weight": t["shared_w1"][0],
                        "shared_experts.up_proj.weight": t["shared_w3"][0],
                        "shared_experts.down_proj.weight": t["shared_w2"][0]})
    elif family == "gpt_oss":  # interleave gate and up back: column 2f gate f, 2f + 1 up f
        out = {"router.weight": t["gate"], "router.bias": t["gate_bias"],
               "experts.gate_up_proj": torch.stack(
                   [t["w1"].transpose(1, 2), t["w3"].transpose(1, 2)], -1).reshape(E, H, 2 * F),
               "experts.gate_up_proj_bias": torch.stack(
                   [t["b1"][:, 0], t["b3"][:, 0]], -1).reshape(E, 2 * F),
               "experts.down_proj": t["w2"].transpose(1, 2),
               "experts.down_proj_bias": t["b2"][:, 0]}
    elif family == "switch_transformers":
        out["router.classifier.weight"] = t["gate"]
        per_expert("experts.expert_{}.wi.weight", t["w1"])
        per_expert("experts.expert_{}.wo.weight", t["w2"])
    elif family == "nllb_moe":
        s = _output_scale(family, hf_config)
        s = s if gradients else 1.0 / s
        out["router.classifier.weight"] = t["gate"]
        per_expert("experts.expert_{}.fc1.weight", t["w1"])
        per_expert("experts.expert_{}.fc1.bias", t["b1"][:, 0])
        per_expert("experts.expert_{}.fc2.weight", t["w2"] * s)
        per_expert("experts.expert_{}.fc2.bias", t["b2"][:, 0] * s)
    out = {prefix + k: v for k, v in out.items()}
    out.update(extra)
    return {k: v.contiguous() for k, v in out.items()}


def module_tensors(moe, *, grad: bool = False) -> dict:
    """A module's parameters (or, grad=True, their .grad) as logical-order tensors, experts
    dimension = every expert: the module must hold all of them (one process, or thread
    ranks). A parameter without a gradient raises ValueError naming it."""
    if len(moe.expert_ids) != moe.experts:
        raise ValueError(f"epmoe.hf: this module holds {len(moe.expert_ids)} of {moe.experts} "
                         "experts (a process group): read its slots with expert_ids instead")
    order = torch.argsort(moe.expert_ids)  # slot of each logical expert
    from .torch import EXPERT_TENSORS

    out = {}
    for name, p in moe.named_parameters(recurse=False):
        v = p.grad if grad else p.detach()
        if v is None:
            raise ValueError(f"epmoe.hf: parameter {name!r} has no gradient (run backward first)")
        out[name] = v[order] if name in EXPERT_TENSORS[moe.expert_kind] else v
    return out


# --- blocks -------------------------------------------------------------------------------

def _act_name(fn) -> str:
    """transformers' ACT2FN module -> its config name ("silu", "relu", else the class name)."""
    if fn is torch.nn.functional.silu:  # LFM2-MoE's experts call the function
        return "silu"
    name = type(fn).__name__
    return {"SiLU": "silu", "SiLUActivation": "silu", "ReLU": "relu"}.get(name, name)


def _fused_shape(b):
    """(experts, ffn, hidden) of transformers 5 fused experts (gate_up_proj [E, 2F, H])."""
    E, F2, H = b.experts.gate_up_proj.shape
    return E, F2 // 2, H


def _block_config(family: str, b, shared_mlp=None):
    """The config fields options() reads, from a block's attributes and weights."""
    if family in hf_fused.SPECS:
        return hf_fused.block_config(family, b, shared_mlp, _act_name, _err)
    if family in hf_mechanisms.NAMES:
        return hf_mechanisms.block_config(family, b, _act_name)
    if family == "aria":  # the shared MLP keeps the text config
        return b.shared_experts.config
    if family in ("mixtral", "phimoe", "granitemoe", "granitemoeshared"):
        router = b.gate if family == "mixtral" else b.router
        E, F, H = _fused_shape(b)
        c = dict(hidden_size=H, intermediate_size=F, num_local_experts=E,
                 num_experts_per_tok=router.top_k, hidden_act=_act_name(b.experts.act_fn))
        if family == "phimoe":
            c["router_jitter_noise"] = router.router_jitter_noise
        if family == "granitemoeshared":
            c["shared_intermediate_size"] = shared_mlp.hidden_size if shared_mlp is not None else 0
            if shared_mlp is not None and _act_name(shared_mlp.activation) != c["hidden_act"]:
                raise ValueError(_err(family, f"shared_mlp's activation "
                                              f"{_act_name(shared_mlp.activation)!r} differs from "
                                              f"the block's {c['hidden_act']!r}"))
        return c
    if family in ("qwen2_moe", "qwen3_moe", "olmoe", "jamba"):
        router = b.router if family == "jamba" else b.gate
        E, F, H = _fused_shape(b)
        c = dict(hidden_size=H, num_experts=E, num_experts_per_tok=router.top_k,
                 hidden_act=_act_name(b.experts.act_fn),
                 norm_topk_prob=getattr(router, "norm_topk_prob", False))
        c["moe_intermediate_size" if family.startswith("qwen") else "intermediate_size"] = F
        if family == "qwen2_moe":
            c["shared_expert_intermediate_size"] = b.shared_expert.gate_proj.weight.shape[0]
            if _act_name(b.shared_expert.act_fn) != c["hidden_act"]:
                raise ValueError(_err(family, "the shared expert's activation differs from the "
                                              "experts'"))
        return c
    if family == "dbrx":
        m = b.experts.mlp
        return dict(d_model=m.hidden_size, ffn_config=dict(
            ffn_hidden_size=m.ffn_hidden_size, moe_num_experts=m.moe_num_experts,
            moe_top_k=b.top_k, moe_normalize_expert_weights=b.moe_normalize_expert_weights,
            ffn_act_fn={"name": _act_name(m.activation_fn)}))
    if family == "jetmoe":
        return dict(hidden_size=b.input_size, intermediate_size=b.hidden_size,
                    num_local_experts=b.router.num_experts, num_experts_per_tok=b.router.top_k,
                    activation_function=_act_name(b.activation))
    if family == "gpt_oss":
        x = b.experts
        E, H, F2 = x.gate_up_proj.shape
        return dict(hidden_size=H, intermediate_size=F2 // 2, num_local_experts=E,
                    num_experts_per_tok=b.router.top_k, swiglu_alpha=x.alpha,
                    swiglu_limit=x.limit)
    if family == "switch_transformers":
        r, x = b.router, b.experts["expert_0"]
        return dict(d_model=x.wi.weight.shape[1], d_ff=x.wi.weight.shape[0],
                    num_experts=r.num_experts, router_bias=r.classifier.bias is not None,
                    dense_act_fn=_act_name(x.act))
    if family == "nllb_moe":
        r, x = b.router, b.experts["expert_0"]
        F = x.fc1.weight.shape[0]
        return dict(d_model=x.fc1.weight.shape[1], encoder_ffn_dim=F, decoder_ffn_dim=F,
                    num_experts=r.num_experts, router_bias=r.classifier.bias is not None,
                    second_expert_policy=r.second_expert_policy,
                    activation_function=_act_name(x.act),
                    moe_token_dropout=b.experts.moe_token_dropout)
    raise AssertionError(family)


def from_hf(block, *, shared_mlp=None, **kw):
    """An epmoe.torch.MoE equal to a transformers MoE block (docs/pytorch.md), with its
    weights. kw: MoE arguments (group or ranks, schedule, capacity, placement, ...) added to
    or replacing those the block implies. shared_mlp: GraniteMoE-shared's decoder-layer
    `shared_mlp`, whose output the layer adds to the block's (the module then computes both)."""
    family = family_of(block)
    if shared_mlp is not None and family not in ("granitemoeshared", "granitemoehybrid"):
        raise ValueError(_err(family, "shared_mlp is GraniteMoE-shared's (a decoder layer's "
                                      "shared_mlp); this block has its shared experts inside"))
    sd = dict(block.state_dict())
    if shared_mlp is not None:
        sd.update({"shared_mlp." + k: v for k, v in shared_mlp.state_dict().items()})
    return from_hf_state_dict(sd, _block_config(family, block, shared_mlp), family, **kw)


def from_hf_state_dict(state_dict: Mapping[str, torch.Tensor], hf_config, family: str,
                       prefix: str = "", *, values: bool = True, **kw):
    """An epmoe.torch.MoE for the `family` block whose weights are state_dict's keys under
    `prefix` (e.g. "model.layers.3.block_sparse_moe."), hf_config the model's config. kw as
    from_hf. Every tensor is checked (KeyError / ValueError naming the key) before the
    module is built. Quantised experts (GPT-OSS's experts.*_blocks / *_scales; FP8 experts
    with *_scale_inv, DeepSeek-V3's) are packed as they are, pack_weights "mxfp4" / "fp8"
    unless kw gives another (which then packs their dequantised values). values=False: codes
    only (MoE.load_quantised): the module keeps no float32 copy of the quantised experts."""
    from .torch import MoE

    _check_family(family)
    prefix = _prefix(prefix)
    if family == "deepseek_v4" and prefix + "gate.tid2eid" in state_dict and "router" not in kw:
        kw = dict(kw, router="sqrtsoftplus_table")  # a hash_moe layer (mlp_layer_types)
    o = options(family, hf_config, **_nllb_ffn(family, kw, state_dict, prefix))
    # A quantised checkpoint (GPT-OSS's MXFP4 blocks, FP8 with block scales): the parameters
    # take the values, the packed copies the codes as they are (MoE.load_quantised).
    quantised = checkpoint_tensors(family, state_dict, prefix, o, values)
    if quantised is None and not values:
        raise ValueError(f"epmoe: from_hf_state_dict(values=False): the {family} state dict "
                         f"under {prefix!r} holds no quantised experts (codes only needs them)")
    if quantised is not None:
        state_dict = quantised[1]
        o.setdefault("pack_weights", quantised[0])
    tensors = logical_tensors(family, state_dict, hf_config, prefix, opts=o)
    if "router_bias" in tensors and "router_bias" not in kw:  # DeepSeek-V3's selection bias
        o["router_bias"] = tensors["router_bias"].tolist()
    if "router_table" in tensors and "router_table" not in kw:  # DeepSeek-V4's tid2eid
        o["router_table"] = tensors["router_table"]
    moe = MoE(**o, values=values)  # (values=False: the routed weights never materialised)
    source = f"{family} state_dict" + (f" {prefix!r}" if prefix else "")
    moe.load_logical(tensors, source=source)
    if quantised is not None and (not values or o["pack_weights"] == quantised[0]):
        fmt = quantised[0]
        moe.load_quantised({n: Quantised(fmt, c, s) for n, (c, s) in quantised[2].items()},
                           source=source, values=values)
    return moe


# Whole models: transformers' experts registry runs epmoe (epmoe/hf_models.py).
from .hf_models import expert_bytes, expert_parallel, local_experts, use_epmoe  # noqa: E402
