# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""The transformers 5.23 MoE blocks test_hf.py checks epmoe against: a tiny seeded config and
block of each family (_make), its shapes and token ids (B, S, H, VOCAB, TOKENS)."""
import torch
import transformers

B, S, H = 2, 12, 32  # 24 tokens
VOCAB = 50  # DeepSeek-V4's hash layers: token ids in [0, VOCAB)
TOKENS = torch.randint(0, VOCAB, (B * S,), generator=torch.Generator().manual_seed(7))

# The blocks' experts run transformers' reference loop (the others are faster, not truer).
EAGER = dict(experts_implementation="eager")

# --- the families: a tiny seeded config and block each ------------------------------------

def _mod(family):
    import importlib

    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _make(family, variant=None):
    """(config, block, shared_mlp or None) of a family, weights drawn from a fixed seed
    (several blocks leave theirs uninitialised: torch.empty)."""
    T = transformers
    torch.manual_seed(1234)
    shared_mlp = None
    if family == "mixtral":
        c = T.MixtralConfig(hidden_size=H, intermediate_size=24, num_local_experts=4,
                            num_experts_per_tok=2, **EAGER)
        b = _mod(family).MixtralSparseMoeBlock(c)
    elif family == "qwen2_moe":
        c = T.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=16, num_experts=4,
                             num_experts_per_tok=2, shared_expert_intermediate_size=40,
                             norm_topk_prob=False, **EAGER)
        b = _mod(family).Qwen2MoeSparseMoeBlock(c)
    elif family == "qwen3_moe":  # norm_topk_prob = True (Qwen3's checkpoints set it)
        c = T.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=16, num_experts=8,
                             num_experts_per_tok=4, norm_topk_prob=True, **EAGER)
        b = _mod(family).Qwen3MoeSparseMoeBlock(c)
    elif family == "olmoe":  # norm_topk_prob = True: the renormalised router
        c = T.OlmoeConfig(hidden_size=H, intermediate_size=16, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, **EAGER)
        b = _mod(family).OlmoeSparseMoeBlock(c)
    elif family == "jamba":
        c = T.JambaConfig(hidden_size=H, intermediate_size=16, num_experts=4,
                          num_experts_per_tok=2, **EAGER)
        b = _mod(family).JambaSparseMoeBlock(c)
    elif family == "dbrx":  # variant: moe_normalize_expert_weights (1: DBRX's, 2: a p-norm)
        c = T.DbrxConfig(d_model=H, ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4,
                                                   moe_top_k=2,
                                                   moe_normalize_expert_weights=variant))
        b = _mod(family).DbrxFFN(c)
    elif family in ("granitemoe", "granitemoeshared"):
        if family == "granitemoe":
            c = T.GraniteMoeConfig(hidden_size=H, intermediate_size=16, num_local_experts=4,
                                   num_experts_per_tok=2, **EAGER)
            b = _mod(family).GraniteMoeMoE(c)
        else:
            c = T.GraniteMoeSharedConfig(hidden_size=H, intermediate_size=16,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         shared_intermediate_size=24, **EAGER)
            b = _mod(family).GraniteMoeSharedMoE(c)
            shared_mlp = _mod(family).GraniteMoeSharedMLP(c)
    elif family == "jetmoe":
        c = T.JetMoeConfig(hidden_size=H, intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2)
        b = _mod(family).JetMoeMoE(c)
    elif family == "aria":  # Aria's own K = 6 (of 64); 2 shared experts
        c = T.AriaTextConfig(hidden_size=H, intermediate_size=16, moe_num_experts=8,
                             moe_topk=6, moe_num_shared_experts=2, **EAGER)
        b = _mod(family).AriaTextMoELayer(c)
    elif family == "phimoe":
        c = T.PhimoeConfig(hidden_size=H, intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2, router_jitter_noise=0.01, **EAGER)
        b = _mod(family).PhimoeSparseMoeBlock(c)
    elif family == "switch_transformers":  # expert_capacity >= S: HF drops nothing
        c = T.SwitchTransformersConfig(d_model=H, d_ff=16, num_experts=4, expert_capacity=S)
        b = _mod(family).SwitchTransformersSparseMLP(c)
    elif family == "nllb_moe":  # moe_token_dropout = 0.2: eval scales expert outputs by 0.8
        c = T.NllbMoeConfig(d_model=H, encoder_ffn_dim=16, decoder_ffn_dim=16, num_experts=4,
                            moe_token_dropout=0.2)
        b = _mod(family).NllbMoeSparseMLP(c, ffn_dim=16)
    elif family in FUSED_CONFIGS:
        cfg, cls, kw = FUSED_CONFIGS[family]
        kw = dict(kw, **(variant or {}))
        c = getattr(T, cfg)(hidden_size=H, **kw, **EAGER)
        b = getattr(_mod(family), cls)(c)
        if family == "granitemoehybrid":  # the decoder layer's shared MLP, beside the block
            shared_mlp = _mod(family).GraniteMoeHybridMLP(c)
    elif family == "gpt_oss":  # a router bias; gate and up interleaved; clamped at 7
        c = T.GptOssConfig(hidden_size=H, intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2, **EAGER)
        b = _mod(family).GptOssMLP(c)
    elif family == "deepseek_v4":  # layer 0 a hash_moe layer (variant "hash"), layer 1 top-k
        c = T.DeepseekV4Config(hidden_size=H, moe_intermediate_size=16, n_routed_experts=8,
                               num_experts_per_tok=2, routed_scaling_factor=1.5,
                               vocab_size=VOCAB, num_hidden_layers=2,
                               mlp_layer_types=["hash_moe", "moe"], **EAGER)
        b = _mod(family).DeepseekV4SparseMoeBlock(c, 0 if variant == "hash" else 1)
    elif family == "longcat_flash":  # 4 routed + 2 zero (identity) experts, scaling 2.5
        c = T.LongcatFlashConfig(hidden_size=H, expert_ffn_hidden_size=16, n_routed_experts=4,
                                 zero_expert_num=2, moe_topk=2, routed_scaling_factor=2.5,
                                 **EAGER)
        b = _mod(family).LongcatFlashMoE(c)
    elif family == "llama4":  # top-1 (Scout and Maverick), a shared expert
        c = T.Llama4TextConfig(hidden_size=H, intermediate_size=16, num_local_experts=4,
                               num_experts_per_tok=1, **EAGER)
        b = _mod(family).Llama4TextMoe(c)
    else:
        raise AssertionError(family)
    modules = [b] + ([shared_mlp] if shared_mlp is not None else [])
    with torch.no_grad():
        for m in modules:
            for _, p in sorted(m.named_parameters()):
                p.normal_(0.0, 0.3)
            for _, buf in sorted(m.named_buffers()):  # DeepSeek-V3's selection bias
                if buf.is_floating_point():
                    buf.normal_(0.0, 0.3)
            m.eval()
        if family == "gpt_oss":  # gate and up values past the clamp (7) on both sides
            b.experts.gate_up_proj.mul_(4.0)
        if family == "deepseek_v4":  # past the clamp (10) on both sides; a valid tid2eid
            b.experts.gate_up_proj.mul_(5.0)
            b.shared_experts.gate_proj.weight.mul_(5.0)
            b.shared_experts.up_proj.weight.mul_(5.0)
            if b.is_hash:
                g = torch.Generator().manual_seed(5)
                b.gate.tid2eid.copy_(torch.stack([torch.randperm(8, generator=g)[:2]
                                                  for _ in range(VOCAB)]))
        if family == "longcat_flash":
            # The zero experts' gate_up_proj rows are never read (nn.Identity): zeros, as
            # epmoe.hf writes them back. A selection bias of the probabilities' size.
            b.experts.gate_up_proj[b.experts.num_routed_experts:] = 0
            b.router.e_score_correction_bias.mul_(0.2)
    return c, b, shared_mlp


# transformers 5 families read through epmoe/hf_fused.py: config class, block class, fields.
_DSV3 = dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
             topk_group=1, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True)
_QNEXT = dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
              shared_expert_intermediate_size=24)
FUSED_CONFIGS = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3MoE", _DSV3),
    # GLM-4.5's own: one group, no renormalisation here (its checkpoints renormalise), K = 4
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeMoE", dict(
        _DSV3, n_group=1, topk_group=1, num_experts_per_tok=4, norm_topk_prob=False,
        n_shared_experts=1, routed_scaling_factor=1.5)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteMoE", dict(
        _DSV3, n_group=4, topk_group=2, num_experts_per_tok=4)),
    "dots1": ("Dots1Config", "Dots1MoE", _DSV3),
    "solar_open": ("SolarOpenConfig", "SolarOpenMoE", _DSV3),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearMoE", dict(_DSV3, num_experts=8)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32MoE", _DSV3),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaMoE", dict(_DSV3, n_group=4, topk_group=2)),
    "axk2": ("AXK2Config", "AXK2MoE", dict(_DSV3, n_group=4, topk_group=2)),
    "beam": ("BeamConfig", "BeamMoE", dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridMoE", dict(
        _DSV3, num_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4)),
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashMoE", dict(
        _DSV3, n_shared_experts=None, norm_topk_prob=False)),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeSparseMoEBlock", dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=8, n_group=1, topk_group=1,
        num_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2Moe", dict(
        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
        topk_group=2, topk_method="group_limited_greedy", n_shared_experts=1,
        routed_scaling_factor=16.0)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextSparseMoeBlock", dict(_QNEXT, norm_topk_prob=True)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeSparseMoeBlock", _QNEXT),
    "minimax": ("MiniMaxConfig", "MiniMaxSparseMoeBlock", dict(
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2SparseMoeBlock", dict(
        intermediate_size=16, num_local_experts=8, num_experts_per_tok=4)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1Moe", dict(
        intermediate_size=16, num_experts=4, moe_topk=2)),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoSparseMoeBlock", dict(
        intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    "mellum": ("MellumConfig", "MellumSparseMoeBlock", dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridMoE", dict(
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=24, mamba_n_heads=8, mamba_d_head=8)),
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAMoE", dict(
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    "afmoe": ("AfmoeConfig", "AfmoeSparseMoeBlock", dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=4, num_shared_experts=2,
        route_scale=2.0)),
    "hy_v3": ("HYV3Config", "HYV3MoE", dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
        router_scaling_factor=2.5)),
    "laguna": ("LagunaConfig", "LagunaSparseMoeBlock", dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=24, moe_routed_scaling_factor=1.5,
        moe_router_logit_softcapping=0.0)),
    "flint": ("FlintConfig", "FlintSparseMoeBlock", dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=24, norm_topk_prob=True)),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeSparseMoeBlock", dict(
        intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
    # transformers 5.23's scored routers: softmax + bias / clamp(sum, moe_norm_min); sigmoid +
    # expert_bias / (sum + 1e-6), scaled; top-k of logits + bias, sigmoid weights
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeSparseMoeBlock", dict(
        moe_intermediate_size=16, moe_num_experts=8, moe_k=2, moe_num_shared_experts=2)),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeSparseMoeBlock", dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=4, norm_topk_prob=True,
        routed_scaling_factor=1.5)),
    "kolibri1": ("Kolibri1Config", "Kolibri1SparseMoeBlock", dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=24, norm_topk_prob=True)),
}
_COHERE_SIGMOID = dict(expert_selection_fn="sigmoid", norm_topk_prob=True, num_shared_experts=1,
                       shared_expert_combination_strategy="sum")
