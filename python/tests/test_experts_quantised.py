# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.torch.Experts.load_quantised (issue 37): a checkpoint's quantised expert tensors in the
caller's layout (transformers 5's fused gate_up_proj / down_proj, GPT-OSS's interleaved rows,
or the kind's own w1, w3, w2) packed as they are, the caller's tensors given the dequantised
values; forwards read the checkpoint's values until those tensors change."""
import pytest
import torch

from epmoe.quantised import Quantised, dequantise
from epmoe.torch import Experts

FP8 = torch.float8_e4m3fn
H, F, E, K, T = 160, 128, 4, 2, 11
# The tokens' rounding to bf16 through SwiGLU (test_minifloat.py's TOKENS), and W4A8's / W8A8's
# per-token int8 activations (test_int4.py's bound for every matrix given; mxfp4 is W4A8 on
# AVX512-VNNI with VBMI, space::mxfp4_w4a8).
TOKENS = 3 * 6 ** 0.5 * 2 ** -7 / 12 ** 0.5
BOUND = {"fp8": TOKENS, "mxfp4": 0.05, "int4_asym_g32": 0.05, "int8_g32": 0.05}


def _stack(fmt, n, rows, cols, g):
    """A hand-made quantised stack [n, rows, cols] (fp8 codes below 0x70: no block reaches 448,
    so quantising the values again would move them)."""
    if fmt == "fp8":
        codes = torch.randint(0, 0x70, (n, rows, cols), generator=g, dtype=torch.uint8)
        codes |= torch.randint(0, 2, codes.shape, generator=g, dtype=torch.uint8) << 7
        scales = 2e-3 * (1 + torch.rand(n, (rows + 127) // 128, (cols + 127) // 128, generator=g))
        return Quantised(fmt, codes.view(FP8), scales)
    if fmt == "mxfp4":
        nb = (cols + 31) // 32
        return Quantised(fmt, torch.randint(0, 256, (n, rows, nb * 16), generator=g,
                                            dtype=torch.uint8),
                         torch.randint(118, 124, (n, rows, nb), generator=g, dtype=torch.uint8))
    G = (cols + 31) // 32
    if fmt == "int8_g32":
        return Quantised(fmt, torch.randint(-127, 128, (n, rows, cols), generator=g,
                                            dtype=torch.int8),
                         1e-3 * torch.rand(n, rows, G, generator=g))
    s = 1e-2 * torch.rand(n, rows, G, generator=g)
    return Quantised(fmt, torch.randint(0, 16, (n, rows, cols), generator=g, dtype=torch.int8),
                     s, -8 * s * torch.rand(n, rows, G, generator=g).add(0.5))


def _values(t, cols):
    return t.dequantise(cols).double()


def _checkpoint(fmt, layout, g):
    """({name: Quantised} in the layout, {w1, w3, w2: float64 values [E, N, K]})."""
    gu = _stack(fmt, E, 2 * F, H, g)
    down = _stack(fmt, E, H, F, g)
    if layout == "separate":
        q = {"w1": _stack(fmt, E, F, H, g), "w3": _stack(fmt, E, F, H, g), "w2": down}
        return q, {n: _values(t, F if n == "w2" else H) for n, t in q.items()}
    both = _values(gu, H)
    rows = (slice(0, None, 2), slice(1, None, 2)) if layout == "gpt_oss" else (slice(0, F),
                                                                               slice(F, None))
    q = {"gate_up_proj": gu, "down_proj": down}
    if fmt == "mxfp4" and layout == "gpt_oss":  # as GPT-OSS stores its *_blocks
        q["gate_up_proj"] = gu._replace(q=gu.q.reshape(E, 2 * F, -1, 16))
    return q, {"w1": both[:, rows[0]], "w3": both[:, rows[1]], "w2": _values(down, F)}


def _module(fmt, layout, ranks):
    expert = "gpt_oss" if layout == "gpt_oss" else "swiglu"
    pack = fmt if fmt.startswith("int") else "auto"
    return Experts(H, F, E, K, expert=expert, layout=layout, ranks=ranks, max_tokens=32,
                   pack_weights=pack).eval()


def _tensors(layout, values, g):
    """The caller's tensors (the layout's) holding `values`; from NaN where values is None."""
    w1, w3, w2 = (values[n].float() for n in ("w1", "w3", "w2")) if values else (None,) * 3
    nan = float("nan")
    if layout == "gpt_oss":
        gu = torch.full((E, H, 2 * F), nan)
        down = torch.full((E, F, H), nan)
        if values:
            gu[:, :, 0::2], gu[:, :, 1::2], down[:] = w1.transpose(1, 2), w3.transpose(1, 2), \
                w2.transpose(1, 2)
        return [gu, torch.randn(E, 2 * F, generator=g) * 0.1, down,
                torch.randn(E, H, generator=g) * 0.1]
    if layout == "separate":
        return ([w1.clone(), w3.clone(), w2.clone()] if values else
                [torch.full((E, F, H), nan), torch.full((E, F, H), nan),
                 torch.full((E, H, F), nan)])
    return ([torch.cat([w1, w3], 1), w2.clone()] if values else
            [torch.full((E, 2 * F, H), nan), torch.full((E, H, F), nan)])


CASES = [(f, lay) for f in ("fp8", "mxfp4", "int4_asym_g32", "int8_g32")
         for lay in ("gate_up", "gpt_oss", "separate") if not (f == "fp8" and lay == "gpt_oss")]


@pytest.mark.parametrize("fmt,layout", CASES)
@pytest.mark.parametrize("ranks", [1, 2])
def test_load_quantised_packs_the_checkpoint_as_it_is(fmt, layout, ranks):
    g = torch.Generator().manual_seed(5)
    q, values = _checkpoint(fmt, layout, g)
    ex = _module(fmt, layout, ranks)
    params = _tensors(layout, None, torch.Generator().manual_seed(6))
    ex.load_quantised(q, *params)
    want = _tensors(layout, values, torch.Generator().manual_seed(6))
    checked = 0
    for got, w in zip(params, want):  # the caller's tensors: the values, dequantised
        assert torch.equal(got, w)
        checked += 1
    L = E // ranks
    for i, name in enumerate(("w1", "w3", "w2")):  # the packed copies: the same values
        for e in range(E):
            got = ex._layer.packed_values(e // L, i, e % L).double()
            assert torch.equal(got, values[name][e]), (name, e)
            checked += 1
    assert checked == len(params) + 3 * E
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    fp32 = Experts(H, F, E, K, expert=ex.expert_kind, layout=layout, ranks=ranks,
                   max_tokens=32, pack_weights=False).eval()
    with torch.no_grad():
        y = ex(x, ids, w, *params)
        ref = fp32(x, ids, w, *params)
    assert torch.isfinite(y).all()
    err = ((y - ref).double().norm() / ref.double().norm()).item()
    assert err < BOUND[fmt], err
    if fmt == "fp8":  # the control: a change packs the values again (quantising them)
        with torch.no_grad():
            params[0].mul_(1.0)
            moved = ex(x, ids, w, *params)
        assert ((moved - ref).double().norm() / ref.double().norm()).item() > err
        assert not torch.equal(ex._layer.packed_values(0, 0, 0).double(), values["w1"][0])


def test_group_wise_given_in_training_mode_are_packed_at_the_first_eval_forward():
    g = torch.Generator().manual_seed(7)
    q, values = _checkpoint("int4_asym_g32", "gate_up", g)
    ex = _module("int4_asym_g32", "gate_up", 1).train()
    params = _tensors("gate_up", None, g)
    ex.load_quantised(q, *params)
    x, ids = torch.randn(3, H, generator=g), torch.tensor([[0, 1], [2, 3], [1, 3]])
    with pytest.raises(RuntimeError, match="for inference"):
        ex(x, ids, torch.ones(3, 2), *params)
    ex.eval()
    with torch.no_grad():
        ex(x, ids, torch.ones(3, 2), *params)
    for i, name in enumerate(("w1", "w3", "w2")):
        assert torch.equal(ex._layer.packed_values(0, i, 2).double(), values[name][2])


def _loaded(fmt, ranks, seed):
    """(generator, checkpoint, module, the caller's tensors holding the checkpoint's values)."""
    g = torch.Generator().manual_seed(seed)
    q, values = _checkpoint(fmt, "gate_up", g)
    return g, q, _module(fmt, "gate_up", ranks), _tensors("gate_up", values, g)


def _refused(ex, params, cases):
    """Each (tensors, error, message) refused by name, the caller's tensors unchanged."""
    before = [p.clone() for p in params]
    checked = 0
    for given, error, message in cases:
        with pytest.raises(error, match=message):
            ex.load_quantised(given, *params)
        for p, b in zip(params, before):
            assert torch.equal(p, b)
        checked += 1
    assert checked == len(cases) > 0


def test_wrong_tensors_are_named_and_nothing_is_written():
    g, q, ex, params = _loaded("fp8", 2, 8)
    cases = [
        ({"gate_up_proj": q["gate_up_proj"]}, ValueError, "'down_proj' is not given"),
        (dict(q, w1=q["down_proj"]), KeyError, "no quantised tensor 'w1'"),
        (dict(q, down_proj=q["down_proj"]._replace(q=q["down_proj"].q[:, :, :-1])),
         ValueError, "'w2'.*codes"),
        (dict(q, down_proj=(q["down_proj"].q, q["down_proj"].scales)), TypeError,
         "must be an epmoe.quantised.Quantised"),
        (dict(q, down_proj=_stack("mxfp4", E, H, F, g)), ValueError, "one format per call"),
        ({"gate_up_proj": _stack("int8_g32", E, 2 * F, H, g),
          "down_proj": _stack("int8_g32", E, H, F, g)}, ValueError,
         "pack_weights = 'auto' must name that format"),
    ]
    bad = q["down_proj"].q.view(torch.uint8).clone()
    bad[1, 2, 3] = 0x7F  # an e4m3fn NaN code: refused by the layer before anything is written
    cases.append((dict(q, down_proj=q["down_proj"]._replace(q=bad)), ValueError, "NaN"))
    _refused(ex, params, cases)
    gpt = _module("mxfp4", "gpt_oss", 1)
    fp8 = {"gate_up_proj": _stack("fp8", E, 2 * F, H, g), "down_proj": _stack("fp8", E, H, F, g)}
    with pytest.raises(ValueError, match="interleaved"):
        gpt.load_quantised(fp8, *_tensors("gpt_oss", None, g))


def test_act_order_stacks_load_in_their_inputs_order():
    # GPTQ act order (Quantised.order [n, K]: column k of each matrix is input order[k]), in
    # the fused layout: the gate's and up's halves share their matrix's order.
    g = torch.Generator().manual_seed(9)
    q, _ = _checkpoint("int4_asym_g32", "gate_up", g)
    q = {k: t._replace(order=torch.stack([torch.randperm(t.q.shape[-1], generator=g)
                                          for _ in range(E)])) for k, t in q.items()}
    values = {k: t.dequantise().double() for k, t in q.items()}
    plain = {k: t._replace(order=None).dequantise().double() for k, t in q.items()}
    assert not torch.equal(values["down_proj"], plain["down_proj"])
    ex = _module("int4_asym_g32", "gate_up", 2)
    params = _tensors("gate_up", None, g)
    ex.load_quantised(q, *params)
    assert torch.equal(params[0].double(), values["gate_up_proj"])
    assert torch.equal(params[1].double(), values["down_proj"])
    for i, want in enumerate((values["gate_up_proj"][:, :F], values["gate_up_proj"][:, F:],
                              values["down_proj"])):
        for e in range(E):
            assert torch.equal(ex._layer.packed_values(e // 2, i, e % 2).double(), want[e])
    bad = dict(q, down_proj=q["down_proj"]._replace(order=q["down_proj"].order[:, 1:]))
    with pytest.raises(ValueError, match="'w2'.*order"):
        ex.load_quantised(bad, *params)


def test_group_wise_values_are_checked_before_anything_is_written():
    _, q, ex, params = _loaded("int4_asym_g32", 1, 10)
    big = q["down_proj"].q.clone()
    big[0, 1, 2] = 16
    nan = q["down_proj"].scales.clone()
    nan[1, 0, 0] = float("nan")
    _refused(ex, params, [
        (dict(q, down_proj=q["down_proj"]._replace(q=big)), ValueError,
         r"q holds values outside \[0, 15\]"),
        (dict(q, down_proj=q["down_proj"]._replace(scales=nan)), ValueError,
         "scales must be finite")])
