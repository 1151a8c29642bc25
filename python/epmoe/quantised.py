# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Expert weights quantised already, as checkpoints store them (docs/quantisation.md,
"Loaders"), given to a layer with MoE.load_quantised({key: Quantised}) as they are (no
re-quantisation; the parameters take the dequantised values):
- epmoe's group-wise formats: GPTQ and AWQ int4 (-> int4_asym), GGUF Q4_K (-> int4_asym,
  group 32) and Q8_0 (-> int8_g32); each conversion keeps the checkpoint's values exactly (its
  dequantised weights equal the format's definition: tests/test_int4.py);
- fp8 (fp8_block): FP8 e4m3fn weights with 128 x 128 block scales (DeepSeek-V3's
  `weight_scale_inv`, transformers' FP8Experts `gate_up_proj` + `gate_up_proj_scale_inv`);
- mxfp4: MXFP4 blocks with E8M0 scales (GPT-OSS's `*_blocks`, `*_scales`); epmoe.hf's
  from_hf_state_dict finds fp8 and mxfp4 tensors in a state dict (checkpoint_tensors).

A `Quantised` matrix [N, K] (N outputs, K inputs, as an nn.Linear weight; or a stack of them
[E, N, K], one per expert) holds, by format:
- group-wise: q int8 [N, K], scales float32 [N, G] and, for int4_asym, offsets float32 [N, G],
  G = ceil(K / group); input k of row n is scales[n, k // group] * q[n, k] + offsets[n, k //
  group]; with an order (act order: GPTQ's desc_act) int64 [K], column k holds input order[k];
- "fp8": q float8_e4m3fn (or uint8) [N, K], scales float32 scale_inv [ceil(N / 128), ceil(K /
  128)]; w = fp8 * scale_inv of its 128 x 128 block;
- "mxfp4": q uint8 blocks [N, ceil(K / 32) * 16] (two E2M1 codes a byte, low nibble first),
  scales uint8 E8M0 [N, ceil(K / 32)]; w = e2m1 * 2^(scale - 127) per 32 inputs."""
from __future__ import annotations

import re
from typing import Mapping, NamedTuple, Optional

import numpy as np
import torch

from . import _epmoe, hf_fused
from ._ranks import EXPERT_TENSORS

__all__ = ["Quantised", "from_gptq", "from_awq", "from_gguf", "gguf_experts", "format_group",
           "dequantise", "packed_values", "FORMATS"]

_FORMAT = re.compile(r"^(int4|int4_asym|int8)(?:_g(\d+))?$")
FORMATS = ("fp8", "mxfp4")  # the minifloat formats (the others: format_group)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def format_group(fmt: str):
    """(kind, group) of a group-wise format name ("int4", "int4_g128", "int4_asym_g32",
    "int8_g32"; int4's group defaults to 32), or None for another name."""
    m = _FORMAT.match(fmt) if isinstance(fmt, str) else None
    if m is None or (m.group(1) == "int8" and m.group(2) is None):
        return None  # ("int8" is int8_channel)
    return m.group(1), int(m.group(2) or 32)


class Quantised(NamedTuple):
    """One expert matrix [N, K] (or a stack [E, N, K]) in a quantised format (module
    docstring): a group-wise one, "fp8" or "mxfp4"."""
    format: str
    q: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor] = None
    order: Optional[torch.Tensor] = None  # group-wise act order: column k is input order[k]

    def matrix(self, e: int) -> "Quantised":
        """Matrix e of a stack [E, N, K]."""
        offsets, order = (None if v is None else v[e] for v in (self.offsets, self.order))
        return Quantised(self.format, self.q[e], self.scales[e], offsets, order)

    @property
    def group(self) -> int:
        if self.format in FORMATS:
            return 128 if self.format == "fp8" else 32
        return format_group(self.format)[1]

    def dequantise(self, cols: Optional[int] = None) -> torch.Tensor:
        """The weights [..., N, K] in float32 (the values the packed copy holds): group-wise,
        scales q + offsets rounded once; fp8 and mxfp4: dequantise() (cols: K, which mxfp4's
        blocks round up to 32; by default all of them)."""
        if self.format in FORMATS:
            K = cols if cols is not None else (self.q.shape[-1] if self.format == "fp8"
                                               else self.q.shape[-1] * 2)
            return dequantise(self.format, self.q, self.scales, K)
        g = self.group
        s = self.scales.double().repeat_interleave(g, dim=-1)[..., :self.q.shape[-1]]
        w = s * self.q.double()
        if self.offsets is not None:
            w = w + self.offsets.double().repeat_interleave(g, dim=-1)[..., :self.q.shape[-1]]
        if self.order is not None:  # column k back to input order[k]
            w = torch.empty_like(w).scatter_(-1, self.order.unsqueeze(-2).expand(w.shape), w)
        return w.float()


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles (nibble i at bits 4i), spread along `dim` (x8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    w = packed.to(torch.int32).unsqueeze(-1) >> shifts  # [..., 8]
    w = (w & 15).to(torch.int8)
    if dim == 0:  # [R, C, 8] -> [R, 8, C] -> [8R, C]
        return w.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return w.reshape(packed.shape[0], -1)


def _asym(q_kn: torch.Tensor, zeros_gn: torch.Tensor, scales_gn: torch.Tensor, K: int, N: int):
    """int4_asym from q [K, N] in [0, 15], zero points [G, N] and scales [G, N]: w = s (q - z),
    offset = -s z (exact in float32: a float16 scale times an integer below 17)."""
    G = scales_gn.shape[0]
    if scales_gn.shape != (G, N) or zeros_gn.shape != (G, N) or K % G:
        raise ValueError(f"epmoe: scales {tuple(scales_gn.shape)} and zeros "
                         f"{tuple(zeros_gn.shape)} must be [G, N = {N}] with G dividing K = {K}")
    group = K // G
    if group % 32:
        raise ValueError(f"epmoe: group size {group} (K = {K} over {G} groups): epmoe packs "
                         "groups of a multiple of 32 inputs")
    s = scales_gn.float()
    return Quantised(f"int4_asym_g{group}", q_kn.t().contiguous(), s.t().contiguous(),
                     (-s * zeros_gn.float()).t().contiguous())


def from_gptq(qweight, qzeros, scales, g_idx=None, *, checkpoint_format: str = "gptq"):
    """A GPTQ int4 linear layer (AutoGPTQ / GPTQModel, transformers' GPTQ checkpoints):
    qweight int32 [K / 8, N] (input 8r + i of column n at bits 4i of qweight[r, n]), qzeros
    int32 [G, N / 8] (column 8c + i at bits 4i), scales float16 [G, N], g_idx [K] or None.
    checkpoint_format "gptq" (v1: the stored zero point is z - 1, so z = stored + 1, 1..16)
    or "gptq_v2" (z itself). w[n, k] = scales[g, n] (q[k, n] - z[g, n]), g = k // (K / G).
    Act-order checkpoints (desc_act: g_idx other than k // group, each group K / G inputs
    anywhere) give the inputs sorted by group in q and their order in `order`."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"epmoe: checkpoint_format = {checkpoint_format!r}: must be 'gptq' or "
                         "'gptq_v2'")
    q = _nibbles(qweight, 0)  # [K, N]
    K, N = q.shape
    z = _nibbles(qzeros, 1)[:, :N].to(torch.int32)  # [G, N]
    if checkpoint_format == "gptq":
        z = z + 1
    G = scales.shape[0]
    if g_idx is None:
        return _asym(q, z, scales, K, N)
    g = g_idx.to(torch.int64)
    if g.shape != (K,) or K % max(G, 1):
        raise ValueError(f"epmoe: g_idx has shape {tuple(g.shape)}: must be [K = {K}], K a "
                         f"multiple of the {G} groups")
    if torch.equal(g, torch.arange(K) // (K // G)):
        return _asym(q, z, scales, K, N)
    # Act order (desc_act): input k is in group g_idx[k]; the copy holds the inputs sorted by
    # group (column j: input order[j]), so that each group is a run of K / G columns.
    if g.min() < 0 or g.max() >= G or not bool((torch.bincount(g, minlength=G) == K // G).all()):
        raise ValueError(f"epmoe: g_idx puts other than K / G = {K // G} inputs in a group (or "
                         f"names a group outside [0, {G})): not a GPTQ act order")
    order = torch.argsort(g, stable=True)
    return _asym(q[order], z, scales, K, N)._replace(order=order)


_AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # column c of 8 at nibble _AWQ_REVERSE_ORDER[c]


def from_awq(qweight, qzeros, scales):
    """An AWQ int4 linear layer (AutoAWQ's GEMM layout, transformers' AWQ checkpoints):
    qweight int32 [K, N / 8] and qzeros int32 [G, N / 8], each word holding 8 columns in
    AWQ's interleaved order (nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]), scales
    float16 [G, N]; w[n, k] = scales[g, n] (q[k, n] - z[g, n])."""
    def columns(packed):
        n = _nibbles(packed, 1)  # [R, N] in nibble order within each 8
        R, C = n.shape
        order = torch.tensor(_AWQ_REVERSE_ORDER).repeat(C // 8) + torch.arange(C) // 8 * 8
        return n[:, order]

    q = columns(qweight)  # [K, N]
    K, N = q.shape
    return _asym(q, columns(qzeros).to(torch.int32), scales, K, N)


def from_gguf(data, qtype, shape) -> Quantised:
    """One matrix [N, K] of a GGUF tensor: data its raw blocks (uint8, N * K / block * bytes),
    qtype a gguf.GGMLQuantizationType: Q8_0 (blocks of 32: a float16 d, 32 int8; w = d q) ->
    int8_g32; Q4_K (super-blocks of 256: float16 d and dmin, 6-bit scales and mins of 8
    sub-blocks of 32, 128 bytes of nibbles; w = d sc q - dmin m) -> int4_asym_g32 with scale d
    sc and offset -dmin m (exact in float32)."""
    import gguf  # the PyPI package (scripts/install-deps pins it)

    N, K = shape
    raw = np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).reshape(-1)
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        blocks = raw.reshape(N * K // 32, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(N, K // 32)
        q = blocks[:, 2:].copy().view(np.int8).reshape(N, K)
        return Quantised("int8_g32", torch.from_numpy(q.copy()), torch.from_numpy(d.copy()))
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        blocks = raw.reshape(N * K // 256, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [B, 8] each
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(
            1, 1, 2, 1)  # chunk c: low nibbles sub-block 2c, high nibbles 2c + 1
        q = (qs & 15).astype(np.int8).reshape(N, K)
        scale = (d * sc.astype(np.float32)).reshape(N, K // 32)
        offset = -(dmin * m.astype(np.float32)).reshape(N, K // 32)
        return Quantised("int4_asym_g32", torch.from_numpy(q.copy()),
                         torch.from_numpy(scale.copy()), torch.from_numpy(offset.copy()))
    raise ValueError(f"epmoe: GGUF type {getattr(qtype, 'name', qtype)}: epmoe loads Q8_0 and "
                     "Q4_K (others: dequantise with gguf.quants.dequantize and pack)")


def gguf_experts(tensor) -> list:
    """A GGUF expert tensor (gguf.GGUFReader().tensors entry, llama.cpp's
    blk.<i>.ffn_{gate,up,down}_exps.weight: GGML shape [K, N, E]) as one Quantised per expert."""
    K, N, E = (int(v) for v in tensor.shape)
    data = np.asarray(tensor.data).reshape(E, -1)
    return [from_gguf(data[e], tensor.tensor_type, (N, K)) for e in range(E)]


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
def _load_minifloat(moe, fmt: str, tensors: Mapping[str, tuple], source: str = "tensors",
                    in_slots=(), values: bool = True):
    """load_quantised in fp8 or mxfp4: tensors maps w1, w3, w2 (logical order, every expert:
    [E, rows, ...]; the names in_slots: the experts held here, slot order) and shared_w1 ...
    ([N, ...]) to (codes, scales); the others keep their values (values=False: codes only,
    every weight given)."""
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
        lead = p.shape[0] if name in in_slots or not routed else moe.experts
        _check(fmt, name, codes, scales, lead, p.shape[1], p.shape[2], source)
        codes = codes_of(codes)
        if routed and name not in in_slots:  # this module's slots, in slot order
            codes, scales = codes[moe.expert_ids], scales[moe.expert_ids]
        plan[name] = (codes.contiguous(), scales.contiguous(), p.shape[2])
    if not values:
        from . import _codes

        _codes.require_routed(_codes.weight_names(moe), plan, source)
        moe._layer.load_quantised(fmt, layer_rows(moe, fmt, plan), True)
        moe._pack = fmt
        return _codes.drop_values(moe, list(plan))
    moe._layer.load_quantised(fmt, layer_rows(moe, fmt, plan))  # (checks them all first)
    for name, (c, s, k) in plan.items():
        getattr(moe, name).copy_(dequantise(fmt, c, s, k))
    moe._pack = fmt
    moe._packed_versions = moe._versions()
    moe._given = None  # (group-wise matrices given before: replaced)


def layer_rows(module, fmt: str, stacks: dict) -> list:
    """Layer.load_quantised's lists for stacks {name: slot-ordered entry}: per local rank, per
    expert tensor (routed then shared, EXPERT_TENSORS order), the rank's slots or None. An
    entry: fp8 / mxfp4 (codes, scales, cols); group-wise Quantised."""
    kinds = EXPERT_TENSORS[module.expert_kind]
    names = list(kinds) + ["shared_" + n for n in kinds if getattr(module, "shared_experts", 0)]
    L = module.experts // module.ranks
    per_rank = []
    for r in range(module._layer_ranks()):
        row = []
        for name in names:
            if name not in stacks:
                row.append(None)
                continue
            mine = ((lambda v: v) if name.startswith("shared_") or module._layer_ranks() == 1
                    else (lambda v: v[r * L:(r + 1) * L].contiguous()))
            e = stacks[name]
            if fmt in FORMATS:
                c, s, k = e
                row.append((mine(c), mine(s), int(k)))
            else:
                row.append(tuple(None if v is None else mine(v)
                                 for v in (e.q, e.scales, e.offsets, e.order)))
        per_rank.append(row)
    return per_rank


def split_gate_up(t: Quantised, F: int, interleaved: bool, key: str):
    """The gate's and the up's halves (Quantised stacks [n, F, K]) of a fused gate_up stack
    [n, 2F, K]: rows [0, F) and [F, 2F), or even and odd rows (interleaved, GPT-OSS). fp8's
    scale rows are each projection's own ceil(F / 128) blocks (as checkpoints store them);
    interleaved rows share 128-row blocks, which no half's blocks can hold."""
    if t.format == "fp8":
        if interleaved:
            raise ValueError(f"epmoe: {key}: fp8 with gate and up rows interleaved: a 128-row "
                             "block would mix both projections (give w1 and w3 apart)")
        s1, s3 = _fp8_halves(t.scales, F, key + " scales")
        return Quantised("fp8", t.q[:, :F], s1), Quantised("fp8", t.q[:, F:], s3)
    halves = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, F),
                                                                          slice(F, None))
    return tuple(Quantised(t.format, t.q[:, h], t.scales[:, h],
                           None if t.offsets is None else t.offsets[:, h], t.order)
                 for h in halves)


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
                       opts: dict, values: bool = True) -> Optional[tuple]:
    """A block's quantised expert tensors in a state dict, or None: (format, the state dict
    with them dequantised under transformers' unquantised names, {name: (codes, scales)}:
    load_quantised's tensors as Quantised(format, codes, scales)).
    GPT-OSS: experts.gate_up_proj_blocks [E, 2F, H / 32, 16] and _scales [E, 2F, H / 32]
    (gate and up rows interleaved), down_proj_blocks / _scales; FP8Experts (DeepSeek-V3 and
    its clones): experts.gate_up_proj [E, 2F, H] float8_e4m3fn and gate_up_proj_scale_inv,
    down_proj and down_proj_scale_inv, and the shared MLP's FP8 Linear weights.
    values=False: the routed experts' entries are placeholders of no memory (codes only)."""
    H, F, E = opts["hidden"], opts["ffn"], opts["experts"]
    sd = dict(state_dict)
    from ._codes import placeholder

    def routed(fmt, codes, scales, cols):  # the values, or a placeholder of their shape
        return (dequantise(fmt, codes, scales, cols) if values
                else placeholder(*codes.shape[:-1], cols))

    key = prefix + "experts.gate_up_proj"
    if family == "gpt_oss" and key + "_blocks" in sd:
        gb, gs = codes_of(sd[key + "_blocks"]), sd[key + "_scales"]
        db, ds = (codes_of(sd[prefix + "experts.down_proj_blocks"]),
                  sd[prefix + "experts.down_proj_scales"])
        q = {"w1": (gb[:, 0::2].reshape(E, F, -1), gs[:, 0::2]),
             "w3": (gb[:, 1::2].reshape(E, F, -1), gs[:, 1::2]),
             "w2": (db.reshape(E, H, -1), ds)}
        sd[key] = routed("mxfp4", gb.reshape(E, 2 * F, -1), gs, H).transpose(1, 2)
        sd[prefix + "experts.down_proj"] = routed("mxfp4", db.reshape(E, H, -1), ds,
                                                  F).transpose(1, 2)
        return "mxfp4", sd, q
    if key + "_scale_inv" in sd:
        gu, gsi = codes_of(sd[key]), sd[key + "_scale_inv"]
        s1, s3 = _fp8_halves(gsi, F, key + "_scale_inv")
        down, dsi = codes_of(sd[prefix + "experts.down_proj"]), sd[prefix + "experts.down_proj_scale_inv"]
        q = {"w1": (gu[:, :F], s1), "w3": (gu[:, F:], s3), "w2": (down, dsi)}
        sd[key] = (torch.cat([dequantise("fp8", gu[:, :F], s1, H),
                              dequantise("fp8", gu[:, F:], s3, H)], 1) if values
                   else placeholder(E, 2 * F, H))
        sd[prefix + "experts.down_proj"] = routed("fp8", down, dsi, F)
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


# --- MoE.load_quantised's parts (epmoe/torch.py) ----------------------------------------------

@torch.no_grad()
def load_quantised(moe, tensors: Mapping, source: str = "tensors", values: bool = True):
    """MoE.load_quantised: tensors maps (name, expert) to one Quantised matrix, or name to a
    stack of them [E, ...] (every expert, logical order; shared_...: [S, ...]), all in one
    format. Group-wise stacks are split into the experts held here; fp8 and mxfp4 matrices
    given one at a time are stacked (every expert held here: the layer packs a tensor's
    matrices at once). values=False: codes only (epmoe/_codes.py)."""
    from . import _codes

    _codes.refuse_again(moe, source, values)
    if not tensors:
        return
    fmt = one_format(tensors, source)
    ordered = [k for k, t in tensors.items() if t.order is not None]
    if fmt in FORMATS and ordered:
        raise ValueError(f"epmoe: {source}[{ordered[0]!r}].order: an input order (act order) "
                         "is a group-wise format's; fp8 and mxfp4 take none")
    if fmt in FORMATS:
        stacks = {n: (t.q, t.scales) for n, t in tensors.items() if isinstance(n, str)}
        pairs = {k: t for k, t in tensors.items() if not isinstance(k, str)}
        held = _stack_held(moe, pairs, stacks, source)
        return _load_minifloat(moe, fmt, {**stacks, **held}, source, in_slots=set(held),
                               values=values)
    given = {}
    for key, t in tensors.items():
        if not isinstance(key, str):
            given[key] = t
            continue
        shared = key.startswith("shared_")
        count = moe.shared_experts if shared else moe.experts
        if t.q.dim() != 3 or t.q.shape[0] != count:
            raise ValueError(f"epmoe: {source}[{key!r}] has shape {tuple(t.q.shape)}: a stack "
                             f"of {count} matrices [{count}, N, K]")
        for e in range(count) if shared else moe.expert_ids.tolist():
            given[(key, e)] = t.matrix(e)
    if values:
        return moe._load_grouped(given)
    stacks = _codes.grouped_stacks(moe, plan_given(moe, given, fmt), source)
    moe._layer.load_quantised(fmt, layer_rows(moe, fmt, stacks), True)
    moe._pack = fmt
    _codes.drop_values(moe, list(stacks))


def _stack_held(moe, pairs: dict, stacks: dict, source: str) -> dict:
    """fp8 / mxfp4 matrices given one at a time ({(name, expert): Quantised}, as checkpoints
    that store each expert apart name them) as {name: (codes, scales)} stacked in slot order:
    every expert this process holds (shared_...: every shared expert), each name once."""
    by_name = {}
    for (name, expert), t in pairs.items():
        by_name.setdefault(name, {})[expert] = t
    out = {}
    for name, given in by_name.items():
        if name in stacks:
            raise ValueError(f"epmoe: {source}: {name!r} is given both whole and one expert at a "
                             "time")
        shared = name.startswith("shared_")
        want = list(range(moe.shared_experts)) if shared else moe.expert_ids.tolist()
        if sorted(given) != sorted(want):
            raise ValueError(f"epmoe: {source}: {name!r} is given for experts "
                             f"{sorted(given)}: a format packed from codes needs every expert "
                             f"this process holds ({sorted(want)}), or a stack of all")
        ts = [given[e] for e in want]
        shapes = {(tuple(t.q.shape), tuple(t.scales.shape)) for t in ts}
        if len(shapes) != 1:
            raise ValueError(f"epmoe: {source}: {name!r}'s matrices have shapes {sorted(shapes)}: "
                             "one shape for all")
        out[name] = (torch.stack([codes_of(t.q) for t in ts]), torch.stack([t.scales for t in ts]))
    return out


def one_format(tensors: Mapping, source: str) -> str:
    """The one format of load_quantised's Quantised values (TypeError, ValueError naming the
    entry or the formats otherwise): fp8, mxfp4 or a group-wise one."""
    for key, t in tensors.items():
        if not isinstance(t, Quantised):
            raise TypeError(f"epmoe: {source}[{key!r}] is {type(t).__name__}: must be an "
                            "epmoe.quantised.Quantised (format, q, scales[, offsets])")
    formats = sorted({t.format for t in tensors.values()})
    if len(formats) != 1:
        raise ValueError(f"epmoe: {source} mixes formats {formats}: one format per call")
    if formats[0] not in FORMATS and format_group(formats[0]) is None:
        raise ValueError(f"epmoe: {source}: format {formats[0]!r}: must be fp8, mxfp4 or a "
                         "group-wise format (int4[_asym][_g<group>], int8_g<group>)")
    return formats[0]


_GROUP_RANGE = {"int4": (-8, 7), "int4_asym": (0, 15), "int8": (-128, 127)}


def check_grouped(t: Quantised, where: str):
    """A group-wise Quantised's values as the layer will take them (packed_nt::repack_grouped's
    rules: q within the kind's range, finite scales and offsets), checked before anything is
    written (ValueError naming the entry)."""
    lo, hi = _GROUP_RANGE[format_group(t.format)[0]]
    if t.q.numel() and (int(t.q.min()) < lo or int(t.q.max()) > hi):
        raise ValueError(f"epmoe: {where}.q holds values outside [{lo}, {hi}] ({t.format})")
    for name, v in (("scales", t.scales), ("offsets", t.offsets)):
        if v is not None and not bool(torch.isfinite(v).all()):
            raise ValueError(f"epmoe: {where}.{name} must be finite")


def plan_given(moe, tensors: dict, fmt=None) -> list:
    """[(parameter name, slot, Quantised)] for load_quantised's {(name, expert): Quantised},
    every entry checked (ValueError naming it) before any is used; in format `fmt` (by
    default the one pack_weights names)."""
    kinds = EXPERT_TENSORS[moe.expert_kind]
    held = moe.expert_ids.tolist()
    planned = []
    for (name, expert), t in tensors.items():
        base = name[len("shared_"):] if name.startswith("shared_") else name
        if base not in kinds or not hasattr(moe, name):
            raise ValueError(f"epmoe: load_quantised: {name!r} is not an expert tensor of this "
                             f"module ({', '.join(kinds)}, shared_...)")
        if t.format != (fmt or moe._pack):
            raise ValueError(f"epmoe: load_quantised[{name!r}, {expert}] is {t.format}: "
                             f"pack_weights = {moe._pack!r} must name that format")
        shared = name != base
        if (shared and not 0 <= expert < moe.shared_experts) or (not shared and expert not in held):
            raise ValueError(f"epmoe: load_quantised: expert {expert} of {name!r} is not held by "
                             "this process")
        p = getattr(moe, name)
        if tuple(t.q.shape) != tuple(p.shape[1:]):
            raise ValueError(f"epmoe: load_quantised[{name!r}, {expert}] has shape "
                             f"{tuple(t.q.shape)}: must be {tuple(p.shape[1:])}")
        if t.order is not None and tuple(t.order.shape) != (p.shape[2],):
            raise ValueError(f"epmoe: load_quantised[{name!r}, {expert}].order has shape "
                             f"{tuple(t.order.shape)}: must be [K = {p.shape[2]}]")
        check_grouped(t, f"load_quantised[{name!r}, {expert}]")
        planned.append((name, expert if shared else held.index(expert), t))
    return planned


def give(moe, given: dict):
    """moe's packed copies of `given` ({(name, slot): Quantised}) replaced, on the local rank
    holding each slot (a shared expert: on every local rank)."""
    kinds = EXPERT_TENSORS[moe.expert_kind]
    L, local = moe.experts // moe.ranks, moe._layer_ranks()
    for (name, slot), t in given.items():
        shared = name.startswith("shared_")
        tensor = kinds.index(name[len("shared_"):] if shared else name) + (len(kinds) if shared else 0)
        for r in range(local) if shared else [slot // L]:
            moe._layer.pack_given(r, tensor, slot if shared else slot % L, t.format,
                                  t.q.contiguous(), t.scales.float().contiguous(),
                                  None if t.offsets is None else t.offsets.float().contiguous(),
                                  None if t.order is None else t.order.long().contiguous())
