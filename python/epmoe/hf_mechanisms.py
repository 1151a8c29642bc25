# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""transformers 5 families whose block needs a layer mechanism beyond the weighted sum of its
routed experts: LongCat-Flash (`LongcatFlashMoE`: zero-computation experts, config
zero_experts) and Llama 4 (`Llama4TextMoe`: the router's score scales the experts' input, the
menu's router "llama4"). The functions here are epmoe.hf's per-family parts (as hf_fused's);
use hf.
"""
from __future__ import annotations

import torch

FAMILIES = {"LongcatFlashMoE": "longcat_flash", "Llama4TextMoe": "llama4"}
NAMES = set(FAMILIES.values())


def options(family: str, f, require, act) -> dict:
    """MoE arguments from the config reader f (hf._field over the family's config)."""
    if family == "longcat_flash":
        # The router scores E routed + Z zero experts: softmax over all E + Z logits, the top
        # K of the scores + e_score_correction_bias (selection only: router_bias), weights the
        # chosen scores times routed_scaling_factor, not renormalised. A zero expert is
        # nn.Identity.
        act(family, "hidden_act", f("hidden_act"), "silu")
        E, Z = f("n_routed_experts"), f("zero_expert_num", 0, required=False) or 0
        require(family, E >= 1, "n_routed_experts", E, "must be >= 1 (epmoe routes to experts)")
        return dict(hidden=f("hidden_size"), ffn=f("expert_ffn_hidden_size"), experts=E,
                    zero_experts=Z, top_k=f("moe_topk"), router="longcat_flash",
                    scaling=float(f("routed_scaling_factor")), expert="swiglu")
    if family == "llama4":
        # Top-K of the logits, s = σ(logit), routed_in = x * s (E(s x), not s E(x)); one shared
        # expert of the experts' width.
        act(family, "hidden_act", f("hidden_act"), "silu")
        F = f("intermediate_size")
        return dict(hidden=f("hidden_size"), ffn=F, experts=f("num_local_experts"),
                    top_k=f("num_experts_per_tok"), router="llama4", expert="swiglu",
                    shared_experts=1, shared_ffn=F)
    raise AssertionError(family)


def logical_tensors(family: str, get, o: dict) -> dict:
    """load_logical()'s tensors from the block's state dict (get: hf._Reader)."""
    H, F, E = o["hidden"], o["ffn"], o["experts"]
    if family == "longcat_flash":
        Z = o.get("zero_experts", 0)
        # gate_up_proj has E + Z rows; the zero experts' are never read (nn.Identity).
        fused = get("experts.gate_up_proj", (E + Z, 2 * F, H))[:E]
        return dict(gate=get("router.classifier.weight", (E + Z, H)), w1=fused[:, :F],
                    w3=fused[:, F:], w2=get("experts.down_proj", (E, H, F)),
                    router_bias=get("router.e_score_correction_bias", (E + Z,)))
    if family == "llama4":  # [in, out]: gate columns, then up; down_proj [E, F, H]
        gate_up = get("experts.gate_up_proj", (E, H, 2 * F))
        return dict(gate=get("router.weight", (E, H)), w1=gate_up[..., :F].transpose(1, 2),
                    w3=gate_up[..., F:].transpose(1, 2),
                    w2=get("experts.down_proj", (E, F, H)).transpose(1, 2),
                    shared_w1=get("shared_expert.gate_proj.weight", (F, H))[None],
                    shared_w3=get("shared_expert.up_proj.weight", (F, H))[None],
                    shared_w2=get("shared_expert.down_proj.weight", (H, F))[None])
    raise AssertionError(family)


def hf_state_dict(family: str, t: dict, o: dict, gradients: bool) -> dict:
    """The block's keys (without prefix) of logical tensors (or their gradients)."""
    if family == "longcat_flash":
        Z = o.get("zero_experts", 0)
        gate_up = torch.cat([t["w1"], t["w3"]], 1)
        # The zero experts' unread rows: zeros (their gradient is zero too).
        gate_up = torch.cat([gate_up, gate_up.new_zeros((Z,) + tuple(gate_up.shape[1:]))])
        out = {"router.classifier.weight": t["gate"], "experts.gate_up_proj": gate_up,
               "experts.down_proj": t["w2"]}
        if "router_bias" in t:  # a buffer (no gradient): the module's router bias
            out["router.e_score_correction_bias"] = t["router_bias"]
        return out
    if family == "llama4":
        return {"router.weight": t["gate"],
                "experts.gate_up_proj": torch.cat([t["w1"], t["w3"]], 1).transpose(1, 2),
                "experts.down_proj": t["w2"].transpose(1, 2),
                "shared_expert.gate_proj.weight": t["shared_w1"][0],
                "shared_expert.up_proj.weight": t["shared_w3"][0],
                "shared_expert.down_proj.weight": t["shared_w2"][0]}
    raise AssertionError(family)


def block_config(family: str, b, act_name) -> dict:
    """The config fields options() reads, from a block's attributes and weights."""
    if family == "longcat_flash":
        x, r = b.experts, b.router
        return dict(hidden_size=x.hidden_size, expert_ffn_hidden_size=x.intermediate_size,
                    n_routed_experts=x.num_routed_experts, zero_expert_num=x.zero_expert_num,
                    moe_topk=r.top_k, routed_scaling_factor=r.routed_scaling_factor,
                    hidden_act=act_name(x.act_fn))
    if family == "llama4":
        x, sh = b.experts, b.shared_expert
        E, H, F2 = x.gate_up_proj.shape
        if act_name(sh.activation_fn) != act_name(x.act_fn):
            raise ValueError(f"epmoe.hf: {family}: the shared expert's activation differs from "
                             "the experts'")
        return dict(hidden_size=H, intermediate_size=F2 // 2, num_local_experts=E,
                    num_experts_per_tok=b.router.top_k, hidden_act=act_name(x.act_fn))
    raise AssertionError(family)
