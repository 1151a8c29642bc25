# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""The layer's forward and backward as torch.library custom ops (docs/pytorch.md, "Custom op").

torch.compile sees one opaque node per MoE (a fake implementation gives its shapes), so a
model with epmoe inside compiles with fullgraph=True; autograd reaches the backward through
register_autograd. The ops name their module by an integer key: a module (epmoe.torch.MoE or
Experts) registers itself here at construction and is held weakly, so the key table never
keeps a module alive. The module implements _op_forward / _op_backward on real tensors.
"""
from __future__ import annotations

import itertools
import weakref
from typing import List, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

_modules: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_keys = itertools.count(1)


def register(module) -> int:
    """A key naming `module` in the ops' calls."""
    # A custom op's first call imports torch._dynamo (1.5 s here): at construction, not
    # inside a collective pass whose peers count its deadline.
    import torch._dynamo  # noqa: F401
    key = next(_keys)
    _modules[key] = module
    return key


def _module(key: int):
    m = _modules.get(key)
    if m is None:
        raise RuntimeError(f"epmoe: the module of layer key {key} no longer exists")
    return m


@torch.library.custom_op("epmoe::moe_forward", mutates_args=())
def moe_forward(x: Tensor, params: List[Tensor], ids: Optional[Tensor], weights: Optional[Tensor],
                layer: int, keep: bool, token_ids: Optional[Tensor] = None) -> List[Tensor]:
    """[y, aux, seq_aux, z, pass]: y = MoE(x) [T, H] float32 with the module's parameters
    `params` (its own, or a framework's tensors it reads in place); ids/weights a given routing
    [T, K] or None; keep: the layer keeps what backward reads (grad mode); token_ids: the
    tokens' vocabulary ids [T] int64 (table routers) or None. pass: the pass's number (int64),
    which the backward checks."""
    return _module(layer)._op_forward(x, params, ids, weights, keep, token_ids)


@moe_forward.register_fake
def _(x, params, ids, weights, layer, keep, token_ids=None):
    s = x.new_empty(())
    return [torch.empty_like(x), s, s.clone(), s.clone(), x.new_empty((), dtype=torch.int64)]


@torch.library.custom_op("epmoe::moe_backward", mutates_args=())
def moe_backward(dy: Tensor, losses: Tensor, x: Tensor, pass_id: Tensor, params: List[Tensor],
                 weights: Optional[Tensor], layer: int, wanted: List[bool],
                 routing_grad: bool) -> List[Tensor]:
    """[dx, d(routing weights) or an empty tensor, the gradient of each parameter (an empty
    tensor where not `wanted`)]. losses: the scales of (aux, seq_aux, z), [3]. x is the
    forward's (autograd keeps it alive for the layer, which reads it again)."""
    return _module(layer)._op_backward(dy, losses, x, pass_id, params, weights, wanted,
                                       routing_grad)


@moe_backward.register_fake
def _(dy, losses, x, pass_id, params, weights, layer, wanted, routing_grad):
    none = dy.new_empty((0,))
    dw = torch.empty_like(weights) if routing_grad and weights is not None else none
    return [torch.empty_like(dy), dw] + [torch.empty_like(p) if w else none.clone()
                                         for p, w in zip(params, wanted)]


def _setup(ctx, inputs, output):
    x, params, ids, weights, layer, keep = inputs[:6]
    ctx.layer, ctx.kept, ctx.n = layer, keep, len(params)
    ctx.save_for_backward(x, output[4], weights if weights is not None else x.new_empty((0,)),
                          *params)
    ctx.given = weights is not None


def _flags(needs, n: int):
    """needs_input_grad of (x, params, ids, weights, ...) as (x, [each param], weights): a list
    input comes as one flag or as one per element, by torch version."""
    p = needs[1]
    per = list(p) if isinstance(p, (list, tuple)) else [bool(p)] * n
    return bool(needs[0]), per, bool(needs[3])


def _backward(ctx, grads):
    dy, daux, dseq, dz = grads[0], grads[1], grads[2], grads[3]
    if not ctx.kept:
        raise RuntimeError("epmoe: backward of a forward run without grad mode (no_grad or "
                           "inference_mode keep nothing for a backward)")
    x, pass_id, weights, *params = ctx.saved_tensors
    _, wanted, wants_routing = _flags(ctx.needs_input_grad, ctx.n)
    zero = dy.new_zeros(())
    losses = torch.stack([g if g is not None else zero for g in (daux, dseq, dz)]).float()
    dy = dy if dy is not None else torch.zeros_like(x)
    out = moe_backward(dy.contiguous(), losses, x, pass_id, params,
                       weights if ctx.given else None, ctx.layer, wanted,
                       bool(ctx.given and wants_routing))
    dx, dw, pgrads = out[0], out[1], out[2:]
    return (dx, [g if w else None for g, w in zip(pgrads, wanted)], None,
            dw if ctx.given and wants_routing else None, None, None, None)


moe_forward.register_autograd(_backward, setup_context=_setup)


def _twice(ctx, *grads):
    raise RuntimeError("epmoe: the layer's backward builds no graph: cannot differentiate twice")


moe_backward.register_autograd(_twice, setup_context=lambda ctx, inputs, output: None)


def run(module, x: Tensor, params, ids: Optional[Tensor], weights: Optional[Tensor],
        keep: bool, token_ids: Optional[Tensor] = None) -> List[Tensor]:
    """moe_forward of `module`. An eager pass that keeps nothing for a backward (inference)
    calls the module directly: torch's custom-op dispatch costs ~40 µs a call, a decode step's
    worth at small shapes; traced (torch.compile) or with autograd, the op."""
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)()
    if not keep and not compiling and x.device.type == "cpu":
        return module._op_forward(x, params, ids, weights, False, token_ids)
    return moe_forward(x, params, ids, weights, module._key, keep, token_ids)


def wants_backward(x: Tensor, params) -> bool:
    """Whether this call's forward must keep what backward reads: grad mode on and something
    that requires grad (no_grad and inference_mode: nothing is kept)."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))


class FusedMoEFunction(torch.autograd.Function):
    """fuse_grad_accumulation: y, aux, seq_aux, z = MoE(x), the backward adding straight into
    p.grad (which a custom op cannot do: it returns new gradients). Eager only."""

    @staticmethod
    def forward(ctx, module, x: torch.Tensor, token_ids, *params: torch.Tensor):
        y, aux, seq, z, pid = module._op_forward(x, list(params), None, None, True, token_ids)
        ctx.save_for_backward(x)  # the layer's backward reads x again (the gate's dW = dlᵀ x)
        ctx.module, ctx.pass_id = module, int(pid)
        return y, aux, seq, z

    @staticmethod
    @once_differentiable  # the layer's backward builds no graph: a double backward raises
    def backward(ctx, dy, daux, dseq, dz):
        module = ctx.module
        module._take_pass(ctx.pass_id)
        ctx.saved_tensors  # x is alive; raises if it was modified in place since forward
        grads, accumulate = module._grad_targets(True)
        dx = module._run_backward(dy, (float(daux), float(dseq), float(dz)), grads, accumulate,
                                  None)
        return (None, dx, None) + (None,) * len(module._param_names)  # in p.grad already
