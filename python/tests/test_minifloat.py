# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""FP8 (fp8_block) and MXFP4 expert copies (issue 37): pack_weights="fp8" / "mxfp4" within
the formats' rounding of the float64 reference, inference only; the formats' values against
torch's own float8_e4m3fn conversion and transformers' dequantisers; checkpoint tensors
loaded as they are (MoE.load_quantised, from_hf of a DeepSeek-V3 block with FP8 experts and
of GPT-OSS's MXFP4 *_blocks / *_scales)."""
import pytest
import torch
import transformers

import epmoe.hf as hf
from epmoe import _epmoe
from epmoe.quantised import Quantised, dequantise, packed_values
from epmoe.torch import MoE
from test_module import build, logical, reference, shards

FP8 = torch.float8_e4m3fn


def rel(got, want):
    got, want = got.double(), want.double().reshape(got.shape)
    assert torch.isfinite(got).all()
    return ((got - want).norm() / want.norm()).item()


# The tokens' rounding to bf16 (the AVX512-BF16 kernels), through a SwiGLU layer: 3 sqrt(6)
# 2^-7 / sqrt(12) (tests/layer/test_layer_minifloat.cpp), about 1.7e-2.
TOKENS = 3 * 6 ** 0.5 * 2 ** -7 / 12 ** 0.5


@pytest.mark.parametrize("fmt,bound", [("fp8", 0.15), ("mxfp4", 0.7)])
@pytest.mark.parametrize("ranks", [1, 2])
def test_packed_experts_within_their_rounding_of_the_reference(fmt, bound, ranks):
    moe = build("qwen2 shared, gate, bias", ranks, pack_weights=fmt).eval()
    T = 29
    x = torch.randn(T, moe.hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, _ = moe(x)
    assert moe.packed
    want = reference(moe, logical(moe), x, shards(T, ranks))["y"]
    # The format's rounding (the C++ layer test derives the bound: 0.2 for fp8, 0.9 for
    # mxfp4 at its shapes), and it shows.
    assert 1e-3 < rel(y, want) < bound
    with pytest.raises(RuntimeError, match=f"pack_weights = '{fmt}' is for inference"):
        moe.train()(x)


def test_fp8_values_are_torchs_float8_e4m3fn_conversion():
    # Quantised at pack time: per 128 x 128 block scale = amax / 448, w / scale rounded by
    # torch's own float8_e4m3fn conversion (nearest even), times the scale.
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 1, 200)  # subnormals too
    s = w.abs().reshape(3, 100, 2, 100)  # (blocks: rows 0-127, 128-255, 256-299)
    amax = torch.zeros(3, 2)
    for r in range(3):
        for c in range(2):
            amax[r, c] = w[128 * r:128 * r + 128, 128 * c:128 * c + 128].abs().max()
    scale = amax / 448
    full = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    want = (w / full).to(FP8).float() * full
    got = packed_values("fp8", w)
    assert torch.equal(got, want)
    assert (want.view(torch.int32) != 0).any() and s.numel() > 0


def test_checkpoint_values_are_torchs_and_transformers_dequantisation():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 256, (300, 200), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x42  # no NaN code
    scale_inv = torch.rand(3, 2, generator=g) * 1e-2
    got = _epmoe.dequantised("fp8", codes, scale_inv, 200)
    want = _dequantize_fp8_weight(codes.view(FP8), scale_inv, [128, 128], torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(dequantise("fp8", codes, scale_inv, 200), want)
    # MXFP4: GPT-OSS's blocks [E, rows, K / 32, 16] and scales [E, rows, K / 32].
    blocks = torch.randint(0, 256, (2, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 135, (2, 40, 4), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    for e in range(2):
        got = _epmoe.dequantised("mxfp4", blocks[e].reshape(40, 64), scales[e], 128)
        assert torch.equal(got, want[e])
    assert torch.equal(dequantise("mxfp4", blocks.reshape(2, 40, 64), scales, 128), want)
    with pytest.raises(ValueError, match="0x7f or 0xff"):
        bad = codes.clone()
        bad[7, 9] = 0xFF
        _epmoe.dequantised("fp8", bad, scale_inv, 200)
    with pytest.raises(ValueError, match="E8M0 0xff is NaN"):
        bad = scales[0].clone()
        bad[3, 1] = 0xFF
        _epmoe.dequantised("mxfp4", blocks[0].reshape(40, 64), bad, 128)


def _given(fmt, q):
    """load_quantised's tensors: {name: (codes, scales)} as Quantised stacks."""
    return {name: Quantised(fmt, c, s) for name, (c, s) in q.items()}


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_load_quantised_packs_the_codes_as_they_are(fmt, ranks):
    # Hand-made checkpoint tensors (codes below 128: a block's max is not 448, so quantising
    # their values again would move them); the module's output then differs from the same
    # weights read as fp32 by the tokens' bf16 rounding alone.
    g = torch.Generator().manual_seed(8)
    H, F, E = 160, 72, 4
    moe = MoE(H, F, E, 2, ranks=ranks, max_tokens=32, pack_weights=fmt).eval()
    shapes = {"w1": (F, H), "w3": (F, H), "w2": (H, F)}
    q = {}
    for name, (rows, cols) in shapes.items():
        if fmt == "fp8":
            codes = torch.randint(0, 0x70, (E, rows, cols), generator=g, dtype=torch.uint8)
            codes |= torch.randint(0, 2, codes.shape, generator=g, dtype=torch.uint8) << 7
            scales = 1e-3 * (1 + torch.rand(E, (rows + 127) // 128, (cols + 127) // 128,
                                             generator=g))
            q[name] = (codes.view(FP8), scales)
        else:
            nb = (cols + 31) // 32
            q[name] = (torch.randint(0, 256, (E, rows, nb * 16), generator=g, dtype=torch.uint8),
                       torch.randint(118, 126, (E, rows, nb), generator=g, dtype=torch.uint8))
    moe.load_quantised(_given(fmt, q))
    for name, (rows, cols) in shapes.items():  # the parameters: the values, dequantised
        want = dequantise(fmt, q[name][0], q[name][1], cols)[moe.expert_ids]
        assert torch.equal(getattr(moe, name).detach(), want)
    x = torch.randn(20, H, generator=g)
    with torch.no_grad():
        y, _ = moe(x)
        assert moe.packed
        fp32 = MoE(H, F, E, 2, ranks=ranks, max_tokens=32, pack_weights=True).eval()
        fp32.load_state_dict(moe.state_dict())
        want, _ = fp32(x)
    assert rel(y, want) < TOKENS
    if fmt == "fp8":  # the control: packing the values again (quantising them) moves them
        moe.pack_weights()
        with torch.no_grad():
            assert rel(moe(x)[0], want) > TOKENS
    bad = dict(q)
    if fmt == "fp8":
        codes = q["w2"][0].view(torch.uint8).clone()
        codes[1, 2, 3] = 0x7F
        bad["w2"] = (codes, q["w2"][1])
        with pytest.raises(ValueError, match="e4m3fn NaN"):
            moe.load_quantised(_given(fmt, bad))
    with pytest.raises(ValueError, match="'w1'.*codes"):
        moe.load_quantised(_given(fmt, {"w1": (q["w1"][0][:, :-1], q["w1"][1])}))
    with pytest.raises(KeyError, match="no quantised parameter 'gate'"):
        moe.load_quantised(_given(fmt, {"gate": q["w1"]}))
    with pytest.raises(ValueError, match="needs every expert this process holds"):
        moe.load_quantised({("w1", 0): Quantised(fmt, q["w1"][0][0], q["w1"][1][0])})
    # One matrix at a time (checkpoints that store each expert apart): the experts held here,
    # any order; the same packed copies and parameters as the stacks gave.
    held = moe.expert_ids.tolist()
    with torch.no_grad():
        for name in shapes:
            getattr(moe, name).fill_(float("nan"))
    moe.load_quantised({(name, e): Quantised(fmt, q[name][0][e], q[name][1][e])
                        for name in shapes for e in reversed(held)})
    checked = 0
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        want = dequantise(fmt, q[name][0], q[name][1], cols)[moe.expert_ids]
        assert torch.equal(getattr(moe, name).detach(), want)
        L = E // ranks
        for slot in range(E):
            assert torch.equal(moe._layer.packed_values(slot // L, i, slot % L), want[slot])
            checked += 1
    assert checked == 3 * E
    with torch.no_grad():
        assert torch.equal(moe(x)[0], y)
    with pytest.raises(TypeError, match="must be an epmoe.quantised.Quantised"):
        moe.load_quantised({"w1": q["w1"]})


def _tiny_deepseek_v3_fp8():
    """A DeepSeek-V3 MoE block built from its config on the CPU with transformers'
    FineGrainedFP8Config (replace_with_fp8_linear: FP8Experts, FP8Linear shared experts), its
    FP8 weights and scales filled as a checkpoint's (quantised by transformers' Fp8Quantize
    rule), and the same block unquantised with the dequantised weights."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight, replace_with_fp8_linear
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    c = transformers.DeepseekV3Config(
        hidden_size=256, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, num_hidden_layers=2, first_k_dense_replace=1,
        experts_implementation="eager")
    qc = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    c.quantization_config = qc
    torch.manual_seed(4)
    model = replace_with_fp8_linear(m.DeepseekV3ForCausalLM(c), quantization_config=qc)
    block = model.model.layers[1].mlp
    plain = m.DeepseekV3MoE(c).eval()
    sd = {}
    with torch.no_grad():
        for k, v in block.state_dict().items():
            if v.dtype == FP8:  # a weight [..., N, K] and its scale_inv [..., N/128, K/128]
                w = torch.randn(v.shape) * 0.05
                blocks = w.reshape(*w.shape[:-2], w.shape[-2] // 128, 128, w.shape[-1] // 128, 128)
                inv = blocks.abs().amax((-3, -1)) / 448
                full = inv.repeat_interleave(128, -2).repeat_interleave(128, -1)
                sd[k] = (w / full).to(FP8)
                sd[k + "_scale_inv" if not k.endswith("weight") else k + "_scale_inv"] = inv
            elif "scale_inv" not in k:
                sd[k] = torch.randn(v.shape) * 0.3
        block.load_state_dict(sd, assign=True)  # (replace_with_fp8_linear built it on meta)
        plain_sd = {}
        for k, v in sd.items():
            if "scale_inv" in k:
                continue
            plain_sd[k] = (_dequantize_fp8_weight(v, sd[k + "_scale_inv"], [128, 128],
                                                  torch.float32) if v.dtype == FP8 else v)
        plain.load_state_dict(plain_sd)
    return c, block.eval(), plain


def test_from_hf_deepseek_v3_with_fp8_experts():
    c, block, plain = _tiny_deepseek_v3_fp8()
    assert type(block.experts).__name__ == "FP8Experts"
    moe = hf.from_hf(block, ranks=2).eval()
    assert moe._pack == "fp8"
    x = torch.randn(2, 9, 256, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = plain(x)
        want = want[0] if isinstance(want, tuple) else want
        y, _ = moe(x.reshape(-1, 256))
    assert moe.packed
    # The codes as they are: the tokens' bf16 rounding alone (transformers cannot run its FP8
    # experts on the CPU: their kernel comes from the hub; the unquantised block with
    # transformers' dequantised weights is the reference).
    assert rel(y, want) < TOKENS
    routed = dequantise("fp8", block.experts.down_proj.detach(),
                        block.experts.down_proj_scale_inv.detach(), 128)
    assert torch.equal(moe.w2.detach(), routed[moe.expert_ids])
    # Codes only: the routed experts never materialised in float32, the same outputs; the
    # shared expert's FP8 weights are codes too.
    codes = hf.from_hf(block, ranks=2, values=False).eval()
    assert {n for n, _ in codes.named_parameters()} == {"gate"}
    with torch.no_grad():
        assert torch.equal(codes(x.reshape(-1, 256))[0], y)


def test_from_hf_state_dict_gpt_oss_mxfp4_blocks():
    # GPT-OSS's checkpoint tensors (transformers needs the hub's triton kernels to build its
    # Mxfp4GptOssExperts, so the tensors are made by hand with the checkpoint's names, shapes
    # and dtypes): experts.gate_up_proj_blocks [E, 2F, H / 32, 16] uint8, _scales [E, 2F,
    # H / 32] uint8, down_proj_blocks / _scales; the block's other tensors as they are.
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    E, H, F = 4, 64, 32
    c = transformers.GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=E,
                                  num_experts_per_tok=2, experts_implementation="eager")
    torch.manual_seed(3)
    plain = m.GptOssMLP(c).eval()
    g = torch.Generator().manual_seed(9)
    q = {"gate_up_proj": (torch.randint(0, 256, (E, 2 * F, H // 32, 16), generator=g,
                                        dtype=torch.uint8),
                          torch.randint(120, 127, (E, 2 * F, H // 32), generator=g, dtype=torch.uint8)),
         "down_proj": (torch.randint(0, 256, (E, H, F // 32, 16), generator=g, dtype=torch.uint8),
                       torch.randint(120, 127, (E, H, F // 32), generator=g, dtype=torch.uint8))}
    sd = {}
    with torch.no_grad():
        for k, v in plain.state_dict().items():
            name = k.split(".")[-1]
            if name in q:
                blocks, scales = q[name]
                sd[k + "_blocks"], sd[k + "_scales"] = blocks, scales
                v.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            else:
                v.normal_(0, 0.3)
                sd[k] = v.clone()
    moe = hf.from_hf_state_dict(sd, c, "gpt_oss", ranks=1).eval()
    assert moe._pack == "mxfp4"
    x = torch.randn(11, H, generator=g)
    with torch.no_grad():
        want = plain(x[None])
        want = want[0] if isinstance(want, tuple) else want
        y, _ = moe(x)
    assert moe.packed
    assert rel(y, want) < TOKENS
    # Codes only (values=False): the experts' entries are placeholders of no memory (the block
    # is never dequantised), the same outputs, no float32 weights; the biases stay values.
    from epmoe.quantised import checkpoint_tensors

    o = hf.options("gpt_oss", c)
    kept = checkpoint_tensors("gpt_oss", sd, "", o, values=False)[1]
    for k in ("experts.gate_up_proj", "experts.down_proj"):
        assert kept[k].untyped_storage().nbytes() == 4, k  # (one float, expanded)
    codes = hf.from_hf_state_dict(sd, c, "gpt_oss", ranks=2, values=False).eval()
    assert {n for n, _ in codes.named_parameters()} == {"gate", "gate_bias", "b1", "b3", "b2"}
    with torch.no_grad():
        assert torch.equal(codes(x)[0], y)
    with pytest.raises(ValueError, match="values=False.*no quantised experts"):
        hf.from_hf_state_dict(plain.state_dict(), c, "gpt_oss", ranks=1, values=False)


def _fp8_codes(w):
    """w [..., N, K] (N, K multiples of 128) as a checkpoint's e4m3 codes and scale_inv."""
    blocks = w.reshape(*w.shape[:-2], w.shape[-2] // 128, 128, w.shape[-1] // 128, 128)
    inv = blocks.abs().amax((-3, -1)) / 448
    return (w / inv.repeat_interleave(128, -2).repeat_interleave(128, -1)).to(FP8), inv


def _quantised_deepseek(expert_dtype: str, seed: int = 5):
    """A tiny DeepSeek-V3 model whose experts transformers quantised (FineGrainedFP8Config:
    "fp8", e4m3 with 128 x 128 scale_inv; or "fp4", two e2m1 a byte with a UE8M0 scale per 32
    inputs; its other Linear layers left in float32: transformers' FP8 Linear needs the hub's
    kernel), seeded codes and weights, and the unquantised model holding the codes' values
    (transformers' own dequantiser for FP4). Returns (model, plain, generator, config,
    the Linear layers' names)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, replace_with_fp8_linear
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    c = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, experts_implementation="eager")
    qc = (transformers.FineGrainedFP8Config(weight_block_size=(128, 128)) if expert_dtype == "fp8"
          else transformers.FineGrainedFP8Config(expert_dtype="fp4", scale_fmt="ue8m0"))
    torch.manual_seed(seed)
    plain = m.DeepseekV3ForCausalLM(c).eval()
    linears = [n for n, mod in plain.named_modules() if isinstance(mod, torch.nn.Linear)]
    cq = transformers.DeepseekV3Config(**c.to_dict())
    cq.quantization_config = qc
    model = replace_with_fp8_linear(m.DeepseekV3ForCausalLM(cq), modules_to_not_convert=linears,
                                    quantization_config=qc)
    g = torch.Generator().manual_seed(seed + 1)
    deq = Fp8Dequantize(None)._dequantize_one
    sd, plain_sd = {}, {}
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k.endswith("_scale_inv"):
                continue
            if v.dtype == FP8:
                codes, inv = _fp8_codes(torch.randn(v.shape, generator=g) * 0.05)
                sd[k], sd[k + "_scale_inv"] = codes, inv
                plain_sd[k] = dequantise("fp8", codes, inv, v.shape[-1])
            elif v.dtype == torch.int8:  # FP4 codes and their E8M0 scales
                codes = torch.randint(-128, 128, v.shape, generator=g, dtype=torch.int8)
                scale = torch.randint(118, 122, (*v.shape[:-1], v.shape[-1] // 16), generator=g,
                                      dtype=torch.uint8)
                sd[k], sd[k + "_scale_inv"] = codes, scale.view(torch.float8_e8m0fnu)
                plain_sd[k] = deq(codes, scale, torch.float32)
            else:
                sd[k] = plain_sd[k] = torch.randn(v.shape, generator=g) * 0.05
        model.load_state_dict(sd, assign=True)
        plain.load_state_dict(plain_sd)
    return model.eval(), plain, g, cq, linears


def test_use_epmoe_runs_a_model_with_fp8_experts():
    """epmoe.hf.use_epmoe packs FP8 experts' codes as they are, against the unquantised model
    holding their dequantised values; the codes changed in place are loaded again."""
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    model, plain, g, c8, linears = _quantised_deepseek("fp8")
    experts = model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "FP8Experts"
    hf.use_epmoe(model)
    ids = torch.randint(0, 64, (2, 9), generator=g)
    checked = 0
    for step in range(2):
        with torch.no_grad():
            got, want = model(ids).logits, plain(ids).logits
        # The codes as they are: the tokens' bf16 rounding alone, diluted by the residual.
        assert rel(got, want) < TOKENS, step
        ex = experts.__dict__["_epmoe"]["experts"]
        # Codes only: the packed codes are epmoe's one copy (no float32 values beside them).
        assert ex._pack == "fp8" and ex._state.codes == "fp8"
        assert experts.__dict__["_epmoe"]["fp8"][1] == [] and ex._state.copies is None
        assert torch.equal(ex._layer.packed_values(0, 2, 3),
                           plain.model.layers[1].mlp.experts.down_proj[3])
        checked += 1
        with torch.no_grad():  # new codes in place: loaded again at the next forward
            codes, inv = _fp8_codes(torch.randn(experts.down_proj.shape, generator=g) * 0.05)
            experts.down_proj.copy_(codes)
            experts.down_proj_scale_inv.copy_(inv)
            plain.model.layers[1].mlp.experts.down_proj.copy_(dequantise("fp8", codes, inv, 128))
    assert checked == 2
    model.train()
    with pytest.raises(RuntimeError, match="for inference"):
        model(ids)
    for field, value, message in (("weight_block_size", (64, 64), "block_size = \\(64, 64\\)"),
                                  ("activation_scheme", "static", "activation_scheme = 'static'")):
        q = transformers.FineGrainedFP8Config(**{"weight_block_size": (128, 128), field: value})
        c8.quantization_config = q
        other = replace_with_fp8_linear(m.DeepseekV3ForCausalLM(c8),
                                        modules_to_not_convert=linears, quantization_config=q)
        with pytest.raises(ValueError, match=message):
            hf.use_epmoe(other)


def test_use_epmoe_runs_fp4_experts_as_mxfp4():
    """FineGrainedFP8Config(expert_dtype="fp4") experts (DeepSeek-V4's: two e2m1 a byte, low
    nibble first, a UE8M0 scale per 32 inputs) are MXFP4: packed as they are, against the
    unquantised model holding transformers' own dequantised values."""
    model, plain, g, _, _ = _quantised_deepseek("fp4")
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == torch.int8
    hf.use_epmoe(model.eval())
    ids = torch.randint(0, 64, (2, 7), generator=g)
    with torch.no_grad():
        got, want = model(ids).logits, plain(ids).logits
    assert rel(got, want) < TOKENS
    ex = experts.__dict__["_epmoe"]["experts"]
    assert ex._pack == "mxfp4"
    checked = 0
    for i, w in enumerate((plain.model.layers[1].mlp.experts.gate_up_proj[:, :128],
                           plain.model.layers[1].mlp.experts.gate_up_proj[:, 128:],
                           plain.model.layers[1].mlp.experts.down_proj)):
        for e in range(8):
            assert torch.equal(ex._layer.packed_values(0, i, e), w[e])
            checked += 1
    assert checked == 24
    # Float32 scales (scale_fmt="float") are E8M0 when every one is a power of two.
    from epmoe import hf_models

    assert hf_models._e8m0(torch.tensor([0.25, 1.0, 2.0 ** -127, 2.0 ** 127]), "s").tolist() == \
        [125, 127, 0, 254]
    with pytest.raises(ValueError, match="not powers of two"):
        hf_models._e8m0(torch.tensor([0.25, 0.3]), "s")


def _quantised_rank(rank, world, group, dtypes):
    """Each quantised model split over the group (expert_parallel): half the codes' bytes
    each, the logits of the unquantised model, a decode step of one token too."""
    torch.set_num_threads(1)
    out = []
    for dtype in dtypes:
        model, plain, g, _, _ = _quantised_deepseek(dtype)
        full = hf.expert_bytes(model)
        hf.expert_parallel(model, group)
        errors = []
        for ids in (torch.randint(0, 64, (2, 9), generator=g), torch.tensor([[5]])):
            with torch.no_grad():
                errors.append(rel(model(ids).logits, plain(ids).logits))
        out.append((dtype, hf.expert_bytes(model), full, max(errors),
                    sorted(hf.local_experts(model).values())))
    return out


def test_expert_parallel_quantised_experts_on_two_processes():
    from ranks import run_ranks

    results = run_ranks(_quantised_rank, 2, args=(("fp8", "fp4"),))
    checked = 0
    for (d0, b0, full, e0, h0), (d1, b1, _, e1, h1) in zip(*results):
        assert d0 == d1 and b0 == b1 == full // 2, (d0, b0, b1, full)
        assert max(e0, e1) < TOKENS, (d0, e0, e1)
        assert sorted(h0[0] + h1[0]) == list(range(8)), (h0, h1)
        checked += 1
    assert checked == 2
