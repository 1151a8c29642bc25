# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Expert weights quantised already, as checkpoints store them, in epmoe's group-wise formats
(docs/quantisation.md, "Group-wise formats"): GPTQ and AWQ int4 (-> int4_asym), GGUF Q4_K
(-> int4_asym, group 32) and Q8_0 (-> int8_g32). Give them to a layer with
MoE.load_quantised; each conversion keeps the checkpoint's values exactly (its
dequantised weights equal the format's definition: tests/test_quantised.py).

A `Quantised` matrix [N, K] (N outputs, K inputs, as an nn.Linear weight) holds q int8
[N, K], scales float32 [N, G] and, for int4_asym, offsets float32 [N, G], G = ceil(K / group);
input k of row n is scales[n, k // group] * q[n, k] + offsets[n, k // group]."""
import re
from typing import NamedTuple, Optional

import numpy as np
import torch

from ._ranks import EXPERT_TENSORS

__all__ = ["Quantised", "from_gptq", "from_awq", "from_gguf", "gguf_experts", "format_group"]

_FORMAT = re.compile(r"^(int4|int4_asym|int8)(?:_g(\d+))?$")


def format_group(fmt: str):
    """(kind, group) of a group-wise format name ("int4", "int4_g128", "int4_asym_g32",
    "int8_g32"; int4's group defaults to 32), or None for another name."""
    m = _FORMAT.match(fmt) if isinstance(fmt, str) else None
    if m is None or (m.group(1) == "int8" and m.group(2) is None):
        return None  # ("int8" is int8_channel)
    return m.group(1), int(m.group(2) or 32)


class Quantised(NamedTuple):
    """One expert matrix [N, K] in a group-wise format (module docstring)."""
    format: str
    q: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor] = None

    @property
    def group(self) -> int:
        return format_group(self.format)[1]

    def dequantise(self) -> torch.Tensor:
        """The weights [N, K] in float32: scales q + offsets rounded once (the values the
        packed copy holds)."""
        g = self.group
        s = self.scales.double().repeat_interleave(g, dim=1)[:, :self.q.shape[1]]
        w = s * self.q.double()
        if self.offsets is not None:
            w = w + self.offsets.double().repeat_interleave(g, dim=1)[:, :self.q.shape[1]]
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
    Act-order checkpoints (desc_act: a g_idx other than k // group) are refused: their groups
    are not contiguous runs of inputs."""
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"epmoe: checkpoint_format = {checkpoint_format!r}: must be 'gptq' or "
                         "'gptq_v2'")
    q = _nibbles(qweight, 0)  # [K, N]
    K, N = q.shape
    z = _nibbles(qzeros, 1)[:, :N].to(torch.int32)  # [G, N]
    if checkpoint_format == "gptq":
        z = z + 1
    G = scales.shape[0]
    if g_idx is not None:
        trivial = torch.arange(K, dtype=torch.int64) // (K // max(G, 1))
        if g_idx.shape != (K,) or not torch.equal(g_idx.to(torch.int64), trivial):
            raise ValueError("epmoe: g_idx is not k // group_size (an act-order, desc_act "
                             "checkpoint): its groups are not contiguous inputs, which epmoe's "
                             "group-wise formats need; quantise without act order")
    return _asym(q, z, scales, K, N)


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


# --- MoE.load_quantised's parts (epmoe/torch.py) ----------------------------------------------

def plan_given(moe, tensors: dict) -> list:
    """[(parameter name, slot, Quantised)] for load_quantised's {(name, expert): Quantised},
    every entry checked (ValueError naming it) before any is used."""
    kinds = EXPERT_TENSORS[moe.expert_kind]
    held = moe.expert_ids.tolist()
    planned = []
    for (name, expert), t in tensors.items():
        base = name[len("shared_"):] if name.startswith("shared_") else name
        if base not in kinds or not hasattr(moe, name):
            raise ValueError(f"epmoe: load_quantised: {name!r} is not an expert tensor of this "
                             f"module ({', '.join(kinds)}, shared_...)")
        if t.format != moe._pack:
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
                                  None if t.offsets is None else t.offsets.float().contiguous())
