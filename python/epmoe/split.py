# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Split phase of epmoe.torch.MoE (docs/decode.md, "Split phase and two-batch overlap"):
h = moe.start(x) posts the dispatch of a micro-batch and returns; the framework runs another
micro-batch's attention; y = moe.finish(h) runs the experts and the combine. Two micro-batches
may be in flight: each in-flight pass has its own layer (a lane: its own buffers and its own
exchange endpoint on the module's group, over the module's parameters), built at the first
start (collective, like every call). Inference only: no autograd through a split pass."""
from __future__ import annotations

import torch

LANES = 2  # micro-batches in flight at most


class Handle:
    """What start returns and finish consumes, once."""
    __slots__ = ("id", "lane", "x", "y", "shape", "dtype")

    def __init__(self, id, lane, x, y, shape, dtype):
        self.id, self.lane, self.x, self.y, self.shape, self.dtype = id, lane, x, y, shape, dtype


class _Lanes:
    """The layers of the passes in flight; lane 0 is the module's own."""

    def __init__(self, moe):
        self.layers = [moe._layer] + [moe._make_layer() for _ in range(LANES - 1)]
        self.bound = moe._bound
        self.packed = None  # the versions lanes 1.. were packed at (None: they read the tensors)
        self.next = 0       # the next pass's number
        self.oldest = 0     # the oldest in flight

    def prepare(self, moe):
        """The module's _prepare, and the same for lanes 1..: rebound to replaced parameters,
        packed as lane 0 is."""
        moe._prepare()
        if moe._bound != self.bound:
            for layer in self.layers[1:]:
                layer.rebind(moe._rank_weights())
            self.bound = moe._bound
        if moe._packed_versions != self.packed:
            for layer in self.layers[1:]:
                layer.pack(moe._packed_versions is not None, _format(moe))
            self.packed = moe._packed_versions


def _format(moe) -> str:
    from .torch import _pack_format
    return _pack_format(moe._pack)


def start(moe, x: torch.Tensor) -> Handle:
    """Posts y = moe(x)'s dispatch (x [..., hidden], float32 or bf16/fp16 computed in float32)
    and returns its handle. Collective. A rejected input raises on every rank, nothing in
    flight (exchange="low_latency": the verdicts ride with the posted rows, so start returns
    and every rank raises at finish)."""
    if moe._given is not None:
        raise RuntimeError("epmoe: moe.start: a module with load_quantised values runs plain "
                           "passes only (the other lane's packed copies would differ)")
    lanes = moe.__dict__.get("_lanes")
    if lanes is None:
        lanes = moe.__dict__["_lanes"] = _Lanes(moe)
    if lanes.next - lanes.oldest >= LANES:
        raise RuntimeError(f"epmoe: moe.start: {LANES} passes are in flight, the most a module "
                           "keeps: finish the oldest first")
    shape, dtype = x.shape, x.dtype
    flat = x.reshape(-1, shape[-1])
    if flat.dtype in (torch.bfloat16, torch.float16):
        flat = flat.float()
    flat = flat.detach().contiguous()
    y = torch.empty_like(flat)
    lane = lanes.next % LANES
    lanes.prepare(moe)
    lanes.layers[lane].start(flat, y)  # raises: nothing in flight
    h = Handle(lanes.next, lane, flat, y, shape, dtype)
    lanes.next += 1
    return h


def finish(moe, h: Handle) -> torch.Tensor:
    """y of the pass h started: waits for its dispatch, runs the experts and the combine.
    Handles finish once, in the order they started (every rank's exchanges meet in it)."""
    lanes = moe.__dict__.get("_lanes")
    if lanes is None or h.id >= lanes.next:
        raise RuntimeError(f"epmoe: moe.finish: pass {h.id} was not started by this module")
    if h.id < lanes.oldest:
        raise RuntimeError(f"epmoe: moe.finish: pass {h.id} was finished already: finish each "
                           "handle once")
    if h.id != lanes.oldest:
        raise RuntimeError(f"epmoe: moe.finish: pass {h.id} is out of order: finish passes in "
                           f"the order they started (pass {lanes.oldest} first)")
    lanes.oldest += 1  # whatever happens next
    lanes.layers[h.lane].finish()
    return h.y.to(h.dtype).view(h.shape)
