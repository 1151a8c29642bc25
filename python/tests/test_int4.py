# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""The group-wise formats (issue 37): MoE(..., pack_weights="int4" ...) within the format's
rounding of the float64 reference, inference only; and the loaders (epmoe.quantised): GPTQ,
AWQ and GGUF Q8_0 / Q4_K tensors made by hand (GGUF: a file written by the gguf package),
whose values in the layer's packed copies equal each format's own definition exactly."""
import numpy as np
import pytest
import torch

from epmoe.quantised import Quantised, from_awq, from_gptq, gguf_experts
from epmoe.torch import MoE
from test_module import build, logical, reference, shards

FORMATS = ["int4", "int4_g128", "int4_asym", "int4_asym_g128", "int8_g32"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ranks", [1, 2])
def test_group_formats_within_their_rounding_of_the_reference(fmt, ranks):
    moe = build("qwen2 shared, gate, bias", ranks, pack_weights=fmt).eval()
    T = 29
    x = torch.randn(T, moe.hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, _ = moe(x)
    assert moe.packed
    want = reference(moe, logical(moe), x, shards(T, ranks))["y"].reshape(y.shape).double()
    err = ((y.double() - want).norm() / want.norm()).item()
    # The formats' rounding (tests/layer/test_layer_int4.cpp derives the bounds: int4 about
    # 1/15 of each weight row's rms per GEMM, int8 1/254), and it shows.
    lo, hi = (1e-4, 5e-2) if fmt == "int8_g32" else (1e-2, 0.4)
    assert lo < err < hi, err


def test_group_formats_are_refused_in_training_mode_and_named_when_wrong():
    moe = build("mixtral", 1, pack_weights="int4_asym")
    x = torch.randn(5, moe.hidden)
    with pytest.raises(RuntimeError, match="pack_weights = 'int4_asym' is for inference"):
        moe(x)
    moe.eval()
    y, _ = moe(x)
    assert torch.isfinite(y).all()
    for bad in ("int4_g", "int4_asym_128", "int8_g", "uint4"):
        with pytest.raises(ValueError, match=f"pack_weights = '{bad}': must be"):
            MoE(16, 8, 4, 2, pack_weights=bad, ranks=1)
    with pytest.raises(Exception, match=r"pack_weights\(int4\)\.group.*multiple of 32"):
        build("mixtral", 1, pack_weights="int4_g48").eval()(x)


# --- loaders ---------------------------------------------------------------------------------

H, F, E = 64, 96, 4  # K a multiple of 32 (GPTQ, AWQ) and of 256 for Q4_K: below


def _pack_rows(v: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight: 4-bit values [K, N] -> int32 [K / 8, N], input 8r + i at bits 4i."""
    K, N = v.shape
    out = torch.zeros(K // 8, N, dtype=torch.int64)
    for i in range(8):
        out |= v[i::8].to(torch.int64) << (4 * i)
    return out.to(torch.int32)  # (wraps to negative where bit 31 is set, as checkpoints do)


def _pack_cols(v: torch.Tensor, order=range(8)) -> torch.Tensor:
    """4-bit values [R, N] -> int32 [R, N / 8], nibble i of word c holding column 8c +
    order[i] (GPTQ's qzeros: 0..7; AWQ: [0, 2, 4, 6, 1, 3, 5, 7])."""
    R, N = v.shape
    out = torch.zeros(R, N // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        out |= v[:, col::8].to(torch.int64) << (4 * i)
    return out.to(torch.int32)


def _checkpoint(N, K, group, seed):
    """q [K, N] in 0..15, zero points [G, N] in 0..15, float16 scales [G, N] (some negative,
    some zero)."""
    g = torch.Generator().manual_seed(seed)
    G = K // group
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (G, N), generator=g)
    s = (torch.randn(G, N, generator=g) * 0.02).half()
    s[0, 0] = 0
    return q, z, s


def _definition(q, z, s, group):
    """w [N, K] = s (q - z) in float64 (a float16 scale times a 5-bit integer: exact in fp32)."""
    sk = s.double().repeat_interleave(group, dim=0)
    zk = z.double().repeat_interleave(group, dim=0)
    return (sk * (q.double() - zk)).t()


def _module(fmt, ranks=2):
    torch.manual_seed(0)
    return MoE(H, F, E, 2, ranks=ranks, pack_weights=fmt, max_tokens=16).eval()


def _check_loaded(moe, given, bound=0.05):
    """The layer's packed copies of `given` ({(name, expert): w [N, K] float64}) hold exactly
    w, and the parameters too; a forward is within `bound` of the reference (W4A8's token
    rounding when every matrix is given; the others are the module's own quantisation)."""
    names = ["w1", "w3", "w2"]
    L = moe.experts // moe.ranks
    for (name, expert), want in given.items():
        got = moe._layer.packed_values(expert // L, names.index(name), expert % L)
        assert torch.equal(got.double(), want), (name, expert)
        assert torch.equal(getattr(moe, name)[expert].double(), want)
    x = torch.randn(7, moe.hidden, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y, _ = moe(x)
    want = reference(moe, logical(moe), x, shards(7, moe.ranks))["y"].reshape(y.shape).double()
    assert ((y.double() - want).norm() / want.norm()).item() < bound


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_tensors_load_exactly(checkpoint_format):
    moe = _module("int4_asym_g32")
    given = {}
    for e in range(E):
        for name, (N, K) in (("w1", (F, H)), ("w3", (F, H)), ("w2", (H, F))):
            q, z, s = _checkpoint(N, K, 32, 10 * e + len(name) + K)
            stored = (z - 1) & 15 if checkpoint_format == "gptq" else z  # v1: z - 1
            if checkpoint_format == "gptq":
                z = stored + 1  # (z = 0 is stored as 15 and read as 16: v1's known overflow)
            t = from_gptq(_pack_rows(q), _pack_cols(stored), s,
                          g_idx=torch.arange(K, dtype=torch.int32) // 32,
                          checkpoint_format=checkpoint_format)
            assert t.format == "int4_asym_g32" and t.q.dtype == torch.int8
            want = _definition(q, z, s, 32)
            assert torch.equal(t.dequantise().double(), want)
            given[(name, e)] = (t, want)
    moe.load_quantised({k: t for k, (t, _) in given.items()})
    _check_loaded(moe, {k: w for k, (_, w) in given.items()})


def test_gptq_act_order_tensors_load_exactly():
    # Act order (desc_act): input k belongs to group g_idx[k], each group K / G inputs spread
    # over K (GPTQ quantised them in order of the Hessian's diagonal); the packed copies hold
    # w[n, k] = s[g_idx[k], n] (q[k, n] - z[g_idx[k], n]) exactly, and a forward within the
    # tokens' rounding.
    moe = _module("int4_asym_g32")
    given = {}
    for e in range(E):
        for name, (N, K) in (("w1", (F, H)), ("w3", (F, H)), ("w2", (H, F))):
            q, z, s = _checkpoint(N, K, 32, 20 * e + len(name) + K)
            perm = torch.randperm(K, generator=torch.Generator().manual_seed(e + K))
            g_idx = torch.empty(K, dtype=torch.int32)
            g_idx[perm] = (torch.arange(K) // 32).to(torch.int32)
            t = from_gptq(_pack_rows(q), _pack_cols(z), s, g_idx=g_idx,
                          checkpoint_format="gptq_v2")
            assert t.order is not None and t.order.shape == (K,)
            g = g_idx.long()
            want = (s.double()[g] * (q.double() - z.double()[g])).t()
            assert torch.equal(t.dequantise().double(), want)
            given[(name, e)] = (t, want)
    moe.load_quantised({k: t for k, (t, _) in given.items()})
    _check_loaded(moe, {k: w for k, (_, w) in given.items()})
    # The same tensors with the order dropped are other weights: the forward moves.
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y, _ = moe(x)
        moe.load_quantised({k: t._replace(order=None) for k, (t, _) in given.items()})
        assert not torch.allclose(moe(x)[0], y, rtol=0.05, atol=0)


def test_gptq_act_order_and_wrong_formats_are_refused():
    q, z, s = _checkpoint(F, H, 32, 1)
    g_idx = torch.arange(H) // 32
    g_idx[0] = 1  # group 1 holds 33 inputs
    with pytest.raises(ValueError, match="g_idx puts other than K / G = 32 inputs in a group"):
        from_gptq(_pack_rows(q), _pack_cols(z), s, g_idx=g_idx)
    t = from_gptq(_pack_rows(q), _pack_cols(z), s, g_idx=torch.arange(H).flip(0) // 32)
    with pytest.raises(ValueError, match=r"order has shape \(63,\)"):
        _module("int4_asym_g32").load_quantised({("w1", 0): t._replace(order=t.order[1:])})
    with pytest.raises(ValueError, match="checkpoint_format = 'exllama'"):
        from_gptq(_pack_rows(q), _pack_cols(z), s, checkpoint_format="exllama")
    t = from_gptq(_pack_rows(q), _pack_cols(z), s)
    moe = _module("int4_asym_g128")
    with pytest.raises(ValueError, match=r"int4_asym_g32: pack_weights = 'int4_asym_g128' must"):
        moe.load_quantised({("w1", 0): t})
    with pytest.raises(ValueError, match="'w4' is not an expert tensor"):
        moe.load_quantised({("w4", 0): t})


def test_awq_tensors_load_exactly():
    moe = _module("int4_asym_g32", ranks=1)
    given = {}
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order
    for e in range(E):
        for name, (N, K) in (("w1", (F, H)), ("w3", (F, H)), ("w2", (H, F))):
            q, z, s = _checkpoint(N, K, 32, 100 + 10 * e + len(name) + K)
            t = from_awq(_pack_cols(q, order), _pack_cols(z, order), s)
            want = _definition(q, z, s, 32)
            assert torch.equal(t.dequantise().double(), want)
            given[(name, e)] = (t, want)
    # Reading AWQ's words in plain order mixes the columns up: the order matters here.
    q, z, s = _checkpoint(F, H, 32, 7)
    plain = from_awq(_pack_cols(q), _pack_cols(z), s)
    assert not torch.equal(plain.dequantise().double(), _definition(q, z, s, 32))
    moe.load_quantised({k: t for k, (t, _) in given.items()})
    _check_loaded(moe, {k: w for k, (_, w) in given.items()})


def _q4_k_blocks(n_blocks, seed):
    """Random Q4_K super-blocks (144 bytes): finite float16 d and dmin, any scales and nibbles."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, 144), dtype=np.uint8)
    d = (rng.standard_normal(n_blocks) * 1e-3).astype(np.float16)
    dmin = (rng.standard_normal(n_blocks) * 1e-3).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    return blocks


def test_gguf_q8_0_and_q4_k_files_load_exactly(tmp_path):
    gguf = pytest.importorskip("gguf")
    Q8, Q4K = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K
    Hk = Fk = 256  # Q4_K's super-blocks of 256 inputs
    rng = np.random.default_rng(5)
    path = str(tmp_path / "experts.gguf")
    w = gguf.GGUFWriter(path, "qwen2moe")
    q8 = gguf.quants.quantize(rng.standard_normal((E, F, H)).astype(np.float32), Q8)
    w.add_tensor("blk.0.ffn_gate_exps.weight", q8, raw_dtype=Q8)  # [E, F, H] as Q8_0
    w.add_tensor("blk.1.ffn_gate_exps.weight", _q4_k_blocks(E * Fk * Hk // 256, 6).reshape(
        E, Fk, Hk // 256 * 144), raw_dtype=Q4K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for name, fmt, hidden, ffn in (("blk.0.ffn_gate_exps.weight", "int8_g32", H, F),
                                   ("blk.1.ffn_gate_exps.weight", "int4_asym_g32", Hk, Fk)):
        t = tensors[name]
        experts = gguf_experts(t)
        want = gguf.quants.dequantize(t.data, t.tensor_type)  # [E, N, K]: the format's own
        assert len(experts) == E and all(x.format == fmt for x in experts)
        for e, x in enumerate(experts):
            assert torch.equal(x.dequantise(), torch.from_numpy(want[e].copy())), (name, e)
        torch.manual_seed(0)
        moe = MoE(hidden, ffn, E, 2, ranks=2, pack_weights=fmt, max_tokens=16).eval()
        moe.load_quantised({("w1", e): x for e, x in enumerate(experts)})
        _check_loaded(moe, {("w1", e): torch.from_numpy(want[e].copy()).double()
                            for e in range(E)}, bound=0.3)  # (w3, w2: epmoe's int4 or int8)


def test_loaded_values_are_dropped_when_the_parameters_change():
    moe = _module("int4_asym_g32", ranks=1)
    q, z, s = _checkpoint(F, H, 32, 3)
    t = from_gptq(_pack_rows(q), _pack_cols(z), s, checkpoint_format="gptq_v2")
    moe.load_quantised({("w1", 1): t})
    assert torch.equal(moe._layer.packed_values(0, 0, 1).double(), _definition(q, z, s, 32))
    with torch.no_grad():
        moe.w1[1].mul_(0.5)  # a new value: packed again from the parameters
        moe(torch.randn(3, H))
    got = moe._layer.packed_values(0, 0, 1)
    mine = Quantised("int4_asym_g32", *_quantise_like_epmoe(moe.w1[1].detach()))
    assert torch.equal(got, mine.dequantise())


def _quantise_like_epmoe(w):
    """int4_asym's own quantisation (reference::group_weights::quantise), groups of 32."""
    g = w.double().reshape(w.shape[0], -1, 32)
    lo, hi = g.min(-1).values, g.max(-1).values
    step = (hi - lo) / 15
    q = torch.where(step[..., None] > 0, ((g - lo[..., None]) / step[..., None]).round(), 0)
    return (q.clamp(0, 15).reshape(w.shape).to(torch.int8), step.float(), lo.float())
