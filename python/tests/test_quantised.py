# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.torch.MoE(..., pack_weights="int8"): int8 per-channel expert copies (issue 37),
inference only: within the format's rounding of the float64 reference, refused in training."""
import pytest
import torch

from epmoe.torch import MoE
from test_module import build, logical, reference, shards


@pytest.mark.parametrize("ranks", [1, 2])
def test_int8_packed_experts_within_their_rounding_of_the_reference(ranks):
    moe = build("qwen2 shared, gate, bias", ranks, pack_weights="int8").eval()
    T = 29
    x = torch.randn(T, moe.hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, _ = moe(x)
    assert moe.packed
    want = reference(moe, logical(moe), x, shards(T, ranks))["y"].reshape(y.shape).double()
    err = ((y.double() - want).norm() / want.norm()).item()
    # int8_channel's rounding (tests/layer/test_layer_int8.cpp derives the bound): a few 1e-3
    # of the output's norm, and it shows (the copies are int8, not fp32).
    assert 1e-4 < err < 5e-2, err
    with torch.no_grad():
        fp32 = build("qwen2 shared, gate, bias", ranks, pack_weights=True).eval()(x)[0]
    assert ((fp32.double() - want).norm() / want.norm()).item() < 1e-5  # the same weights


def test_int8_is_refused_in_training_mode_and_for_backward():
    moe = build("mixtral", 1, pack_weights="int8")  # a new module is in training mode
    x = torch.randn(5, moe.hidden)
    with pytest.raises(RuntimeError, match="pack_weights = 'int8' is for inference"):
        moe(x)
    moe.eval()
    xg = x.clone().requires_grad_()
    y, _ = moe(xg)
    assert torch.isfinite(y).all()
    with pytest.raises(Exception, match="int8_channel.*forward only"):
        y.sum().backward()
    with pytest.raises(ValueError, match="pack_weights = 'int3': must be 'auto', True, False, "
                                         "'bf16', 'int8', 'fp8', 'mxfp4' or a group-wise "
                                         "format"):
        MoE(16, 8, 4, 2, pack_weights="int3", ranks=1)
