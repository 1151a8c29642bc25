# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Training loops through epmoe.torch.MoE with a torch optimizer, against the same loop on the
transformers block, step by step: each step's y and dx, every gradient before the optimizer
step and every parameter after it (so the next step runs both on the updated weights). Micro-
batches accumulate into .grad (autograd's sum, or the layer writing into .grad with
fuse_grad_accumulation), packed copies follow the optimizer's in-place updates, and 2 gloo
processes sum the replicated gradients (allreduce_replicated_grads) before each step."""
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from epmoe import hf  # noqa: E402
from epmoe.torch import EXPERT_TENSORS, MoE  # noqa: E402
from ranks import run_ranks  # noqa: E402
from test_hf import H, _hf_forward, _make, close  # noqa: E402

STEPS, TOKENS = 4, 24


def _batch(step, micro):
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    return torch.randn(TOKENS, H, generator=g), torch.randn(TOKENS, H, generator=g)


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.005, momentum=0.5)


def _hf_step(family, block, opt, step, micro):
    """HF's loop step: every micro-batch's y and dx, its gradients, then the update."""
    opt.zero_grad()
    ys, dxs = [], []
    for i in range(micro):
        x, dy = _batch(step, i)
        x3 = x.view(2, TOKENS // 2, H).clone().requires_grad_()
        y = _hf_forward(family, block, None, x3)
        (y * dy.view_as(y)).sum().backward()
        ys.append(y.detach().reshape(-1, H))
        dxs.append(x3.grad.reshape(-1, H))
    grads = {k: p.grad.clone() for k, p in block.named_parameters()}
    opt.step()
    return ys, dxs, grads


@pytest.mark.parametrize("family,micro,kw", [
    ("mixtral", 1, {}),
    ("qwen2_moe", 1, {}),
    ("qwen2_moe", 3, {}),
    ("qwen2_moe", 2, {"fuse_grad_accumulation": True}),
    ("mixtral", 2, {"pack_weights": True}),
    ("qwen2_moe", 1, {"ranks": 2, "placement": "round_robin"}),
])
def test_loop_equals_hf(family, micro, kw):
    config, block, _ = _make(family)
    moe = MoE.from_hf(block, **kw)
    moe.train()
    hf_opt, opt = _optimizer(block.parameters()), _optimizer(moe.parameters())
    first = {k: p.detach().clone() for k, p in block.named_parameters()}
    checked = 0
    for step in range(STEPS):
        want_y, want_dx, want_grads = _hf_step(family, block, hf_opt, step, micro)
        opt.zero_grad()
        for i in range(micro):
            x, dy = _batch(step, i)
            xe = x.clone().requires_grad_()
            y, _ = moe(xe)
            (y * dy).sum().backward()
            close(y, want_y[i], f"{family} step {step} micro {i}: y")
            close(xe.grad, want_dx[i], f"{family} step {step} micro {i}: dx")
        got = hf.hf_state_dict(family, hf.module_tensors(moe, grad=True), config, gradients=True)
        assert set(got) == set(want_grads)
        for k, w in want_grads.items():
            close(got[k], w, f"{family} step {step}: d {k}")
            checked += 1
        opt.step()
        if kw.get("pack_weights"):
            assert moe.packed
        params = hf.hf_state_dict(family, hf.module_tensors(moe), config)
        for k, p in block.named_parameters():
            close(params[k], p, f"{family} step {step}: {k} after the update")
    assert checked == STEPS * len(want_grads)
    # The steps moved every parameter well past the comparison's tolerance.
    for k, p in block.named_parameters():
        moved = (p.detach() - first[k]).abs().max() / first[k].abs().max()
        assert moved > 1e-3, f"{k} moved by {moved:.2e} only"


def _loop_ranks(rank, world, group, family, sd, config):
    """Each rank: its half of every batch on the group's layer; the HF block's loop on the
    whole batch here too. y and dx rows, the held experts' and the summed replicated
    parameters after every step."""
    block = _make(family)[1]
    block.load_state_dict(sd)
    moe = hf.from_hf_state_dict(sd, config, family, group=group)
    moe.train()
    held = moe.expert_ids.tolist()
    hf_opt, opt = _optimizer(block.parameters()), _optimizer(moe.parameters())
    rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    compared = 0
    for step in range(STEPS):
        want_y, want_dx, _ = _hf_step(family, block, hf_opt, step, 1)
        opt.zero_grad()
        x, dy = _batch(step, 0)
        xr = x[rows].clone().requires_grad_()
        y, _ = moe(xr)
        (y * dy[rows]).sum().backward()
        close(y, want_y[0][rows], f"rank {rank} step {step}: y")
        close(xr.grad, want_dx[0][rows], f"rank {rank} step {step}: dx")
        moe.allreduce_replicated_grads()
        opt.step()
        logical = {}
        for name, p in moe.named_parameters():
            v = p.detach()
            if name in EXPERT_TENSORS[moe.expert_kind]:
                full = torch.full((moe.experts,) + tuple(v.shape[1:]), float("nan"))
                full[held] = v
                v = full
            logical[name] = v
        got = hf.hf_state_dict(family, logical, config)
        for k, p in block.named_parameters():
            if k.startswith("experts."):  # fused [E, ...]: the rows of the held experts
                close(got[k][held], p[held], f"rank {rank} step {step}: {k} {held} after the update")
            else:
                close(got[k], p, f"rank {rank} step {step}: {k} after the update")
            compared += 1
    dist.barrier(group=group)
    return compared


def test_loop_two_processes():
    family = "qwen2_moe"
    config, block, _ = _make(family)
    sd = {k: v.clone() for k, v in block.state_dict().items()}
    compared = run_ranks(_loop_ranks, 2, args=(family, sd, config))
    every = STEPS * len(dict(block.named_parameters()))  # each parameter, each step
    assert compared == [every, every], compared
