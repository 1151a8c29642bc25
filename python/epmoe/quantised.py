# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Checkpoints' quantised expert tensors, loaded as they are (docs/quantisation.md): FP8
e4m3fn weights with 128 x 128 block scales (DeepSeek-V3's `weight_scale_inv`, transformers'
FP8Experts `gate_up_proj` + `gate_up_proj_scale_inv`) and MXFP4 blocks with E8M0 scales
(GPT-OSS's `*_blocks`, `*_scales`). MoE.load_quantised packs the layer's copies from the codes
themselves (no re-quantisation) and sets the parameters to their dequantised values; epmoe.hf's
from_hf_state_dict finds such tensors in a state dict.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from . import _epmoe, hf_fused
from ._ranks import EXPERT_TENSORS

FORMATS = ("fp8", "mxfp4")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def codes_of(t: torch.Tensor) -> torch.Tensor:
    """An fp8 or mxfp4 code tensor as uint8 (float8_e4m3fn, int8 and uint8 reinterpreted)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.int8) else t


def dequantise(fmt: str, codes: torch.Tensor, scales: torch.Tensor, cols: int) -> torch.Tensor:
    """The values [..., rows, cols] float32 of fp8 codes [..., rows, cols] with scale_inv
    [..., ceil(rows / 128), ceil(cols / 128)] (value * scale, one fp32 rounding), or of mxfp4
    blocks [..., rows, ceil(cols / 32) * 16] with E8M0 scales [..., rows, ceil(cols / 32)]
    (value * 2^(e - 127), exact): what the packed copies compute with."""
    codes = codes_of(codes)
    if fmt == "fp8":
        v = codes.view(torch.float8_e4m3fn).float()
        rows = v.shape[-2]
        s = scales.float().repeat_interleave(128, -2)[..., :rows, :]
        return v * s.repeat_interleave(128, -1)[..., :cols]
    lut = torch.tensor(E2M1)
    *lead, rows, width = codes.shape
    v = torch.stack([lut[(codes & 15).long()], lut[(codes >> 4).long()]], -1)
    v = v.reshape(*lead, rows, -1, 32)
    e = scales.to(torch.int32) - 127
    return torch.ldexp(v, e[..., None].float()).reshape(*lead, rows, -1)[..., :cols].contiguous()


def _check(fmt: str, name: str, codes: torch.Tensor, scales: torch.Tensor, lead: int,
           rows: int, cols: int, source: str):
    want_c = (lead, rows, cols if fmt == "fp8" else (cols + 31) // 32 * 16)
    want_s = ((lead, (rows + 127) // 128, (cols + 127) // 128) if fmt == "fp8"
              else (lead, rows, (cols + 31) // 32))
    kinds = (torch.float8_e4m3fn, torch.uint8) if fmt == "fp8" else (torch.uint8, torch.int8)
    if codes.dtype not in kinds or tuple(codes.shape) != want_c:
        raise ValueError(f"epmoe: {source}[{name!r}] codes are {codes.dtype} "
                         f"{tuple(codes.shape)}: {fmt} wants {kinds[0]} {want_c}")
    s_kind = torch.float32 if fmt == "fp8" else torch.uint8
    if scales.dtype != s_kind or tuple(scales.shape) != want_s:
        raise ValueError(f"epmoe: {source}[{name!r}] scales are {scales.dtype} "
                         f"{tuple(scales.shape)}: {fmt} wants {s_kind} {want_s}")


@torch.no_grad()
def load_quantised(moe, fmt: str, tensors: Mapping[str, tuple], source: str = "tensors"):
    """MoE.load_quantised: tensors maps w1, w3, w2 (logical order, every expert: [E, rows,
    ...]) and shared_w1 ... ([N, ...]) to (codes, scales); the others keep their values."""
    if fmt not in FORMATS:
        raise ValueError(f"epmoe: load_quantised format = {fmt!r}: must be one of {FORMATS}")
    kinds = EXPERT_TENSORS[moe.expert_kind]
    names = [n for n in kinds] + ["shared_" + n for n in kinds if moe.shared_experts]
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise KeyError(f"epmoe: {source}: no quantised parameter {unknown[0]!r} (this MoE's "
                       f"expert tensors: {', '.join(names)})")
    plan = {}
    for name, (codes, scales) in tensors.items():
        p = getattr(moe, name)
        routed = not name.startswith("shared_")
        lead = moe.experts if routed else moe.shared_experts
        _check(fmt, name, codes, scales, lead, p.shape[1], p.shape[2], source)
        codes = codes_of(codes)
        if routed:  # this module's slots, in slot order
            codes, scales = codes[moe.expert_ids], scales[moe.expert_ids]
        plan[name] = (codes.contiguous(), scales.contiguous(), p.shape[2])
    L = moe.experts // moe.ranks
    per_rank = []
    for r in range(moe._layer_ranks()):
        row = []
        for name in names:
            if name not in plan:
                row.append(None)
                continue
            c, s, k = plan[name]
            if not name.startswith("shared_"):
                c, s = c[r * L:(r + 1) * L].contiguous(), s[r * L:(r + 1) * L].contiguous()
            row.append((c, s, int(k)))
        per_rank.append(row)
    moe._layer.load_quantised(fmt, per_rank)  # checks every code and scale first
    for name, (c, s, k) in plan.items():
        getattr(moe, name).copy_(dequantise(fmt, c, s, k))
    moe._pack = fmt
    moe._packed_versions = moe._versions()


def packed_values(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float32 as the layer's fp8 / mxfp4 / int8 copies quantise it (pack_weights),
    dequantised (float32 [N, K])."""
    return _epmoe.packed_values(fmt, w.detach().float().contiguous())


def _fp8_halves(scale: torch.Tensor, F: int, key: str):
    """transformers' fused gate_up_proj_scale_inv [E, S, ...] split into the gate's and the
    up's: S = 2 ceil(F / 128) (each projection's own blocks, as checkpoints store them)."""
    s = scale.shape[1]
    if s != 2 * ((F + 127) // 128):
        raise ValueError(f"epmoe: {key} has {s} row blocks: the gate's and up's halves need "
                         f"2 * ceil({F} / 128) = {2 * ((F + 127) // 128)}")
    return scale[:, :s // 2], scale[:, s // 2:]


def checkpoint_tensors(family: str, state_dict: Mapping[str, torch.Tensor], prefix: str,
                       opts: dict) -> Optional[tuple]:
    """A block's quantised expert tensors in a state dict, or None: (format, the state dict
    with them dequantised under transformers' unquantised names, load_quantised's tensors).
    GPT-OSS: experts.gate_up_proj_blocks [E, 2F, H / 32, 16] and _scales [E, 2F, H / 32]
    (gate and up rows interleaved), down_proj_blocks / _scales; FP8Experts (DeepSeek-V3 and
    its clones): experts.gate_up_proj [E, 2F, H] float8_e4m3fn and gate_up_proj_scale_inv,
    down_proj and down_proj_scale_inv, and the shared MLP's FP8 Linear weights."""
    H, F, E = opts["hidden"], opts["ffn"], opts["experts"]
    sd = dict(state_dict)
    key = prefix + "experts.gate_up_proj"
    if family == "gpt_oss" and key + "_blocks" in sd:
        gb, gs = codes_of(sd[key + "_blocks"]), sd[key + "_scales"]
        db, ds = (codes_of(sd[prefix + "experts.down_proj_blocks"]),
                  sd[prefix + "experts.down_proj_scales"])
        q = {"w1": (gb[:, 0::2].reshape(E, F, -1), gs[:, 0::2]),
             "w3": (gb[:, 1::2].reshape(E, F, -1), gs[:, 1::2]),
             "w2": (db.reshape(E, H, -1), ds)}
        sd[key] = dequantise("mxfp4", gb.reshape(E, 2 * F, -1), gs, H).transpose(1, 2)
        sd[prefix + "experts.down_proj"] = dequantise("mxfp4", db.reshape(E, H, -1), ds,
                                                      F).transpose(1, 2)
        return "mxfp4", sd, q
    if key + "_scale_inv" in sd:
        gu, gsi = codes_of(sd[key]), sd[key + "_scale_inv"]
        s1, s3 = _fp8_halves(gsi, F, key + "_scale_inv")
        down, dsi = codes_of(sd[prefix + "experts.down_proj"]), sd[prefix + "experts.down_proj_scale_inv"]
        q = {"w1": (gu[:, :F], s1), "w3": (gu[:, F:], s3), "w2": (down, dsi)}
        sd[key] = torch.cat([dequantise("fp8", gu[:, :F], s1, H),
                             dequantise("fp8", gu[:, F:], s3, H)], 1)
        sd[prefix + "experts.down_proj"] = dequantise("fp8", down, dsi, F)
        spec = hf_fused.SPECS.get(family)
        if (spec is None or spec.shared in (None, "sibling")
                or hf_fused._shared_scale(family, opts) != 1.0):
            return "fp8", sd, q  # (a shared expert stored otherwise: packed from its values)
        keys = hf_fused._shared_keys(spec, prefix)[:3]
        for name, k in zip(("shared_w1", "shared_w3", "shared_w2"), keys):
            if k + "_scale_inv" in sd:
                c, s = codes_of(sd[k]), sd[k + "_scale_inv"]
                q[name] = (c[None], s[None])
                sd[k] = dequantise("fp8", c, s, c.shape[1])
        return "fp8", sd, q
    return None
