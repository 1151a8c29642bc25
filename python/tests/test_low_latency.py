# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""exchange="low_latency" (issue 38, docs/decode.md): fixed slots, one all-to-all per direction,
on 2 gloo processes (torch.distributed: all_to_all_single of equal blocks) and on thread
ranks, against the float64 reference; inference only."""
import pytest
import torch

from epmoe.torch import MoE
from ranks import run_ranks
from test_module import close, logical, reference

H, F = 16, 24
ARGS = dict(experts=8, top_k=2, exchange="low_latency", max_tokens=8)


def _decode(rank, world, group, tokens):
    import torch
    from epmoe.torch import MoE
    torch.manual_seed(0)
    full = MoE(H, F, **ARGS)  # every rank builds the same module, then keeps its slots
    moe = MoE(H, F, **ARGS, group=group)
    moe.load_logical(logical(full))
    torch.manual_seed(7)
    x_all = torch.randn(sum(tokens), H)
    a = sum(tokens[:rank])
    with torch.no_grad():
        y, _ = moe(x_all[a:a + tokens[rank]])
    want = reference(moe, logical(full), x_all, tokens)["y"][a:a + tokens[rank]]
    if tokens[rank]:
        close(y, want, "y")
    assert y.shape == (tokens[rank], H)
    return moe.stats()


@pytest.mark.parametrize("tokens", [[3, 8], [0, 5]])  # a rank with T = 0
def test_two_processes_equal_the_reference(tokens):
    stats = run_ranks(_decode, 2, args=(tokens,))
    for s, T in zip(stats, tokens):
        assert s["alltoalls"] == 2 and s["rounds"] == 1  # no counts round
        assert s["tokens"] == T
        # Whole slots move (8 tokens x min(2, 4) rows of H floats, after two head rows: 14
        # int64): a fixed number of bytes whatever the routing.
        assert s["dispatch_bytes_sent"] == (2 + 16) * H * 4


def test_threads_and_inference_only():
    moe = MoE(H, F, **ARGS, ranks=2)
    x = torch.randn(12, H)
    with torch.no_grad():
        y, _ = moe(x)
    close(y, reference(moe, logical(moe), x, [6, 6])["y"], "y")
    assert moe.stats()["alltoalls"] == 2
    assert not moe.config["training"]  # the layer refuses training: the module never asks
