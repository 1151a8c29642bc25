# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Codes only (docs/codes-only.md): a module serving a quantised checkpoint
keeps the packed codes as the only copy of its expert weights. The layer reads views of
address space with no memory behind it (C++ space::unbacked_tensors) and its packed copies
hold the codes; the module's float32 copies of the matrices given are dropped (4 bytes a
weight: 8x an int4 or mxfp4 checkpoint's). Every routed weight matrix must be given; biases
(GPT-OSS's, mlp_relu_bias's) and shared experts not given keep their values (packed from
them)."""
from __future__ import annotations

import torch

from ._ranks import EXPERT_TENSORS
from .quantised import Quantised


def weight_names(module) -> list:
    """The module's expert weight matrices (no biases), routed then shared."""
    kinds = [n for n in EXPERT_TENSORS[module.expert_kind] if n.startswith("w")]
    shared = getattr(module, "shared_experts", 0)
    return kinds + ["shared_" + n for n in kinds if shared]


def refuse_again(module, source: str, values: bool):
    state = getattr(module, "_codes_only", False)
    if state is True:
        raise ValueError(f"epmoe: {source}: this module holds its experts as codes only "
                         "already (values=False): it has no parameters to load into; build "
                         "another module")
    if state == "pending" and values:
        raise ValueError(f"epmoe: {source}: this MoE was built with values=False: load its "
                         "codes with load_quantised(tensors, values=False)")


def unloaded(module, name: str) -> bool:
    """Whether `name` is a routed weight matrix of a module built with values=False (left
    uninitialised, its memory untouched) that no codes replaced yet."""
    return module._codes_only == "pending" and name.startswith("w")


def require_loaded(module):
    if module._codes_only == "pending":
        raise RuntimeError("epmoe: this MoE was built with values=False: its routed experts "
                           "have no weights until load_quantised(tensors, values=False)")


def placeholder(*shape) -> torch.Tensor:
    """A float32 tensor of `shape` with no memory (one element, expanded): what a state dict's
    dequantised experts are when only their codes are kept."""
    return torch.zeros((), dtype=torch.float32).expand(*shape)


def require_routed(names, given, source: str):
    """Every routed weight given (the shared experts' may keep their values)."""
    routed = [n for n in names if not n.startswith("shared_")]
    missing = [n for n in routed if n not in given]
    if missing:
        raise ValueError(f"epmoe: {source}: codes only (values=False) needs every routed expert "
                         f"weight matrix: {missing[0]!r} is not given ({', '.join(routed)})")


def grouped_stacks(module, planned: list, source: str) -> dict:
    """{name: Quantised [n, N, K] in slot order} from plan_given's [(name, slot, Quantised)]:
    every slot of every weight matrix, one stack each."""
    by_name = {}
    for name, slot, t in planned:
        by_name.setdefault(name, {})[slot] = t
    names = weight_names(module)
    require_routed(names, by_name, source)
    out = {}
    for name in (n for n in names if n in by_name):
        n = module.shared_experts if name.startswith("shared_") else len(module.expert_ids)
        missing = [s for s in range(n) if s not in by_name[name]]
        if missing:
            raise ValueError(f"epmoe: {source}: codes only (values=False) needs every matrix: "
                             f"{name!r} slot {missing[0]} is not given")
        ts = [by_name[name][s] for s in range(n)]
        if any(t.offsets is None for t in ts) != all(t.offsets is None for t in ts):
            raise ValueError(f"epmoe: {source}: {name!r}: offsets for all matrices or none")
        K = ts[0].q.shape[-1]
        orders = [t.order if t.order is not None else torch.arange(K) for t in ts]
        out[name] = Quantised(
            ts[0].format, torch.stack([t.q for t in ts]).contiguous(),
            torch.stack([t.scales.float() for t in ts]).contiguous(),
            None if ts[0].offsets is None else torch.stack([t.offsets.float() for t in ts]).contiguous(),
            torch.stack([o.long() for o in orders]).contiguous()
            if any(t.order is not None for t in ts) else None)
    return out


def drop_values(module, names):
    """After the layer took the codes: the module's float32 copies of `names` (those given)
    are gone (freed once nothing else holds them)."""
    for name in names:
        delattr(module, name)
    module._param_names = [n for n in module._param_names if n not in names]
    module._bound = module._pointers()
    module._packed_versions = module._versions()
    module._codes_only, module._given = True, None
