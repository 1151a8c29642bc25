# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""The layer as torch.library custom ops (epmoe/_ops.py): torch.compile with fullgraph=True,
no_grad / inference_mode keeping nothing, frozen experts, autocast's bf16, torch's own op
checks; and epmoe.torch.Experts (a given routing, the caller's fused tensors) against the same
experts written in torch, forward and backward, on thread ranks and 2 gloo processes."""
import pytest
import torch
import torch.nn.functional as fn

from epmoe.torch import MoE, Experts
from ranks import run_ranks

H, F, E, K = 16, 24, 8, 2


def close(got, want, what, tol=2e-5):
    assert got is not None, f"{what}: no gradient"
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert err < tol, f"{what}: max error {err:.3g}"


class Block(torch.nn.Module):
    """A residual block with the MoE inside: what torch.compile sees in a model."""

    def __init__(self, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(H)
        self.moe = MoE(H, F, E, K, max_tokens=64, **kw)

    def forward(self, x):
        y, losses = self.moe(self.norm(x))
        return x + y, losses.aux


def grads_of(model, x):
    x = x.detach().clone().requires_grad_(True)
    out, aux = model(x)
    (out.square().sum() + aux).backward()
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper names them apart
    g = {n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None}
    inner.zero_grad(set_to_none=True)
    return out.detach(), x.grad, g


@pytest.mark.parametrize("ranks", [1, 2])
def test_compile_fullgraph_forward_and_backward(ranks):
    model = Block(ranks=ranks)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    x = torch.randn(2, 10, H)
    out, dx, g = grads_of(model, x)
    for _ in range(2):  # the second call reuses the graph
        out_c, dx_c, g_c = grads_of(compiled, x)
        close(out_c, out, "compiled y")
        close(dx_c, dx, "compiled dx")
        assert sorted(g_c) == sorted(g) and len(g) == len(list(model.parameters()))
        for n in g:
            close(g_c[n], g[n], f"compiled d{n}")
    with torch.no_grad():
        close(compiled(x)[0], out, "compiled under no_grad")
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_no_grad_and_inference_mode_keep_nothing():
    model = Block()
    x = torch.randn(12, H)
    y, _ = model(x)
    kept = model.moe.stats()["saved_bytes"]
    assert kept > 0  # a training forward keeps the expert rows
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            y2, _ = model(x)
        assert model.moe.stats()["saved_bytes"] == 0, mode
        assert torch.equal(y2, y.detach())
    # Nothing requires grad: nothing is kept either.
    for p in model.parameters():
        p.requires_grad_(False)
    model(x)
    assert model.moe.stats()["saved_bytes"] == 0


def test_frozen_experts_get_no_gradient_and_the_rest_the_same():
    moe = Block().moe
    x = torch.randn(14, H)

    def step():
        xs = x.clone().requires_grad_(True)
        y, _ = moe(xs)
        y.square().sum().backward()
        dgate = moe.gate.grad.clone()
        moe.zero_grad(set_to_none=True)
        return xs.grad, dgate

    dx, dgate = step()
    for name in ("w1", "w3", "w2"):
        getattr(moe, name).requires_grad_(False)
    dx_f, dgate_f = step()
    assert moe.w1.grad is None and moe.w2.grad is None and moe.w3.grad is None
    close(dx_f, dx, "dx with frozen experts")
    close(dgate_f, dgate, "dgate with frozen experts")


def test_autocast_bf16_inputs_compute_in_float32():
    torch.manual_seed(1)
    lin = torch.nn.Linear(H, H)
    moe = Block().moe
    x = torch.randn(9, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x)
        assert h.dtype == torch.bfloat16
        y, _ = moe(h)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()  # the gradient flows back through the casts
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()
    with torch.no_grad():
        want, _ = moe(h.float())
    assert torch.equal(y, want.to(torch.bfloat16))


def test_torch_opcheck():
    from epmoe import _ops
    moe = Block().moe
    x = torch.randn(7, H, requires_grad=True)
    params = [getattr(moe, n) for n in moe._param_names]
    torch.library.opcheck(_ops.moe_forward, (x, params, None, None, moe._key, True),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


# --- Experts: a given routing over the caller's tensors --------------------------------------

def torch_experts(x, ids, w, gate_up, down):
    """The same experts written in torch: y_t = sum_k w_tk SwiGLU_{ids_tk}(x_t)."""
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            a = gate_up[e] @ x[t]
            h = fn.silu(a[:F]) * a[F:]
            y[t] = y[t] + w[t, k] * (down[e] @ h)
    return y


def routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    if T == 0:
        return torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[min(2, T - 1), 1] = -1  # an empty slot
    w = torch.rand(T, K, generator=g)
    return ids, w


def fused_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * F, H, generator=g) * 0.2, torch.randn(E, H, F, generator=g) * 0.2)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_experts_given_routing_forward_backward(ranks):
    gate_up, down = (torch.nn.Parameter(t) for t in fused_tensors(3))
    ex = Experts(H, F, E, K, ranks=ranks, max_tokens=64)
    T = 13
    torch.manual_seed(4)
    x = torch.randn(T, H, requires_grad=True)
    ids, w = routing(T, 5)
    w.requires_grad_(True)
    dy = torch.randn(T, H)
    y = ex(x, ids, w, gate_up, down)
    y.backward(dy)
    got = (y.detach(), x.grad, w.grad, gate_up.grad, down.grad)
    xs, ws = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    gu, dn = gate_up.detach().requires_grad_(True), down.detach().requires_grad_(True)
    want_y = torch_experts(xs, ids, ws, gu, dn)
    want_y.backward(dy)
    for what, a, b in zip(("y", "dx", "dweights", "dgate_up", "ddown"), got,
                          (want_y.detach(), xs.grad, ws.grad, gu.grad, dn.grad)):
        close(a, b, what)
    assert w.grad[min(2, T - 1), 1] == 0  # the empty slot
    # Frozen experts and no_grad: only what is asked for.
    gate_up.grad = down.grad = None
    gate_up.requires_grad_(False), down.requires_grad_(False)
    x.grad = None
    ex(x, ids, w, gate_up, down).backward(dy)
    assert gate_up.grad is None and down.grad is None
    close(x.grad, xs.grad, "dx with frozen experts")
    ex.eval()  # packed copies of the caller's tensors
    with torch.inference_mode():
        close(ex(x, ids, w, gate_up, down), want_y.detach(), "y in eval, packed")
    assert ex.stats()["saved_bytes"] == 0


def test_experts_reject_bad_tensors_by_name():
    gate_up, down = fused_tensors(1)
    ex = Experts(H, F, E, K)
    ids, w = routing(4, 2)
    with pytest.raises(ValueError, match=r"down_proj has shape \(8, 16, 23\)"):
        ex(torch.randn(4, H), ids, w, gate_up, down[..., :-1])
    with pytest.raises(TypeError, match="gate_up_proj is torch.float64"):
        ex(torch.randn(4, H), ids, w, gate_up.double(), down)
    bad = ids.clone()
    bad[1, 0] = E
    with pytest.raises(ValueError, match=r"routing.ids\[1\]\[0\] = 8: must be in \[0, 8\)"):
        ex(torch.randn(4, H), bad, w, gate_up, down)
    close(ex(torch.randn(4, H) * 0, ids, w, gate_up, down), torch.zeros(4, H), "zeros")


def _experts_on_a_group(rank, world, group, rows):
    import torch
    from epmoe.torch import Experts
    gate_up, down = fused_tensors(3)
    L = E // world
    mine = [torch.nn.Parameter(t[rank * L:(rank + 1) * L].clone()) for t in (gate_up, down)]
    ex = Experts(H, F, E, K, group=group, max_tokens=64)
    T = rows[rank]  # each rank its own tokens (0: none, still in every collective call)
    torch.manual_seed(10 + rank)
    x = torch.randn(T, H, requires_grad=True)
    ids, w = routing(T, 20 + rank)
    dy = torch.randn(T, H)
    y = ex(x, ids, w, *mine)
    y.backward(dy)
    xs = x.detach().requires_grad_(True)
    want = torch_experts(xs, ids, w, gate_up, down)
    if T:
        want.backward(dy)
    errs = [(y.detach() - want.detach()).abs().max().item(),
            (x.grad - xs.grad).abs().max().item()] if T else []
    nonzero = [p.grad is not None and bool(torch.isfinite(p.grad).all()) and
               bool(p.grad.abs().sum() > 0) for p in mine]
    return errs, nonzero


@pytest.mark.parametrize("rows", [(5, 9), (3, 0)])
def test_experts_on_two_processes(rows):
    for errs, nonzero in run_ranks(_experts_on_a_group, 2, args=(rows,)):
        assert max(errs, default=0) < 2e-5, errs
        assert all(nonzero)  # rank 1's experts get rank 0's rows even when it has none


def test_compile_a_whole_transformers_model_fullgraph():
    """A transformers 5 model whose experts run in epmoe (epmoe.hf.use_epmoe) traces as one
    graph. Backend aot_eager: torch 2.15's inductor fails on this CPU for the unmodified model
    too (its generated kernel misses Sleef_expf16_u10)."""
    transformers = pytest.importorskip("transformers")
    from epmoe import hf
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, eos_token_id=None)
    model = transformers.MixtralForCausalLM(cfg).eval()
    ids = torch.randint(3, 120, (2, 8))
    with torch.no_grad():
        want = model(ids).logits
    hf.use_epmoe(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = compiled(ids).logits
    close(got, want, "compiled model logits", tol=1e-5)
    from epmoe.hf_models import experts_modules
    ex = [m for _, m in experts_modules(model)][0].__dict__["_epmoe"]["experts"]
    assert ex.stats()["tokens"] > 0  # epmoe ran inside the graph
