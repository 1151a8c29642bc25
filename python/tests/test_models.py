# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.hf.use_epmoe / expert_parallel: whole transformers 5.23 models whose experts run in
epmoe (transformers' experts registry), against the unmodified model: greedy generate of 32
tokens (the same tokens, every step's logits within 1e-5 of max |logit|) and a training step
(every gradient), on 1 process and on 2 gloo processes with the experts split (each rank
holds E/2 experts' bytes, the rest replicated). Tiny seeded models from transformers' own
config classes; the reference runs transformers' expert loop (experts_implementation="eager")."""
import copy

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from epmoe import hf, hf_models  # noqa: E402
from ranks import run_ranks  # noqa: E402

NEW_TOKENS = 32
RTOL = 1e-5  # of the reference's largest |element|, fp32

# The fields the configs share (each config takes those it has); hidden 32, 8 experts, top-2.
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=128, num_local_experts=8, num_experts=8, n_routed_experts=8,
            num_experts_per_tok=2, moe_topk=2, n_group=2, topk_group=1, n_shared_experts=1,
            shared_expert_intermediate_size=24, first_k_dense_replace=1, kv_lora_rank=16,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False,
            norm_topk_prob=True, initializer_range=0.1)
_LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
               linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
# family: (config class, model class, fields beyond BASE). Every family whose experts are
# transformers 5's plain fused SwiGLU; their routers and shared experts stay transformers'.
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {}),
    # MLA attention: as many key/value heads as query heads
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(num_key_value_heads=4)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", _LINEAR),  # gated shared expert
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {}),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", {}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(num_key_value_heads=4)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", {}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", {}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {}),
    # experts with biases, transposed and interleaved, a clamped gate: copied (Experts' COPIED)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        layer_types=["sliding_attention", "full_attention"], sliding_window=4)),
}


# --- the models ---------------------------------------------------------------------------

def _fields(cls):
    names = set(getattr(cls, "attribute_map", {}))
    for k in cls.__mro__:
        names |= set(getattr(k, "__annotations__", {}))
    return names


def _build(family):
    """(reference model, its copy for epmoe): eval mode, seeded weights, selection biases."""
    cfg_name, model_name, extra = MODELS[family]
    C, M = getattr(transformers, cfg_name), getattr(transformers, model_name)
    kw = {k: v for k, v in BASE.items() if k in _fields(C)}
    kw.update(extra)
    torch.manual_seed(0)
    ref = M(C(**kw, experts_implementation="eager")).eval()
    with torch.no_grad():
        for name, b in ref.named_buffers():  # DeepSeek's e_score_correction_bias: not zero
            if "bias" in name and b.is_floating_point():
                b.normal_(0.0, 0.05)
    return ref, copy.deepcopy(ref)


def _prompt(batch=2, length=6):
    return torch.randint(3, BASE["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(5))


def _generate(model, ids):
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def _close(got, want, what):
    assert torch.isfinite(want).all(), f"{what}: the reference is not finite"
    scale = want.abs().max().item()
    assert scale > 0, f"{what}: the reference is all zero"
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err = (got - want).abs().max().item()
    assert err <= RTOL * scale, f"{what}: max |diff| {err:.3g} > {RTOL:g} * {scale:.3g}"


def _check_generate(family, ref, model, what, batch=2, length=6):
    ids = _prompt(batch, length)
    want_seq, want_logits = _generate(ref, ids)
    seq, logits = _generate(model, ids)
    assert seq.shape == (batch, length + NEW_TOKENS) and logits.shape == want_logits.shape, what
    assert torch.equal(seq, want_seq), f"{what}: tokens differ"
    _close(logits, want_logits, f"{what}: logits")


def _check_inference_mode(ref, model, what):
    """A forward under torch.inference_mode (no autograd at all) equals the reference's."""
    with torch.inference_mode():
        got, want = model(_prompt()).logits, ref(_prompt()).logits
    _close(got, want, f"{what}: inference_mode logits")


def _loss(model):
    ids = _prompt()
    return model(input_ids=ids, labels=ids).loss


def _train_grads(model):
    """One training step's loss and gradients (p.grad None before: a missing one fails)."""
    model.train()
    for p in model.parameters():
        p.grad = None
    loss = _loss(model)
    loss.backward()
    model.eval()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


# --- one process -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(MODELS))
def test_one_process(family):
    ref, model = _build(family)
    hf.use_epmoe(model)
    assert model.config._experts_implementation == "epmoe"
    mods = hf_models.experts_modules(model)
    assert mods and all("_epmoe" in m.__dict__ for _, m in mods)
    _check_generate(family, ref, model, f"{family}, 1 process")
    _check_inference_mode(ref, model, family)

    want_loss, want = _train_grads(ref)
    loss, got = _train_grads(model)
    _close(loss, want_loss, f"{family}: loss")
    assert set(got) == set(want)
    checked = 0
    for name, g in want.items():
        if g is None:  # a parameter the loss does not reach in the reference
            assert got[name] is None, f"{family}: {name} has a gradient only under epmoe"
            continue
        assert got[name] is not None, f"{family}: {name} has no gradient"
        _close(got[name], g, f"{family}: d {name}")
        checked += 1
    assert checked > 10 and any("experts.gate_up_proj" in n for n in want)


# --- Experts over GPT-OSS's own tensors ---------------------------------------------------------

@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_experts_gpt_oss_layout(ranks):
    """epmoe.torch.Experts(expert="gpt_oss", layout="gpt_oss") over GptOssExperts' own tensors
    (gate and up interleaved, transposed, biased; both clamps binding) against its forward and
    backward (every gradient, in its layout); again after an optimizer step changed them in
    place (the copies follow their versions); then packed in eval."""
    from epmoe.torch import Experts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    H, F, E, K, T = 16, 8, 8, 2, 13
    ref = GptOssExperts(transformers.GptOssConfig(hidden_size=H, intermediate_size=F,
                                                  num_local_experts=E, num_experts_per_tok=K))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
        ref.gate_up_proj.mul_(4.0)  # gate and up past the clamp (7) on both sides
    names = hf_models.LAYOUTS["gpt_oss"]
    mine = [torch.nn.Parameter(getattr(ref, n).detach().clone()) for n in names]
    ex = Experts(H, F, E, K, expert="gpt_oss", layout="gpt_oss", ranks=ranks, max_tokens=64)
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    a = torch.einsum("th,thf->tf", x[:, None].expand(T, K, H).reshape(-1, H),
                     ref.gate_up_proj[ids.reshape(-1)]) + ref.gate_up_proj_bias[ids.reshape(-1)]
    bound = [(a[:, 0::2] > 7).sum(), (a[:, 1::2] > 7).sum(), (a[:, 1::2] < -7).sum()]
    assert all(n > 5 for n in bound), f"clamps binding: {bound}"
    checked = 0
    for step in range(2):
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        yr = ref(xr, ids, wr)
        yr.backward(dy)
        xm, wm = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        for p in mine:
            p.grad = None
        ym = ex(xm, ids, wm, *mine)
        ym.backward(dy)
        what = f"{ranks} ranks, step {step}"
        _close(ym.detach(), yr.detach(), f"{what}: y")
        _close(xm.grad, xr.grad, f"{what}: dx")
        _close(wm.grad, wr.grad, f"{what}: dweights")
        for n, p in zip(names, mine):
            _close(p.grad, getattr(ref, n).grad, f"{what}: d {n}")
            checked += 1
        with torch.no_grad():  # the same SGD step on both, in place
            for n, p in zip(names, mine):
                q = getattr(ref, n)
                q -= 0.5 * q.grad
                p -= 0.5 * p.grad
                q.grad = None
    assert checked == 2 * len(names)
    ex.eval()
    with torch.inference_mode():
        _close(ex(x, ids, w, *mine), ref(x, ids, w), f"{ranks} ranks: y in eval, packed")


# --- two processes ---------------------------------------------------------------------------

ONE_ROW = ("mixtral", "deepseek_v3", "qwen3_next")  # also a batch of 1 (1 token per step)


def _rank(rank, world, group, families):
    """Each family on the group: bytes held, generate, and a training step's gradients."""
    torch.set_num_threads(1)  # two processes on two cores: no oversubscription
    done = []
    for family in families:
        ref, model = _build(family)
        full = hf.expert_bytes(model)
        hf.expert_parallel(model, group)
        what = f"{family}, rank {rank}"
        assert hf.expert_bytes(model) * world == full, f"{what}: expert bytes"
        held = hf.local_experts(model)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():  # replicated: the reference's tensors
            if name.rsplit(".", 1)[0] not in held:
                assert torch.equal(p, ref_params[name]), f"{what}: {name} changed"
        _check_generate(family, ref, model, what)
        if family in ONE_ROW:  # decode steps of 1 token: rank 1's share is empty
            _check_generate(family, ref, model, what + ", batch 1", batch=1, length=5)
        _check_inference_mode(ref, model, what)

        want_loss, want = _train_grads(ref)
        loss, got = _train_grads(model)
        _close(loss, want_loss, f"{what}: loss")
        for name, g in want.items():
            module = name.rsplit(".", 1)[0]
            if g is None:
                assert got[name] is None, f"{what}: {name}"
                continue
            assert got[name] is not None, f"{what}: {name} has no gradient"
            _close(got[name], g[held[module]] if module in held else g, f"{what}: d {name}")
        done.append((family, hf.expert_bytes(model), full, sorted(held.values())))
    return done


def test_two_processes():
    families = list(MODELS)
    results = run_ranks(_rank, 2, args=(families,))
    for family in families:
        per_rank = [dict((f, rest) for f, *rest in r)[family] for r in results]
        (b0, full, held0), (b1, _, held1) = per_rank
        assert b0 == b1 == full // 2, f"{family}: expert bytes {b0}, {b1} of {full}"
        for h0, h1 in zip(held0, held1):  # each experts module: the two halves
            assert sorted(h0 + h1) == list(range(len(h0) + len(h1))) and h0 != h1, family


# --- errors ---------------------------------------------------------------------------------

def test_refuses_experts_epmoe_cannot_compute():
    c = transformers.GptOssConfig(**{k: v for k, v in BASE.items()
                                     if k in _fields(transformers.GptOssConfig)},
                                  swiglu_limit=5.0)
    with pytest.raises(ValueError, match=r"limit = 5.0 \(swiglu_limit\): epmoe's gpt_oss"):
        hf.use_epmoe(transformers.GptOssForCausalLM(c))
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    c = transformers.DeepseekV4Config(hidden_size=16, intermediate_size=8, num_local_experts=4,
                                      num_experts_per_tok=2)
    with pytest.raises(ValueError, match="its own _apply_gate"):
        hf_models._check("experts", v4.DeepseekV4Experts(c))
    m = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{
        k: v for k, v in BASE.items() if k in _fields(transformers.MixtralConfig)}))
    m.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(ValueError, match="has_bias = True"):
        hf.use_epmoe(m)
    with pytest.raises(ValueError, match="no transformers 5 experts"):
        hf.use_epmoe(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2)))


def test_second_call_refused():
    _, model = _build("mixtral")
    hf.use_epmoe(model)
    with pytest.raises(ValueError, match="already runs in epmoe"):
        hf.use_epmoe(model)


def test_unswitched_module_says_how():
    ref, model = _build("mixtral")
    hf_models.register()
    model.set_experts_implementation("epmoe")
    with pytest.raises(RuntimeError, match="use_epmoe"):
        model(_prompt())
