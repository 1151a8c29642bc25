# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.torch.MoE(..., dispatch_rows="int8"): 8-bit dispatch rows (issue 37), each token
quantised once to int8 with a float32 scale and dequantised at the experts: within the
rounding of the float64 reference, the bytes counted exactly, on thread ranks and on 2 gloo
processes (the torch.distributed endpoint moves the rows as bytes); inference only."""
import math

import pytest
import torch

from epmoe.torch import MoE
from ranks import run_ranks
from test_module import CASES, F, H, build, logical, reference, shards

# tests/layer/test_layer_wire.cpp derives the bound: a token's relative rms rounding error is
# at most sqrt(H) / (127 sqrt(12)), three times that at an expert's output, x3 margin.
BOUND = 3 * 3 * math.sqrt(H) / (127 * math.sqrt(12))


def _check_bytes(wire, plain):
    """Per link class: rows at H + 4 bytes (int8 values and the scale) with 8-bit rows, 4H
    without, the same rows and metadata; the combine's bytes unchanged (float32)."""
    assert wire["combine_bytes_sent"] == plain["combine_bytes_sent"]
    for link in ("intra_node", "inter_node"):
        w, p = wire[link], plain[link]
        assert w["rows_sent"] == p["rows_sent"]
        assert w["bytes_sent"] - w["rows_sent"] * (H + 4) == p["bytes_sent"] - p["rows_sent"] * 4 * H
    return wire["intra_node"]["rows_sent"] + wire["inter_node"]["rows_sent"]


@pytest.mark.parametrize("case", ["mixtral", "dedup", "hierarchical pipelined rounds"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_int8_rows_within_their_rounding_with_fewer_bytes(case, ranks):
    wire = build(case, ranks, dispatch_rows="int8").eval()
    plain = build(case, ranks).eval()  # the same weights
    T = 29
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, _ = wire(x)
        p, _ = plain(x)
    want = reference(plain, logical(plain), x, shards(T, ranks))["y"].reshape(y.shape).double()
    err = ((y.double() - want).norm() / want.norm()).item()
    assert 1e-4 < err < BOUND, err  # the rounding shows, within its bound
    assert ((p.double() - want).norm() / want.norm()).item() < 1e-5
    rows = sum(_check_bytes(wire.stats(r), plain.stats(r)) for r in range(ranks))
    assert (rows > 0) == (ranks > 1)


def _two_ranks_wire(rank, world, group, case, tokens):
    torch.manual_seed(0)
    full = build(case, 1)
    wire = MoE(H, F, **CASES[case], group=group, max_tokens=64, dispatch_rows="int8").eval()
    plain = MoE(H, F, **CASES[case], group=group, max_tokens=64).eval()
    for m in (wire, plain):
        m.load_logical(logical(full))
    torch.manual_seed(7)
    x_all = torch.randn(sum(tokens), H)
    a = sum(tokens[:rank])
    with torch.no_grad():
        y, _ = wire(x_all[a:a + tokens[rank]])
        plain(x_all[a:a + tokens[rank]])
    want = reference(wire, logical(full), x_all, tokens)["y"][a:a + tokens[rank]].double()
    err = ((y.double() - want.reshape(y.shape)).norm() / want.norm()).item()
    return err, _check_bytes(wire.stats(), plain.stats())


@pytest.mark.parametrize("case", ["mixtral", "hierarchical, a node per rank"])
def test_int8_rows_over_two_processes(case):
    for err, rows in run_ranks(_two_ranks_wire, 2, args=(case, [7, 12])):
        assert 1e-4 < err < BOUND, err
        assert rows > 0


def test_int8_rows_are_refused_in_training_mode_and_for_backward():
    moe = build("mixtral", 1, dispatch_rows="int8")  # a new module is in training mode
    x = torch.randn(5, H)
    with pytest.raises(RuntimeError, match="dispatch_rows = 'int8' is for inference"):
        moe(x)
    moe.eval()
    xg = x.clone().requires_grad_()
    y, _ = moe(xg)
    assert torch.isfinite(y).all()
    with pytest.raises(Exception, match="dispatch_rows = int8.*inference"):
        y.sum().backward()
    with pytest.raises(ValueError, match="dispatch_rows = 'fp8': must be 'activations' or "
                                         "'int8'"):
        MoE(16, 8, 4, 2, dispatch_rows="fp8", ranks=1)
