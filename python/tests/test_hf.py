# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.hf: every transformers 5 MoE block family loaded into epmoe.torch.MoE, against the
block itself: outputs, dx and every parameter's gradient (in Hugging Face's names and
layouts) on one process, on 2 thread ranks and on 2 gloo processes; bad state dicts and
configs. The blocks run in eval mode (no jitter, dropout or random routing: the regime in
which HF and epmoe compute the same function, docs/pytorch.md), their experts through
transformers' own loop (experts_implementation="eager")."""
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from epmoe import hf  # noqa: E402
from epmoe.torch import EXPERT_TENSORS, MoE  # noqa: E402
from ranks import run_ranks  # noqa: E402

from hf_blocks import (B, FUSED_CONFIGS, H, S, TOKENS, _COHERE_SIGMOID,  # noqa: E402
                       _make)

RTOL, ATOL = 1e-5, 1e-5  # fp32; ATOL is relative to the compared tensor's largest element


def close(got, want, what):
    """Every element within fp32 tolerance; NaN/Inf anywhere fails, and so does an all-zero
    reference (the comparison would prove nothing)."""
    want = want.detach()
    assert torch.isfinite(want).all(), f"{what}: the HF reference is not finite"
    scale = want.abs().max().item()
    assert scale > 0, f"{what}: the HF reference is all zero"
    torch.testing.assert_close(got.detach(), want, rtol=RTOL, atol=ATOL * scale,
                               msg=lambda m: f"{what}: {m}")


def _hf_params(block, shared_mlp):
    """The block's parameters by state-dict name (the shared MLP under shared_mlp.)."""
    out = dict(block.named_parameters())
    if shared_mlp is not None:
        out.update({"shared_mlp." + k: p for k, p in shared_mlp.named_parameters()})
    return out


def _hf_state(block, shared_mlp):
    """The block's state dict (parameters and buffers; the shared MLP under shared_mlp.)."""
    out = dict(block.state_dict())
    if shared_mlp is not None:
        out.update({"shared_mlp." + k: v for k, v in shared_mlp.state_dict().items()})
    return out


def _nllb_reference(block, x3):
    """NLLB-MoE's block in transformers 5.23 mixes up its experts (NllbMoeExperts.forward
    one-hot encodes the router's one-hot top-1 mask: every token runs expert_1 with its top-1
    weight and expert_0 with its top-2 weight, whatever it was routed to). The reference is
    therefore HF's router and HF's expert modules, combined as the router's weights say:
    y = sum over experts e of p[t, e] * (1 - moe_token_dropout) * expert_e(x) (eval)."""
    x = x3.reshape(-1, x3.shape[-1])
    _, probs, _ = block.router(x)
    scale = 1.0 - block.experts.moe_token_dropout
    y = sum(probs[:, e, None] * block.experts[f"expert_{e}"](x) for e in range(probs.shape[1]))
    return (y * scale).view_as(x3)


def _token_kw(block):
    """The token ids a DeepSeek-V4 hash layer routes by (HF's input_ids), as MoE's argument."""
    return dict(token_ids=TOKENS) if getattr(block, "is_hash", False) else {}


def _hf_forward(family, block, shared_mlp, x3):
    if getattr(block, "is_hash", False):
        out = block(x3, input_ids=TOKENS.view(B, S))
    else:
        out = _nllb_reference(block, x3) if family == "nllb_moe" else block(x3)
    y = (out[0] if isinstance(out, tuple) else out).reshape(x3.shape)  # Llama 4's: [T, H]
    if shared_mlp is not None:  # GraniteMoE-shared's decoder layer adds its shared MLP
        y = y + shared_mlp(x3)
    return y


def _hf_run(family, block, shared_mlp, x, dy, train):
    """HF's y, dx and parameter gradients (by state-dict name) of (y * dy).sum()."""
    x3 = x.view(B, S, H).clone().requires_grad_(train)
    y = _hf_forward(family, block, shared_mlp, x3)
    if not train:
        return y.detach().reshape(-1, H), None, None
    params = {k: p for k, p in _hf_params(block, shared_mlp).items() if p.requires_grad}
    for p in params.values():  # a frozen selection bias (AFMoE, Laguna) has none
        p.grad = None
    (y * dy.view(B, S, H)).sum().backward()
    return (y.detach().reshape(-1, H), x3.grad.reshape(-1, H),
            {k: p.grad.clone() for k, p in params.items()})


def _inputs():
    g = torch.Generator().manual_seed(99)
    return torch.randn(B * S, H, generator=g), torch.randn(B * S, H, generator=g)


def _all_experts_chosen(family, config, sd, x):
    """Every expert is some token's choice (else its weights would be untested)."""
    t = hf.logical_tensors(family, sd, config)
    gate = t["gate"]
    k = hf.options(family, config)["top_k"]
    if "router_table" in t:  # DeepSeek-V4's hash layers: the table chooses
        chosen = set(t["router_table"][TOKENS].flatten().tolist())
        assert chosen == set(range(gate.shape[0])), f"{family}: experts {chosen} chosen"
        return
    logits = x @ gate.t() + t.get("gate_bias", torch.zeros(gate.shape[0]))
    chosen = set(logits.topk(k, dim=-1).indices.flatten().tolist())
    assert chosen == set(range(gate.shape[0])), f"{family}: experts {chosen} chosen: pick a seed"


# (family, variant, trains): every family of hf.FAMILIES; PhiMoE's sparsemixer is forward only.
FAMILY_CASES = [
    ("mixtral", None, True), ("qwen2_moe", None, True), ("qwen3_moe", None, True),
    ("olmoe", None, True),
    ("jamba", None, True), ("dbrx", 1.0, True), ("dbrx", 2.0, True), ("granitemoe", None, True),
    ("granitemoeshared", None, True), ("jetmoe", None, True), ("aria", None, True),
    ("phimoe", None, False), ("switch_transformers", None, True), ("nllb_moe", None, True),
    ("gpt_oss", None, True), ("longcat_flash", None, True), ("llama4", None, True),
] + [(f, None, True) for f in FUSED_CONFIGS] + [
    ("cohere2_moe", _COHERE_SIGMOID, True),
    ("cohere2_moe", dict(_COHERE_SIGMOID, expert_selection_fn="softmax",
                         shared_expert_combination_strategy="average"), True),
    ("ernie4_5_moe", dict(moe_norm_min=0.7), True),  # the clamp binds for most tokens
    ("lfm2_moe", dict(norm_topk_prob=False, use_expert_bias=False), True),
    ("kolibri1", dict(norm_topk_prob=False), True),
    ("deepseek_v4", None, True), ("deepseek_v4", "hash", True)]


def _case_id(f, v):
    if isinstance(v, dict) and "expert_selection_fn" not in v:
        return "-".join([f] + [f"{k}={x}" for k, x in v.items()])
    if isinstance(v, str):
        return f"{f}-{v}"
    if isinstance(v, dict):
        return "-".join([f, v["expert_selection_fn"], v["shared_expert_combination_strategy"]])
    return f + ("" if v is None else f"-p{v:g}")


def test_every_family_has_a_case():
    assert {f for f, _, _ in FAMILY_CASES} == set(hf.FAMILIES.values())


@pytest.mark.parametrize("family,variant,train", FAMILY_CASES,
                         ids=[_case_id(f, v) for f, v, _ in FAMILY_CASES])
def test_family_equals_hf(family, variant, train):
    config, block, shared_mlp = _make(family, variant)
    assert hf.family_of(block) == family
    x, dy = _inputs()
    sd = _hf_state(block, shared_mlp)  # with buffers: DeepSeek-V3's selection bias
    _all_experts_chosen(family, config, sd, x)

    # The state dict survives logical_tensors -> hf_state_dict unchanged (NLLB's folded
    # scale is a multiply then a divide: within an ulp).
    back = hf.hf_state_dict(family, hf.logical_tensors(family, sd, config), config)
    assert set(back) == set(sd)
    for k in sd:
        torch.testing.assert_close(back[k], sd[k], rtol=1e-6 if family == "nllb_moe" else 0,
                                   atol=0, msg=lambda m: f"{family} round trip {k}: {m}")

    moe = MoE.from_hf(block, shared_mlp=shared_mlp)
    assert moe.bundle["top_k"] == hf.options(family, config)["top_k"]
    want_y, want_dx, want_grads = _hf_run(family, block, shared_mlp, x, dy, train)
    xe = x.clone().requires_grad_(train)
    y, _ = moe(xe, **_token_kw(block))
    close(y, want_y, f"{family}: y")
    if not train:
        return
    (y * dy).sum().backward()
    close(xe.grad, want_dx, f"{family}: dx")
    got = hf.hf_state_dict(family, hf.module_tensors(moe, grad=True), config, gradients=True)
    assert set(got) == set(want_grads), f"{family}: gradient names differ"
    for k in want_grads:
        close(got[k], want_grads[k], f"{family}: d {k}")


def test_lfm2_eps_binds():
    """LFM2-MoE's 1e-6 in the renormalising sum where it shows: logits near -12 (scores
    ~6e-6, their sum ~2e-5), so the weights move by ~4% with it; y, dx and every gradient."""
    config, block, _ = _make("lfm2_moe")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        block.gate.weight.copy_(-12.0 / H + 0.02 * torch.randn(block.gate.weight.shape, generator=g))
    x = 1.0 + 0.1 * torch.randn(B * S, H, generator=g)
    dy = torch.randn(B * S, H, generator=g)
    s = torch.sigmoid(x @ block.gate.weight.t()).topk(4, dim=-1).values.sum(-1)
    assert (1e-6 / s).min() > 0.02, "the sum must be small enough for the eps to show"
    moe = MoE.from_hf(block)
    want_y, want_dx, want_grads = _hf_run("lfm2_moe", block, None, x, dy, True)
    xe = x.clone().requires_grad_()
    y, _ = moe(xe)
    (y * dy).sum().backward()
    close(y, want_y, "lfm2 eps: y")
    close(xe.grad, want_dx, "lfm2 eps: dx")
    got = hf.hf_state_dict("lfm2_moe", hf.module_tensors(moe, grad=True), config, gradients=True)
    assert set(got) == set(want_grads)
    for k in want_grads:
        close(got[k], want_grads[k], f"lfm2 eps: d {k}")


def test_state_dict_path_with_prefix_equals_from_hf():
    """from_hf_state_dict on a model-style state dict (keys under a prefix, with or without
    its final dot; the real config) builds the same module as from_hf."""
    config, block, _ = _make("qwen2_moe")
    sd = {"model.layers.3.mlp." + k: v for k, v in block.state_dict().items()}
    sd["model.layers.3.input_layernorm.weight"] = torch.ones(H)  # other keys are ignored
    x, _ = _inputs()
    yb = hf.from_hf(block)(x)[0]
    for prefix in ("model.layers.3.mlp.", "model.layers.3.mlp"):
        ya = MoE.from_hf_state_dict(sd, config, "qwen2_moe", prefix=prefix)(x)[0]
        assert torch.isfinite(ya).all() and torch.equal(ya, yb), prefix


def test_nllb_block_width_from_its_weights():
    """An NLLB-MoE config whose encoder and decoder widths differ: the state-dict path takes
    the block's width from its fc1 rows (options alone asks for ffn=)."""
    config, block, _ = _make("nllb_moe")
    config.decoder_ffn_dim = 8  # the block is an encoder block (16)
    x, _ = _inputs()
    moe = hf.from_hf_state_dict(block.state_dict(), config, "nllb_moe")
    assert moe.ffn == 16
    close(moe(x)[0], _hf_run("nllb_moe", block, None, x, None, False)[0], "nllb width: y")


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "longcat_flash", "llama4"])
def test_thread_ranks(family):
    """from_hf(ranks=2): two thread ranks (12 tokens each), experts placed round robin (the
    slots are not in logical order), equal HF's block."""
    config, block, _ = _make(family)
    x, dy = _inputs()
    moe = hf.from_hf(block, ranks=2, placement="round_robin")
    assert moe.ranks == 2 and moe.expert_ids.tolist() == [0, 2, 1, 3]
    want_y, want_dx, want_grads = _hf_run(family, block, None, x, dy, True)
    xe = x.clone().requires_grad_()
    y, _ = moe(xe)
    (y * dy).sum().backward()
    close(y, want_y, "ranks=2: y")
    close(xe.grad, want_dx, "ranks=2: dx")
    got = hf.hf_state_dict(family, hf.module_tensors(moe, grad=True), config, gradients=True)
    assert set(got) == set(want_grads)
    for k in want_grads:
        close(got[k], want_grads[k], f"ranks=2: d {k}")


# --- 2 processes ----------------------------------------------------------------------------

def _two_ranks(rank, world, group, cases):
    """Each family's module on the group, this rank's slice of the batch, against HF's
    results (compared here: tensors sent back from a process that has exited cannot be
    received). Returns the (HF parameter name, expert row or None) pairs compared."""
    checked = {}
    for label, family, sd, config, x, dy, (want_y, want_dx, want_grads) in cases:
        n = x.shape[0] // world
        rows = slice(rank * n, (rank + 1) * n)
        moe = hf.from_hf_state_dict(sd, config, family, group=group)
        held = moe.expert_ids.tolist()
        assert len(held) == moe.experts // world
        xr = x[rows].clone().requires_grad_()
        tokens = dict(token_ids=TOKENS[rows]) if "gate.tid2eid" in sd else {}
        y, _ = moe(xr, **tokens)
        (y * dy[rows]).sum().backward()
        what = f"{family} rank {rank}"
        close(y, want_y[rows], f"{what}: y")
        close(xr.grad, want_dx[rows], f"{what}: dx")
        # Logical-order gradients: the experts this rank does not hold are NaN (a gradient
        # read from one would fail); the replicated ones (gate, shared) cover this rank's
        # tokens: summed over the ranks.
        logical = {}
        for name, p in moe.named_parameters():
            g = p.grad.clone()
            if name in EXPERT_TENSORS[moe.expert_kind]:
                full = torch.full((moe.experts,) + tuple(g.shape[1:]), float("nan"))
                full[held] = g
                g = full
            else:
                dist.all_reduce(g, group=group)
            logical[name] = g
        got = hf.hf_state_dict(family, logical, config, gradients=True)
        checked[label] = []
        others = [e for e in range(moe.experts) if e not in held]
        for k, w in want_grads.items():
            if k.startswith("experts."):  # fused [E, ...]: the held experts' rows, others NaN
                assert torch.isnan(got[k][others]).all(), f"{what}: {k} mixes experts' rows"
                close(got[k][held], w[held], f"{what}: d {k} rows {held}")
                checked[label] += [(k, e) for e in held]
            else:
                close(got[k], w, f"{what}: d {k}")
                checked[label].append((k, None))
    return checked


def test_two_processes():
    """Mixtral, Qwen2-MoE, DeepSeek-V3 (sigmoid, bias, groups, shared experts), Qwen3-Next
    (gated shared expert), GPT-OSS, ERNIE 4.5, LFM2-MoE, Kolibri, DeepSeek-V4 (top-k and hash),
    LongCat-Flash (zero experts) and Llama 4 (score-scaled input, a shared expert) on 2 gloo
    processes, experts split: each rank's y and dx equal HF's rows, its experts' gradients HF's,
    the gate's (and shared) summed over ranks HF's."""
    families = ["mixtral", "qwen2_moe", "deepseek_v3", "qwen3_next", "gpt_oss", "ernie4_5_moe",
                "lfm2_moe", "kolibri1", "deepseek_v4", ("deepseek_v4", "hash"), "longcat_flash",
                "llama4"]
    x, dy = _inputs()
    cases = []
    for family in families:
        family, variant = family if isinstance(family, tuple) else (family, None)
        label = _case_id(family, variant)
        config, block, _ = _make(family, variant)
        sd = {k: v.clone() for k, v in block.state_dict().items()}
        cases.append((label, family, sd, config, x, dy,
                      _hf_run(family, block, None, x, dy, True)))
    results = run_ranks(_two_ranks, 2, args=(cases,))
    for family, *_, (_, _, want_grads) in cases:  # family: the case's label
        per_rank = [set(r[family]) for r in results]
        E = want_grads["experts.down_proj"].shape[0]
        every = {(k, e if k.startswith("experts.") else None)
                 for k in want_grads for e in range(E)}
        assert set.union(*per_rank) == every, f"{family}: not every parameter compared"
        experts = [{k for k in keys if k[1] is not None} for keys in per_rank]
        assert experts[0] and experts[1] and not experts[0] & experts[1], f"{family}: split"


# --- errors ---------------------------------------------------------------------------------

def test_longcat_flash_zero_experts_send_no_rows():
    """LongCat-Flash's zero experts: the module counts them apart (zero_expert_assignments),
    the rows it sends are the real experts' picks only, and a token that picks only zero
    experts gets (sum of its weights) * x."""
    config, block, _ = _make("longcat_flash")
    x, _ = _inputs()
    moe = MoE.from_hf(block)
    assert moe.zero_experts == 2 and tuple(moe.gate.shape) == (6, H)
    y, _ = moe(x)
    st = moe.stats()
    p = (x @ moe.gate.detach().t()).softmax(-1)
    picks = (p + block.router.e_score_correction_bias).topk(2, dim=-1).indices
    zero = int((picks >= 4).sum())
    assert zero > 0 and st["zero_expert_assignments"] == zero
    assert st["assignments"] == picks.numel() - zero == sum(st["rows_sent"])
    only_zero = (picks >= 4).all(-1)
    assert only_zero.any(), "pick a seed with a token on zero experts only"
    w = p.gather(1, picks) * 2.5
    close(y[only_zero], (w.sum(-1, keepdim=True) * x)[only_zero], "zero experts only: y")


def test_zero_experts_and_llama4_arguments_named():
    """MoE's rules for zero experts and the llama4 router, each naming the argument."""
    kw = dict(hidden=8, ffn=8, experts=4, max_tokens=8)
    with pytest.raises(ValueError, match="zero_experts = -1"):
        MoE(**kw, top_k=2, router="longcat_flash", zero_experts=-1)
    with pytest.raises(ValueError, match="router_bias has 4 values"):
        MoE(**kw, top_k=2, router="longcat_flash", zero_experts=2, router_bias=[0.0] * 4)
    with pytest.raises(ValueError, match="normalize = True"):
        MoE(**kw, top_k=1, router="llama4", normalize=True)
    with pytest.raises(ValueError, match="exchange=dedup"):  # not in the menu: two scales a row
        MoE(**kw, top_k=1, router="llama4", exchange="dedup")
    moe = MoE(**kw, top_k=2, router="longcat_flash", zero_experts=2, router_bias=[0.0] * 6)
    assert tuple(moe.gate.shape) == (6, 8) and "zero_experts=2" in repr(moe)


def test_missing_key_names_it():
    config, block, _ = _make("mixtral")
    prefix = "model.layers.0.block_sparse_moe."
    sd = {prefix + k: v for k, v in block.state_dict().items()}
    del sd[prefix + "experts.gate_up_proj"]
    with pytest.raises(KeyError, match=r"'model\.layers\.0\.block_sparse_moe\.experts\.gate_up_proj'"):
        hf.from_hf_state_dict(sd, config, "mixtral", prefix=prefix)
    # GraniteMoE-shared's shared MLP is the block's sibling: its full key is named.
    config, block, _ = _make("granitemoeshared")
    prefix = "model.layers.2.block_sparse_moe."
    sd = {prefix + k: v for k, v in block.state_dict().items()}
    with pytest.raises(KeyError, match=r"'model\.layers\.2\.shared_mlp\.input_linear\.weight'"):
        hf.from_hf_state_dict(sd, config, "granitemoeshared", prefix=prefix)


@pytest.mark.parametrize("family,key,shape", [
    ("mixtral", "experts.down_proj", (4, 24, H)),         # transposed
    ("dbrx", "experts.mlp.w2", (4 * 16, H + 1)),
    ("jetmoe", "input_linear.weight", (4, 16, H)),       # not fused [E, 2F, H]
    ("aria", "experts.gate_up_proj", (8, H, 16)),         # holds 2F columns
    ("qwen3_moe", "experts.gate_up_proj", (8, 2 * 16, H + 1)),
    ("qwen2_moe", "shared_expert_gate.weight", (H,)),
])
def test_wrong_shape_names_key_and_shapes(family, key, shape):
    config, block, _ = _make(family, 1.0 if family == "dbrx" else None)
    sd = dict(block.state_dict())
    want = tuple(sd[key].shape)
    sd[key] = torch.zeros(shape)
    with pytest.raises(ValueError) as e:
        hf.from_hf_state_dict(sd, config, family)
    msg = str(e.value)
    assert repr(key) in msg and str(tuple(shape)) in msg and str(want) in msg, msg


def test_unknown_block_and_family():
    with pytest.raises(TypeError, match="MixtralSparseMoeBlock.*Qwen2MoeSparseMoeBlock"):
        hf.family_of(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="Linear"):
        hf.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="family = 'zaya'"):  # a block epmoe does not load
        hf.from_hf_state_dict({}, {}, "zaya")


@pytest.mark.parametrize("family,change,field", [
    ("nllb_moe", dict(second_expert_policy="random"), "second_expert_policy"),
    ("switch_transformers", dict(dense_act_fn="gelu"), "dense_act_fn"),
    ("switch_transformers", dict(router_bias=True), "router_bias"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act"),
    ("aria", dict(mlp_bias=True), "mlp_bias"),
    ("nllb_moe", dict(decoder_ffn_dim=8), "decoder_ffn_dim"),
    ("cohere2_moe", dict(num_shared_experts=1, shared_expert_combination_strategy="max"),
     "shared_expert_combination_strategy"),
    ("cohere2_moe", dict(expert_selection_fn="relu"), "expert_selection_fn"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method"),
    ("hunyuan_v1_moe", dict(moe_topk=[2, 2]), "num_experts_per_tok|moe_topk"),
    ("deepseek_v3", dict(hidden_act="gelu"), "hidden_act"),
    ("laguna", dict(moe_router_logit_softcapping=30.0), "moe_router_logit_softcapping"),
])
def test_unsupported_config_names_field(family, change, field):
    config, _, _ = _make(family)
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(ValueError, match=field):
        hf.options(family, config)


def test_axk2_group_mask_and_light_checkpoints():
    """A.X-K2 scores a dropped group's experts 0.0 (its grouped checkpoints); the Light ones
    have no groups (n_group = topk_group = None). The 0.0 itself cannot be checked against the
    block: when it matters, several dropped experts tie at 0.0 and torch.topk picks among them
    in no specified order (test_layer_routers checks both masks against the formula)."""
    config, _, _ = _make("axk2")
    o = hf.options("axk2", config)
    assert (o["groups"], o["top_groups"], o["group_mask"]) == (4, 2, "zero")
    config.n_group = config.topk_group = None
    o = hf.options("axk2", config)
    assert (o["groups"], o["top_groups"]) == (1, 1)


def test_missing_config_field_names_it():
    with pytest.raises(ValueError, match="'num_local_experts'"):
        hf.options("mixtral", dict(hidden_size=H, intermediate_size=8, num_experts_per_tok=2,
                                   hidden_act="silu"))


def test_overrides_reach_the_module():
    config, block, _ = _make("mixtral")
    moe = hf.from_hf(block, capacity="factor", capacity_factor=8.0, schedule="pipelined")
    assert moe.bundle["capacity"] == "factor" and moe.bundle["schedule"] == "pipelined"
    x, _ = _inputs()
    close(moe(x)[0], _hf_run("mixtral", block, None, x, None, False)[0], "factor 8: y")


def test_gpt_oss_clamps_bind_and_interleave():
    """The GPT-OSS case exercises both clamps (gate above, up on both sides), and a loader
    that swapped gate and up (or dropped the +1) would differ: the block's own gate is not
    symmetric in them."""
    config, block, _ = _make("gpt_oss")
    x, _ = _inputs()
    e = block.experts
    gate_up = x @ e.gate_up_proj[0] + e.gate_up_proj_bias[0]
    g, u = gate_up[:, ::2], gate_up[:, 1::2]
    assert (g > e.limit).any() and (u > e.limit).any() and (u < -e.limit).any()
    assert ((g <= e.limit) & (u.abs() <= e.limit)).any()
    swapped = e._apply_gate(torch.stack([u, g], -1).flatten(-2))
    assert not torch.allclose(swapped, e._apply_gate(gate_up))


def test_gpt_oss_other_limit_is_named():
    config, block, _ = _make("gpt_oss")
    block.experts.limit = 10.0
    with pytest.raises(ValueError, match="swiglu_limit"):
        hf.from_hf(block)
