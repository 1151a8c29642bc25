# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Codes only (issue 37): MoE.load_quantised(tensors, values=False) serves a quantised
checkpoint with the packed codes as the only copy of the expert weights. The module drops its
float32 expert parameters (nothing holds them after), its outputs equal those of a module
loaded with the same codes and values, on thread ranks and on two gloo processes; what would
need the values is refused by name."""
import gc
import weakref

import pytest
import torch
from torch import nn

from epmoe.quantised import Quantised
from epmoe.torch import MoE
from test_experts_quantised import _stack  # a hand-made checkpoint stack in a format

H, F, E, S = 160, 72, 4, 40  # S: the shared expert's width
SHAPES = {"w1": (F, H), "w3": (F, H), "w2": (H, F)}


def _checkpoint(fmt, seed=4):
    g = torch.Generator().manual_seed(seed)
    out = {name: _stack(fmt, E, r, c, g) for name, (r, c) in SHAPES.items()}
    out.update({"shared_" + name: _stack(fmt, 1, *(S, H) if name != "w2" else (H, S), g)
                for name in SHAPES})
    return out


def _module(fmt, ranks, group=None):
    torch.manual_seed(0)
    kw = dict(group=group) if group is not None else dict(ranks=ranks)
    return MoE(H, F, E, 2, shared_experts=1, shared_ffn=S, max_tokens=16,
               pack_weights=fmt if fmt not in ("fp8", "mxfp4") else "auto", **kw).eval()


def _forward(moe, x):
    with torch.no_grad():
        y, _ = moe(x)
    assert torch.isfinite(y).all()
    return y


def _names(moe):
    return {n for n, _ in moe.named_parameters()}


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "int4_asym_g32"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_codes_only_equals_the_module_holding_values(fmt, ranks):
    ckpt = _checkpoint(fmt)
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(1))
    held = _module(fmt, ranks)
    held.load_quantised(ckpt)
    want = _forward(held, x)

    moe = _module(fmt, ranks)
    dropped = [weakref.ref(getattr(moe, n)) for n in ("w1", "w3", "w2", "shared_w2")]
    moe.load_quantised(ckpt, values=False)
    gc.collect()
    assert all(r() is None for r in dropped)  # nothing keeps the float32 copies
    assert _names(moe) == {"gate"} and set(moe.state_dict()) == {"gate"}
    assert moe._layer.holds_values == [False] * ranks  # the layer's views: no memory
    assert held._layer.holds_values == [True] * ranks
    assert _names(held) >= {"w1", "w3", "w2", "shared_w1", "shared_w3", "shared_w2"}
    assert torch.equal(_forward(moe, x), want)  # the same codes, the same kernels
    checked = 0
    L = E // ranks
    for t, name in enumerate(("w1", "w3", "w2")):
        for slot in range(E):
            assert torch.equal(moe._layer.packed_values(slot // L, t, slot % L),
                               held._layer.packed_values(slot // L, t, slot % L))
            checked += 1
    assert checked == 3 * E
    # The control: other codes give other outputs.
    other = _module(fmt, ranks)
    other.load_quantised(_checkpoint(fmt, seed=5), values=False)
    assert (_forward(other, x) - want).norm() > 1e-2 * want.norm()
    # A replaced parameter (load_state_dict(assign=True), .to()) keeps the codes.
    moe.gate = nn.Parameter(moe.gate.detach().clone())
    assert torch.equal(_forward(moe, x), want)
    moe.pack_weights()  # nothing to pack again: a no-op
    assert torch.equal(_forward(moe, x), want)


def test_codes_only_refusals_leave_the_module_as_it_was():
    ckpt = _checkpoint("int4_asym_g32")
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    moe = _module("int4_asym_g32", 2)
    before = _forward(moe, x)
    partial = {k: v for k, v in ckpt.items() if k != "w3"}
    with pytest.raises(ValueError, match="needs every routed expert weight matrix: 'w3'"):
        moe.load_quantised(partial, values=False)
    one = {(n, e): ckpt[n].matrix(e) for n in SHAPES for e in range(E) if (n, e) != ("w2", 3)}
    with pytest.raises(ValueError, match="needs every matrix: 'w2' slot 3"):
        moe.load_quantised(one, values=False)
    bad = dict(ckpt)
    bad["w2"] = ckpt["w2"]._replace(q=ckpt["w2"].q + 9)  # past int4_asym's 15
    with pytest.raises(ValueError, match="outside"):
        moe.load_quantised(bad, values=False)
    assert "w1" in _names(moe) and torch.equal(_forward(moe, x), before)  # unchanged
    for fmt in ("fp8", "mxfp4"):
        m = _module(fmt, 1)
        with pytest.raises(ValueError, match="needs every routed expert weight matrix: 'w2'"):
            m.load_quantised({k: v for k, v in _checkpoint(fmt).items() if k != "w2"},
                             values=False)
        assert "w2" in _names(m)
    moe.load_quantised(ckpt, values=False)
    with pytest.raises(ValueError, match="codes only already"):
        moe.load_quantised(ckpt, values=False)
    with pytest.raises(ValueError, match="codes only already"):
        moe.load_quantised(ckpt)
    moe.train()
    with pytest.raises(RuntimeError, match="is for inference"):
        moe(x)


def _codes_rank(rank, world, group, fmt):
    torch.set_num_threads(1)
    ckpt = _checkpoint(fmt)
    x = torch.randn(6 + 3 * rank, H, generator=torch.Generator().manual_seed(rank))
    held = _module(fmt, world, group)
    held.load_quantised(ckpt)
    want = _forward(held, x)
    moe = _module(fmt, world, group)
    moe.load_quantised(ckpt, values=False)
    got = _forward(moe, x)
    return [bool(torch.equal(got, want)), sorted(n for n, _ in moe.named_parameters()),
            moe.expert_ids.tolist(), moe._layer.holds_values]


@pytest.mark.parametrize("fmt", ["fp8", "int4_asym_g32"])
def test_codes_only_on_two_processes(fmt):
    from ranks import run_ranks

    results = run_ranks(_codes_rank, 2, args=(fmt,))
    assert [r[0] for r in results] == [True, True]
    assert [r[1] for r in results] == [["gate"], ["gate"]]
    assert sorted(results[0][2] + results[1][2]) == list(range(E))
    assert [r[3] for r in results] == [[False], [False]]


@pytest.mark.parametrize("fmt", ["mxfp4", "int4_asym_g32"])
def test_codes_only_shared_experts_not_given_keep_their_values(fmt):
    routed = {k: v for k, v in _checkpoint(fmt).items() if not k.startswith("shared_")}
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    held = _module(fmt, 2)
    held.load_quantised(routed)
    moe = _module(fmt, 2)
    moe.load_quantised(routed, values=False)
    assert _names(moe) == {"gate", "shared_w1", "shared_w3", "shared_w2"}
    assert torch.equal(_forward(moe, x), _forward(held, x))  # the shared: packed from values


@pytest.mark.parametrize("fmt", ["fp8", "int4_asym_g32"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_experts_codes_only_equals_experts_given_values(fmt, ranks):
    """epmoe.torch.Experts.load_quantised(tensors) without tensors: the forwards are given
    none and read the codes alone; the same outputs as the experts given the values' tensors."""
    from epmoe.torch import Experts

    ckpt = _checkpoint(fmt)
    a, b = ckpt["w1"], ckpt["w3"]  # transformers 5's gate_up_proj: gate rows, then up rows
    fused = {"gate_up_proj": Quantised(fmt, *(None if u is None else torch.cat([u, v], 1)
                                              for u, v in zip(a[1:4], b[1:4]))),
             "down_proj": ckpt["w2"]}
    g = torch.Generator().manual_seed(6)
    T = 11
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, 2, generator=g)

    def experts():
        return Experts(H, F, E, 2, ranks=ranks, max_tokens=16,
                       pack_weights=fmt if fmt != "fp8" else "auto").eval()

    held = experts()
    tensors = (torch.empty(E, 2 * F, H), torch.empty(E, H, F))
    held.load_quantised(fused, *tensors)
    with torch.no_grad():
        want = held(x, ids, w, *tensors)
    codes = experts()
    with torch.no_grad():  # first bound to tensors, packed from their values (in the format)
        assert torch.isfinite(codes(x, ids, w, *(t.clone() for t in tensors))).all()
    codes.load_quantised(fused)  # then codes only: the layer leaves those tensors
    assert codes._state.codes == fmt and codes._layer.holds_values == [False] * ranks
    with torch.no_grad():
        got = codes(x, ids, w)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    codes.load_quantised(fused)  # again (new codes in place): still codes only
    with torch.no_grad():
        assert torch.equal(codes(x, ids, w), want)
        # Tensors given again: their values (packed in the format), codes only ends.
        again = codes(x, ids, w, *tensors)
    assert codes._state.codes is None and torch.isfinite(again).all()
    assert codes._layer.holds_values == [True] * ranks
    codes.train()
    with pytest.raises(RuntimeError, match="is for inference"):
        codes(x, ids, w, *tensors)
    gpt = Experts(H, F, E, 2, expert="gpt_oss", layout="gpt_oss", ranks=1)
    with pytest.raises(ValueError, match="gpt_oss layout's biases are read as values"):
        gpt.load_quantised({"gate_up_proj": _stack("mxfp4", E, 2 * F, H, g),
                            "down_proj": _stack("mxfp4", E, H, F, g)})


def _resident_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_a_module_built_without_values_never_materialises_its_routed_experts():
    """MoE(..., values=False): the routed weights are left untouched (not resident: 200 MiB of
    float32 here) until load_quantised(values=False) replaces them by codes."""
    h, f, e = 1024, 2048, 8
    MoE(64, 32, 8, 2, ranks=1)  # (a first module's imports, not counted)
    before = _resident_mib()
    moe = MoE(h, f, e, 2, ranks=2, max_tokens=8, values=False, shared_experts=1,
              shared_ffn=64).eval()
    assert _resident_mib() - before < 48  # not the 192 MiB of routed float32 weights
    before = _resident_mib()
    held = MoE(h, f, e, 2, ranks=2, max_tokens=8)  # the control: they are resident there
    assert _resident_mib() - before > 150
    del held
    assert torch.isfinite(moe.shared_w1).all()  # (the shared expert: initialised as usual)
    x = torch.randn(3, h)
    with pytest.raises(RuntimeError, match="built with values=False"):
        moe(x)
    g = torch.Generator().manual_seed(3)
    ckpt = {n: _stack("int4_asym_g32", e, *s, g)
            for n, s in (("w1", (f, h)), ("w3", (f, h)), ("w2", (h, f)))}
    with pytest.raises(ValueError, match="built with values=False"):
        moe.load_quantised(ckpt)
    moe.load_logical({"gate": torch.zeros(e, h), "shared_w1": torch.zeros(1, 64, h),
                      "shared_w3": torch.zeros(1, 64, h), "shared_w2": torch.zeros(1, h, 64)})
    moe.load_quantised(ckpt, values=False)
    assert _names(moe) == {"gate", "shared_w1", "shared_w3", "shared_w2"}
    assert _forward(moe, x).shape == (3, h)
