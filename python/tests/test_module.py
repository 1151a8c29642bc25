# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""epmoe.torch.MoE against the repository's float64 reference (include/epmoe/reference),
forward and backward, on thread ranks and on 2 gloo processes; bad inputs; the stats dict."""
import pytest
import torch

from epmoe import _epmoe
from epmoe.torch import EXPERT_TENSORS, MoE
from ranks import RankFailed, run_ranks

H, F = 16, 24


def logical(moe: MoE) -> dict:
    """The module's parameters in the reference's (logical expert) order."""
    out = {}
    for name in moe._param_names:
        p = getattr(moe, name).detach()
        if name in EXPERT_TENSORS[moe.expert_kind]:
            full = torch.full((moe.experts,) + tuple(p.shape[1:]), float("nan"))
            full[moe.expert_ids] = p
            p = full
        out[name] = p
    return out


def reference(moe: MoE, weights: dict, x, tokens_per_rank, dy=None, scales=(0.0, 0.0, 0.0)):
    return _epmoe.reference(moe.bundle, moe.config, moe.phy_to_log, moe.router_args, moe.ranks,
                            weights, x, list(tokens_per_rank), dy, *scales)


def shards(T, R):
    return [T * (r + 1) // R - T * r // R for r in range(R)]


def close(got, want, what, scale=None, tol=2e-5):
    """Every element within fp32 tolerance (or tol) of the float64 value; NaN or Inf fails."""
    got, want = got.double(), want.double().reshape(got.shape)
    assert torch.isfinite(got).all(), f"{what}: not finite"
    scale = scale or max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item() / scale
    assert err < tol, f"{what}: max error {err:.3g} (relative to {scale:.3g})"


CASES = {
    "mixtral": dict(experts=8, top_k=2),
    "qwen2 shared, gate, bias": dict(experts=8, top_k=4, router="softmax_raw", shared_experts=2,
                                     shared_ffn=20, shared_gate=True, output_bias=True),
    "deepseek sigmoid groups": dict(experts=8, top_k=4, router="sigmoid_bias", groups=4,
                                    top_groups=2, scaling=2.5, shared_experts=1,
                                    router_bias=[0.1 * (e % 3) - 0.1 for e in range(8)]),
    "capacity factor drops": dict(experts=8, top_k=2, capacity="factor", capacity_factor=0.5),
    "padded capacity": dict(experts=8, top_k=2, capacity="padded", capacity_factor=1.5),
    "pipelined": dict(experts=8, top_k=2, schedule="pipelined", chunks=3),
    "receive rounds": dict(experts=8, top_k=2, max_recv_rows=6),  # exchanges in rounds
    "mlp with biases": dict(experts=8, top_k=2, expert="mlp_relu_bias"),
    "switch top-1": dict(experts=8, top_k=1, router="softmax_raw", expert="mlp_relu",
                         capacity="factor", capacity_factor=1.0),
    "round robin": dict(experts=8, top_k=2, placement="round_robin"),
    "permuted table": dict(experts=8, top_k=2, placement=[3, 1, 7, 5, 0, 2, 6, 4]),
    "dedup": dict(experts=8, top_k=2, exchange="dedup"),
    # Nodes of 2 ranks (of min(2, ranks)): one row per (token, node) between them.
    "hierarchical": dict(experts=8, top_k=2, exchange="hierarchical", ranks_per_node=2),
    "hierarchical pipelined rounds": dict(experts=8, top_k=2, exchange="hierarchical",
                                          ranks_per_node=2, schedule="pipelined", chunks=2,
                                          max_recv_rows=24),  # windows of 2 tokens
    "hierarchical, a node per rank": dict(experts=8, top_k=2, exchange="hierarchical",
                                          ranks_per_node=1),
    # GPT-OSS: the logit bias (a parameter) and the clamped SwiGLU with biases.
    "gpt_oss": dict(experts=8, top_k=4, router="gpt_oss", expert="gpt_oss"),
    "deepseek hierarchical": dict(experts=8, top_k=4, router="sigmoid_bias", groups=4,
                                  top_groups=2, scaling=2.5, exchange="hierarchical",
                                  ranks_per_node=2),
}


def build(case, ranks, seed=0, **kw):
    """The module of a case; packed expert weights (in train mode too) unless kw says else."""
    torch.manual_seed(seed)
    args = {**CASES[case], "pack_weights": True, **kw}
    if "ranks_per_node" in args:  # nodes must divide the ranks
        args["ranks_per_node"] = min(args["ranks_per_node"], ranks)
    moe = MoE(H, F, **args, ranks=ranks, max_tokens=64)
    g = torch.Generator().manual_seed(seed + 1)
    moe.reset_parameters(generator=g)
    with torch.no_grad():  # nonzero biases, so their gradients and values are checked
        for name in ("b1", "b2", "shared_b1", "shared_b2", "output_bias"):
            if hasattr(moe, name):
                getattr(moe, name).uniform_(-0.5, 0.5, generator=g)
    return moe


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_forward_backward_equal_the_reference(case, ranks):
    moe = build(case, ranks)
    T = 23
    torch.manual_seed(5)
    x = torch.randn(T, H, requires_grad=True)
    dy = torch.randn(T, H)
    y, losses = moe(x)
    scales = (0.7, 0.0, 0.05)  # dL/d aux, seq_aux, z
    loss = (y * dy).sum() + scales[0] * losses.aux + scales[2] * losses.z
    loss.backward()
    ref = reference(moe, logical(moe), x.detach(), shards(T, ranks), dy,
                    tuple(s / ranks for s in scales))  # the module's losses: the ranks' mean
    close(y.detach(), ref["y"], "y")
    got_losses = torch.tensor([losses.aux.item(), losses.seq_aux.item(), losses.z.item()])
    want_losses = torch.tensor(ref["losses"]).mean(0)
    close(got_losses, want_losses, "losses")
    close(x.grad, ref["grads"]["x"], "dx")
    checked = 0
    for name in moe._param_names:
        p = getattr(moe, name)
        want = ref["grads"][name].reshape((-1,) + tuple(p.shape[1:]) if name in
                                          EXPERT_TENSORS[moe.expert_kind] else p.shape)
        if name in EXPERT_TENSORS[moe.expert_kind]:
            want = want[moe.expert_ids]
        close(p.grad, want, f"d{name}", scale=max(1.0, want.abs().max().item()))
        checked += 1
    assert checked == len(moe._param_names) >= 3


def test_every_row_is_written():
    """The raw layer call writes every row of y (NaN before the call fails)."""
    moe = build("mixtral", 2)
    x = torch.randn(17, H)
    y = torch.full((17, H), float("nan"))
    moe._layer.forward(x, y)
    assert torch.isfinite(y).all()
    close(y, reference(moe, logical(moe), x, shards(17, 2))["y"], "y")


def test_sparsemixer_forward_only():
    moe = build("mixtral", 2, router="sparsemixer", jitter_eps=0.05)
    x = torch.randn(11, H)
    with torch.no_grad():
        y, _ = moe(x)
    close(y, reference(moe, logical(moe), x, shards(11, 2))["y"], "y")
    y, _ = moe(x.requires_grad_())
    with pytest.raises(ValueError, match="no backward"):
        y.sum().backward()


def test_a_temporary_input_stays_alive_for_backward():
    """The layer's backward reads x again (the gate's dW); a temporary x (moe(norm(x))) freed
    after forward, its memory reused, must not change the gradients."""
    moe = build("mixtral", 2)
    x = torch.randn(40, H, requires_grad=True)
    dy = torch.randn(40, H)
    y, _ = moe(x * 1.0)  # the layer's input is a temporary
    clobber = [torch.full((40, H), 7.0) for _ in range(8)]  # reuse freed memory
    (y * dy).sum().backward()
    ref = reference(moe, logical(moe), x.detach(), shards(40, 2), dy)
    close(moe.gate.grad, ref["grads"]["gate"], "dgate")
    close(x.grad, ref["grads"]["x"], "dx")
    assert len(clobber) == 8


def test_x_changed_in_place_after_forward_raises():
    moe = build("mixtral", 1)
    x = torch.randn(5, H, requires_grad=True)
    xin = x * 1.0
    y, _ = moe(xin)
    xin.add_(1.0)  # the layer's backward would read the changed rows
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("ranks", [1, 2])
def test_fused_grad_accumulation_equals_autograds(ranks):
    """Gradients written into p.grad (added when it exists, a kept buffer when None) equal
    autograd's own accumulation over steps, with and without zero_grad in between."""
    a = build("qwen2 shared, gate, bias", ranks)
    b = build("qwen2 shared, gate, bias", ranks, fuse_grad_accumulation=True)
    checked = 0
    for step, reset in enumerate([None, None, "none", "zero", None]):
        for m in (a, b):
            if reset:
                m.zero_grad(set_to_none=reset == "none")
        torch.manual_seed(step)
        x = torch.randn(19, H)
        dy = torch.randn(19, H)
        for m in (a, b):
            y, losses = m(x)
            ((y * dy).sum() + 0.3 * losses.aux).backward()
        for name in a._param_names:
            ga, gb = getattr(a, name).grad, getattr(b, name).grad
            assert torch.isfinite(gb).all()
            assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-6), (step, name)
            checked += 1
    assert checked == 5 * len(a._param_names)


def test_backward_of_an_older_forward_raises():
    moe = build("mixtral", 1)
    x = torch.randn(5, H, requires_grad=True)
    y1, _ = moe(x)
    y2, _ = moe(x)
    with pytest.raises(RuntimeError, match="not the layer's last"):
        y1.sum().backward(retain_graph=True)
    y2.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_a_non_contiguous_gradient():
    """A dense dy that is not contiguous ((y.t() * w).sum(): dy = w.t()) gives the reference's
    gradients (dx used to keep dy's strides and be refused: "dx is not contiguous")."""
    moe = build("qwen2 shared, gate, bias", 2)
    torch.manual_seed(3)
    x = torch.randn(21, H, requires_grad=True)
    w = torch.randn(H, 21)
    y, _ = moe(x)
    (y.t() * w).sum().backward()
    dy = w.t().contiguous()
    ref = reference(moe, logical(moe), x.detach(), shards(21, 2), dy)
    close(x.grad, ref["grads"]["x"], "dx")
    for name in moe._param_names:
        p = getattr(moe, name)
        routed = name in EXPERT_TENSORS[moe.expert_kind]
        want = ref["grads"][name].reshape((-1,) + tuple(p.shape[1:]) if routed else p.shape)
        close(p.grad, want[moe.expert_ids] if routed else want, f"d{name}")


def test_double_backward_raises():
    """The layer's backward is not differentiable: a gradient of its gradient raises instead
    of silently leaving out the MoE's part (here x's own x² term would still flow)."""
    moe = build("mixtral", 2)
    x = torch.randn(9, H, requires_grad=True)
    y, _ = moe(x)
    (g,) = torch.autograd.grad(y.square().sum() + x.square().sum(), x, create_graph=True)
    assert torch.isfinite(g).all()  # the first backward itself runs
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def forward_equals_reference(moe, x, what):
    """moe(x) (no grad) against the reference over the module's parameters now."""
    with torch.no_grad():
        y, _ = moe(x)
    close(y, reference(moe, logical(moe), x, shards(x.shape[0], moe.ranks))["y"], what)
    return y


def test_a_replaced_parameter_is_used():
    moe = build("mixtral", 2)
    moe.w1 = torch.nn.Parameter(moe.w1.detach() * 2)  # a new tensor, not an in-place update
    forward_equals_reference(moe, torch.randn(9, H), "y after the swap")


def test_an_optimizer_step_is_packed_again():
    """The packed expert copies follow an in-place update (torch's version counter)."""
    moe = build("qwen2 shared, gate, bias", 2)
    x = torch.randn(11, H)
    y, _ = moe(x)
    y.square().sum().backward()
    torch.optim.SGD(moe.parameters(), lr=0.5).step()
    forward_equals_reference(moe, x, "y after the step")


def test_a_write_through_data_needs_pack_weights():
    moe = build("mixtral", 1)
    x = torch.randn(7, H)
    with torch.no_grad():
        before, _ = moe(x)
        moe.w2.data.mul_(-1)  # bypasses the version counter: the packed copies are kept
        stale, _ = moe(x)
        assert torch.equal(stale, before)
    moe.pack_weights()
    close(forward_equals_reference(moe, x, "y after pack_weights"), -before, "y negated")


def test_bf16_packed_copies_compute_with_rounded_experts():
    moe = build("qwen2 shared, gate, bias", 2, pack_weights="bf16")
    x = torch.randn(13, H)
    with torch.no_grad():
        y, _ = moe(x)
    w = logical(moe)
    kinds = EXPERT_TENSORS[moe.expert_kind]
    rounded = {k: (v.bfloat16().float() if k in kinds or k[len("shared_"):] in kinds else v)
               for k, v in w.items()}
    # AVX512-BF16 multiplies bf16 by bf16: the experts' inputs are rounded too.
    dot = _epmoe.cpu_kernel() == "AVX512-BF16"
    close(y, reference(moe, rounded, x, shards(13, 2))["y"], "y (bf16 experts)",
          tol=1e-2 if dot else 2e-5)
    err = (y - reference(moe, w, x, shards(13, 2))["y"].reshape(y.shape)).abs().max().item()
    assert 1e-6 < err < 2e-2 * max(1.0, y.abs().max().item())  # bf16's rounding, and only it
    with pytest.raises(ValueError, match="pack_weights = 'fp16': must be 'auto'"):
        build("mixtral", 1, pack_weights="fp16")


def test_auto_packs_in_eval_mode_only():
    moe = build("mixtral", 2, pack_weights="auto")
    x = torch.randn(5, H)
    moe.train()
    forward_equals_reference(moe, x, "y in train mode")
    assert not moe.packed
    moe.eval()
    forward_equals_reference(moe, x, "y in eval mode")
    assert moe.packed
    moe.train()
    moe.w2.data.mul_(-1)  # read directly again in train mode: seen without pack_weights()
    forward_equals_reference(moe, x, "y in train mode again")
    assert not moe.packed


def test_pack_weights_off_reads_the_tensors():
    moe = build("mixtral", 2, pack_weights=False)
    moe.w2.data.mul_(-1)
    forward_equals_reference(moe, torch.randn(7, H), "y unpacked")


def test_unknown_choices_list_the_menu():
    with pytest.raises(ValueError, match="the menu has:(.|\n)*router=softmax top_k=2"):
        MoE(H, F, 8, 3)
    with pytest.raises(ValueError, match="expert = 'geglu'"):
        MoE(H, F, 8, 2, expert="geglu")
    with pytest.raises(ValueError, match="experts = 6: must be a multiple"):
        MoE(H, F, 6, 2, ranks=4)


@pytest.mark.parametrize("bad,why", [
    (lambda x: x.double(), "x has dtype Double: must be torch.float32"),
    (lambda x: x[:, :-1].contiguous(), "x"),
    (lambda x: x.int(), "x has dtype Int: must be torch.float32"),
    (lambda x: torch.zeros(129, H), "max_tokens"),  # 2 ranks of at most 64
])
def test_bad_inputs_raise_and_the_layer_goes_on(bad, why):
    moe = build("mixtral", 2)
    x = torch.randn(16, H)
    with pytest.raises((TypeError, ValueError), match=why):
        moe(bad(x))
    y, _ = moe(x)  # nothing was lost: the next pass runs
    assert torch.isfinite(y).all()


def test_strided_half_and_meta_inputs():
    """A strided x is copied, bf16/fp16 ones (autocast's) are computed in float32 and returned
    in their dtype; a meta tensor gets its shape (the custom op's fake implementation) and
    runs no pass."""
    moe = build("mixtral", 2)
    x = torch.randn(H, 16).t()  # [16, H], not contiguous
    y, _ = moe(x.contiguous())
    ys, _ = moe(x)
    assert torch.equal(ys, y) and ys.dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        yh, _ = moe(x.to(dtype))
        assert yh.dtype == dtype and torch.isfinite(yh).all()
        ref, _ = moe(x.to(dtype).float())
        assert torch.equal(yh, ref.to(dtype))
    passes = moe._passes
    ym, _ = moe(x.to("meta"))
    assert ym.device.type == "meta" and ym.shape == x.shape and moe._passes == passes


def test_global_load_and_the_bias_update():
    moe = build("deepseek sigmoid groups", 2, bias_update=0.01)
    x = torch.randn(30, H)
    moe(x)
    per_expert, per_rank = moe.global_load()
    routed = sum(torch.tensor(s["routed_per_expert"]) for s in moe.all_stats())
    assert torch.equal(per_expert, routed) and int(per_expert.sum()) == 30 * 4
    computed = [sum(s["rows_per_local_expert"]) for s in moe.all_stats()]
    assert per_rank.tolist() == computed
    before = moe.router_bias.clone()
    moe.update_router_bias()
    step = 0.01 * torch.sign(per_expert.double().mean() - per_expert.double()).float()
    assert torch.allclose(moe.router_bias, before + step, atol=1e-7)
    with torch.no_grad():  # the next pass routes with the new bias
        y, _ = moe(x)
    moe.router_args["bias"] = moe.router_bias.tolist()
    close(y, reference(moe, logical(moe), x, shards(30, 2))["y"], "y with the updated bias")
    with pytest.raises(ValueError, match="no bias to update"):
        build("mixtral", 1).update_router_bias()


def test_stats_dict():
    moe = build("capacity factor drops", 2)
    moe(torch.randn(30, H))
    s = moe.stats()
    assert s["tokens"] == 15 and s["assignments"] == 30
    assert len(s["routed_per_expert"]) == 8 and sum(s["routed_per_expert"]) == 30
    assert len(s["rows_sent"]) == 2 and len(s["rows_per_local_expert"]) == 4
    assert s["dropped"] > 0 and s["capacity"] is not None
    assert set(s["time"]) >= {"route", "dispatch", "experts", "combine", "total"}
    assert len(moe.all_stats()) == 2


# --- two processes (gloo) ----------------------------------------------------------------

def _two_ranks(rank, world, group, case, tokens):
    import torch
    from epmoe.torch import MoE
    torch.manual_seed(0)
    full = build(case, 1)  # every rank builds the same full module, then keeps its slots
    moe = MoE(H, F, **CASES[case], group=group, max_tokens=64)
    moe.load_logical(logical(full))
    torch.manual_seed(7)
    x_all = torch.randn(sum(tokens), H)
    dy_all = torch.randn(sum(tokens), H)
    a = sum(tokens[:rank])
    x = x_all[a:a + tokens[rank]].clone().requires_grad_()
    y, losses = moe(x)
    ((y * dy_all[a:a + tokens[rank]]).sum() + 0.5 * losses.aux).backward()
    ref = reference(moe, logical(full), x_all, tokens, dy_all, (0.5, 0.0, 0.0))
    close(y.detach(), ref["y"][a:a + tokens[rank]], "y")
    close(x.grad, ref["grads"]["x"].reshape(-1, H)[a:a + tokens[rank]], "dx")
    for name in EXPERT_TENSORS[moe.expert_kind]:
        want = ref["grads"][name].reshape((full.experts,) + tuple(getattr(moe, name).shape[1:]))
        close(getattr(moe, name).grad, want[moe.expert_ids], f"d{name}")
    moe.allreduce_replicated_grads()  # replicated: the ranks' shares summed
    for p in moe.replicated_parameters():
        name = next(n for n in moe._param_names if getattr(moe, n) is p)
        close(p.grad, ref["grads"][name], f"d{name} (summed)")
    return moe.stats()


@pytest.mark.parametrize("case", ["mixtral", "qwen2 shared, gate, bias", "pipelined",
                                  "receive rounds"])
def test_two_processes_equal_the_reference(case):
    stats = run_ranks(_two_ranks, 2, args=(case, [7, 12]))
    rows = [s["rows_sent"] for s in stats]
    assert sum(rows[0]) == 7 * CASES[case]["top_k"] and sum(rows[1]) == 12 * CASES[case]["top_k"]


@pytest.mark.parametrize("case", ["dedup", "hierarchical, a node per rank"])
def test_two_processes_dedup_and_hierarchical(case):
    """Fewer rows than assignments (one per (token, rank) or (token, node)); the hierarchical
    exchange's node rows are the only rows between the two nodes, at most one per token."""
    tokens = [7, 12]
    stats = run_ranks(_two_ranks, 2, args=(case, tokens))
    for s, T in zip(stats, tokens):
        assert 0 < sum(s["rows_sent"]) <= T * CASES[case]["top_k"]
        assert s["inter_node"]["rows_sent"] <= T
        if case != "dedup":
            assert s["ranks_per_node"] == 1 and s["intra_node"]["rows_sent"] == 0
    # Without nodes (dedup) the two ranks are one node: every row is intra-node.
    link = "intra_node" if case == "dedup" else "inter_node"
    assert sum(s[link]["rows_sent"] for s in stats) > 0


def _bad_on_one_rank(rank, world, group):
    import torch
    from epmoe.torch import MoE
    moe = MoE(H, F, 8, 2, group=group)
    x = torch.randn(6, H)
    try:
        moe(x.double() if rank == 0 else x)  # only rank 0's input is bad
    except (TypeError, ValueError) as e:
        message = str(e)
    else:
        message = None
    y, _ = moe(x)  # both ranks go on
    return message, bool(torch.isfinite(y).all())


def test_bad_input_on_one_process_raises_on_both():
    (m0, ok0), (m1, ok1) = run_ranks(_bad_on_one_rank, 2)
    assert m0 and "x has dtype Double" in m0
    assert m1 and "rank 0" in m1
    assert ok0 and ok1


def _copies(rank, world, group, cases):
    """Per case, the endpoint's exchanges and staged copies over one forward and backward."""
    import torch
    from epmoe.torch import MoE
    out = []
    for case in cases:
        torch.manual_seed(0)
        moe = MoE(H, F, **CASES[case], group=group, max_tokens=64)
        torch.manual_seed(7 + rank)
        x = torch.randn(9 + 4 * rank, H, requires_grad=True)
        y, _ = moe(x)
        y.square().sum().backward()
        out.append((moe._layer.exchange_copies(), moe.stats()["rows_sent"]))
    return out


def test_two_processes_exchange_in_place():
    """The usual exchange hands the layer's buffers to alltoall_base as they are: a rank's own
    rows skip the exchange (a zero count whose displacement breaks the blocks' order) and
    must not force a copy. Receive rounds lay the blocks apart: there, and only there, the
    endpoint copies (and the results are right: test_two_processes_equal_the_reference)."""
    cases = {"mixtral": False, "receive rounds": True}  # whether the endpoint copies
    for rank, per_case in enumerate(run_ranks(_copies, 2, args=(list(cases),))):
        for (case, copied), (c, rows) in zip(cases.items(), per_case):
            assert rows[rank] > 0 and rows[1 - rank] > 0, (case, rank, rows)
            assert c["exchanges"] >= 4, (case, rank, c)  # dispatch and combine, both ways
            staged = c["send_copies"] + c["receive_copies"]
            assert (staged > 0) == copied, (case, rank, c)


def _one_rank_never_calls(rank, world, group, deadline):
    """Rank 1 builds the module but does not call forward until rank 0 gave up."""
    import time

    import torch
    import torch.distributed as dist
    from epmoe.torch import MoE
    store = dist.distributed_c10d._get_default_store()
    moe = MoE(H, F, 8, 2, group=group, exchange_timeout=deadline)
    x = torch.randn(6, H)
    if rank == 1:
        store.wait(["test/rank 0 gave up"])
    start = time.monotonic()
    try:
        moe(x)
        first = None
    except RuntimeError as e:
        first = (type(e).__name__, str(e), time.monotonic() - start)
    if rank == 0:
        store.set("test/rank 0 gave up", "1")
    start = time.monotonic()
    try:  # the layer refuses every later call at once
        moe(x)
        again = None
    except RuntimeError as e:
        again = (type(e).__name__, str(e), time.monotonic() - start)
    return first, again


def test_exchange_timeout_holds_on_a_process_group():
    """exchange_timeout bounds a torch.distributed exchange: rank 0 waits for a rank 1 that
    never calls and raises CommTimeout within the deadline; it tells rank 1, whose late call
    raises CommAborted naming rank 0's reason instead of waiting out its own deadline."""
    deadline = 1.5
    (t0, again0), (t1, again1) = run_ranks(_one_rank_never_calls, 2, args=(deadline,),
                                           timeout=120)
    kind, message, took = t0
    assert kind == "CommTimeout" and "exchange_timeout" in message, t0
    assert deadline * 0.9 <= took < deadline + 10, t0
    kind, message, took = t1
    assert kind == "CommAborted" and "rank 0" in message and "exchange_timeout" in message, t1
    assert took < deadline, t1  # the abort, not rank 1's own deadline, ended its wait
    for kind, message, took in (again0, again1):
        assert kind == "CommAborted" and "unusable" in message and took < 1.0, (kind, message)


def _interleaved(rank, world, group):
    """An all_reduce on the user's group in flight (as DDP's) while the module exchanges."""
    import torch
    import torch.distributed as dist
    from epmoe.torch import MoE
    torch.manual_seed(0)
    full = build("mixtral", 1)
    moe = MoE(H, F, 8, 2, group=group, max_tokens=64)
    moe.load_logical(logical(full))
    torch.manual_seed(7)
    tokens = [6, 9]
    x_all = torch.randn(sum(tokens), H)
    a = sum(tokens[:rank])
    t = torch.full((5,), float(rank + 1))
    work = dist.all_reduce(t, group=group, async_op=True) if rank == 0 else None
    with torch.no_grad():
        y, _ = moe(x_all[a:a + tokens[rank]])
    if rank == 1:
        work = dist.all_reduce(t, group=group, async_op=True)
    work.wait()
    close(y, reference(moe, logical(full), x_all, tokens)["y"][a:a + tokens[rank]], "y")
    own = moe.exchange_group
    shared = MoE(H, F, 8, 2, group=group, exchange_group=group)
    sub = dist.new_group([0])  # every process makes it (torch's rule); rank 0 is its member
    refused = None
    if rank == 0:
        try:
            MoE(H, F, 8, 2, group=sub)
        except ValueError as e:
            refused = str(e)
    return (t.tolist(), own is not group and own is not dist.group.WORLD, own.size(), own.rank(),
            shared.exchange_group is group, refused)


def test_exchanges_run_on_a_group_of_their_own():
    """By default the module exchanges on a group of its own over the same ranks, so the
    user's collectives on `group` (DDP's) may be in flight meanwhile; exchange_group= picks
    one explicitly."""
    out = run_ranks(_interleaved, 2, timeout=120, pg_timeout=30)
    for rank, (t, own, size, own_rank, shared, refused) in enumerate(out):
        assert t == [3.0] * 5 and own and size == 2 and own_rank == rank and shared
    import inspect
    import torch.distributed as dist
    if "use_local_synchronization" not in inspect.signature(dist.new_group).parameters:
        assert "exchange_group" in out[0][5]  # a sub-group: torch cannot make its own here
