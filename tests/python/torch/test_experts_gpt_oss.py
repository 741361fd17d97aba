"""flowmoe.torch.experts with gpt-oss's experts (issue 46) on the CPU: expert biases, the clamped
SwiGLU, transposed weights with interleaved gate/up columns, and H / F that are not multiples of 128
(zero-padded). Against a float64 reference of gpt-oss's formula (values and every gradient), the
same bits as the weights relaid by hand into the layer's own layout, and the errors."""

import pytest
import torch

import flowmoe.torch as ft
from reference import experts_reference

T, H, F, E, K = 20, 200, 72, 3, 2
ALPHA, LIMIT = 1.702, 1.0


def clamped_swiglu(gate, up):
    gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    return (up + 1) * gate * torch.sigmoid(gate * ALPHA)


def reference(x, ids, w, gate_up, b1, down, b2):
    """gpt-oss's experts in float64 (reference.experts_reference): gate_up [E, H, 2F] (gate, up
    interleaved), down [E, F, H]; h rounded to BF16 as a BF16 model (and the layer) holds it: near the
    limit the clamp's gradient mask depends on that rounding."""
    gu = gate_up.double().transpose(1, 2)
    w1 = torch.cat([gu[:, 0::2], gu[:, 1::2]], 1)
    b = b1.double()
    b1c = torch.cat([b[:, 0::2], b[:, 1::2]], 1)
    return experts_reference(x, ids, w, w1, down.double().transpose(1, 2), b1=b1c, b2=b2, act=clamped_swiglu,
                             h_round=bf16_round)


def bf16_round(t):
    """t rounded to BF16, differentiable (the identity's gradient)."""
    return t + (t.to(torch.bfloat16).double() - t).detach()


def problem(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_()
    logits = torch.randn(T, E, generator=g, requires_grad=True)
    gate_up = (torch.randn(E, H, 2 * F, generator=g) * 0.08).to(dtype).requires_grad_()
    b1 = (torch.randn(E, 2 * F, generator=g) * 0.3).to(dtype).requires_grad_()
    down = (torch.randn(E, F, H, generator=g) * 0.08).to(dtype).requires_grad_()
    b2 = (torch.randn(E, H, generator=g) * 0.3).to(dtype).requires_grad_()
    dy = torch.randn(T, H, generator=g)
    _keep_off_the_limits(x, gate_up, b1)
    return x, logits, gate_up, b1, down, b2, dy


def _keep_off_the_limits(x, gate_up, b1, band=0.08):
    """Shifts each b1[e, j] so that no token's pre-activation lies within `band` of a clamp bound
    (gate: +LIMIT; up: +-LIMIT). There the clamp's gradient mask is decided by the last bits of h
    (BF16 rounding, summation order; FP8 h in the flow recipes, whose backward reads h as saved), a
    jump no tolerance covers; elsewhere the
    clamp still acts on many values and the comparison is a plain BF16 tolerance."""
    with torch.no_grad():
        mm = torch.einsum("th,ehf->etf", x.double(), gate_up.double())  # [E, T, 2F]
        b = b1.double()
        for e in range(mm.shape[0]):
            for j in range(mm.shape[2]):
                bounds = (LIMIT,) if j % 2 == 0 else (LIMIT, -LIMIT)
                for k in range(200):
                    shift = 0.013 * k * (1 if k % 2 else -1)
                    v = mm[e, :, j] + b[e, j] + shift
                    if all(bool(((v - L).abs() > band).all()) for L in bounds):
                        b1[e, j] += shift
                        break


def route(logits):
    w, ids = torch.topk(torch.softmax(logits, -1), K)
    return ids, w


def run(recipe, x, logits, gate_up, b1, down, b2, dy, align=128, **kw):
    ids, w = route(logits)
    y = ft.experts(x, ids, w, gate_up, down, recipe=recipe, b1=b1, b2=b2, activation="clamped-swiglu",
                   swiglu_alpha=ALPHA, swiglu_limit=LIMIT, transposed=True, interleaved=True, align=align, **kw)
    y.float().backward(dy)
    return y.detach().float(), [t.grad.clone() for t in (x, logits, gate_up, b1, down, b2)]


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("recipe,tol", [("bf16", 0.02), ("blockwise", 0.12), ("flow", 0.12), ("flow-fp4", 0.3)])
def test_values_and_gradients_against_float64(recipe, tol):
    x, logits, gate_up, b1, down, b2, dy = problem()
    y, grads = run(recipe, x, logits, gate_up, b1, down, b2, dy)
    leaves = [t.detach().clone().requires_grad_() for t in (x, logits, gate_up, b1, down, b2)]
    ids, w = route(leaves[1])
    ref = reference(leaves[0], ids, w, leaves[2], leaves[3], leaves[4], leaves[5])
    ref.backward(dy.double())
    assert rel(y, ref) < tol
    for name, g, leaf in zip(("x", "logits", "gate_up", "b1", "down", "b2"), grads, leaves):
        assert float(leaf.grad.abs().sum()) > 0, name
        assert rel(g, leaf.grad) < 2 * tol, f"d{name}: {rel(g, leaf.grad):.4f}"
    clamped = (torch.einsum("th,ehf->tef", x.detach().double(), gate_up.detach().double()).abs() > LIMIT)
    assert clamped.float().mean() > 0.1, "the clamp acts on this problem"


def run_relaid(recipe, x, logits, gate_up, b1, down, b2, dy, align=128, **kw):
    """run() with the same weights relaid by hand into the layer's own layout [E, 2F, H] (gate rows
    first) and [E, H, F]: y and the gradients of (x, logits, w1, b1, w2, b2) in that layout."""
    gu = gate_up.detach().transpose(1, 2)
    w1 = torch.cat([gu[:, 0::2], gu[:, 1::2]], 1).contiguous().requires_grad_()
    bb = b1.detach()
    b1c = torch.cat([bb[:, 0::2], bb[:, 1::2]], 1).contiguous().requires_grad_()
    w2 = down.detach().transpose(1, 2).contiguous().requires_grad_()
    x2, l2, b22 = (t.detach().clone().requires_grad_() for t in (x, logits, b2))
    ids, w = route(l2)
    y2 = ft.experts(x2, ids, w, w1, w2, recipe=recipe, b1=b1c, b2=b22, activation="clamped-swiglu",
                    swiglu_alpha=ALPHA, swiglu_limit=LIMIT, align=align, **kw)
    y2.float().backward(dy)
    return y2.detach().float(), (x2.grad, l2.grad, w1.grad, b1c.grad, w2.grad, b22.grad)


def assert_same_bits_as_relaid(y, grads, relaid):
    """run()'s y and gradients (gpt-oss's layout) against run_relaid()'s, bit for bit."""
    y2, (dx, dl, dw1, db1, dw2, db2) = relaid
    assert torch.equal(y, y2)
    assert torch.equal(grads[0], dx) and torch.equal(grads[1], dl) and torch.equal(grads[5], db2)
    g1 = grads[2].transpose(1, 2)
    assert torch.equal(torch.cat([g1[:, 0::2], g1[:, 1::2]], 1), dw1)
    assert torch.equal(torch.cat([grads[3][:, 0::2], grads[3][:, 1::2]], 1), db1)
    assert torch.equal(grads[4].transpose(1, 2), dw2)


@pytest.mark.parametrize("recipe", ["bf16", "flow"])
def test_same_bits_as_weights_relaid_by_hand(recipe):
    """transposed / interleaved read by flowmoe give the bits of the same weights given in the
    layer's own layout [E, 2F, H] (gate rows first) and [E, H, F]."""
    x, logits, gate_up, b1, down, b2, dy = problem(1)
    y, grads = run(recipe, x, logits, gate_up, b1, down, b2, dy)
    assert_same_bits_as_relaid(y, grads, run_relaid(recipe, x, logits, gate_up, b1, down, b2, dy))


def test_bf16_parameters_get_bf16_gradients():
    x, logits, gate_up, b1, down, b2, dy = problem(2, torch.bfloat16)
    y, grads = run("flow", x, logits, gate_up, b1, down, b2, dy)
    assert all(g.dtype == torch.bfloat16 for g in grads[2:])
    assert torch.isfinite(y).all()


def test_errors_say_what_is_expected():
    x, logits, gate_up, b1, down, b2, _ = problem()
    ids, w = route(logits)
    with pytest.raises(ValueError, match=r"b1 of shape \(3, 100\).*expected \[3, 144\]"):
        ft.experts(x, ids, w, gate_up, down, recipe="bf16", b1=b1[:, :100], transposed=True, interleaved=True)
    with pytest.raises(ValueError, match=r"activation 'gelu'"):
        ft.experts(x, ids, w, gate_up, down, activation="gelu", transposed=True)
    with pytest.raises(ValueError, match=r"expected w1 \[E, H, 2F\] and w2 \[E, F, H\] \(transposed=True\)"):
        ft.experts(x, ids, w, gate_up, down.transpose(1, 2), transposed=True)
    with pytest.raises(Exception, match=r"fp8-naive"):
        ft.experts(x, ids, w, gate_up, down, recipe="fp8-naive", b1=b1, transposed=True, interleaved=True)


def test_gradient_accumulation_and_weights_move():
    """Two backwards accumulate into .grad (twice one backward's, exactly) and a fused AdamW step moves
    every gpt-oss parameter (weights and biases) from where it started."""
    x, logits, gate_up, b1, down, b2, dy = problem(3)
    ids, w = route(logits.detach())
    params = (gate_up, b1, down, b2)
    kw = dict(recipe="flow", b1=b1, b2=b2, activation="clamped-swiglu", swiglu_alpha=ALPHA, swiglu_limit=LIMIT,
              transposed=True, interleaved=True)
    ft.experts(x, ids, w, gate_up, down, **kw).float().backward(dy)
    once = [p.grad.clone() for p in params]
    ft.experts(x, ids, w, gate_up, down, **kw).float().backward(dy)
    for g1, p in zip(once, params):
        assert torch.equal(p.grad, 2 * g1)
    before = [p.detach().clone() for p in params]
    torch.optim.AdamW(params, lr=1e-3, fused=True).step()
    for b, p in zip(before, params):
        assert not torch.equal(b, p.detach())


@pytest.mark.parametrize("recipe", ["bf16", "flow"])
def test_the_layer_reads_the_parameters_where_they_are(recipe):
    """The layer takes gpt-oss's transposed, interleaved, unpadded parameters themselves (the
    library's rule: the CPU reference relays them into its own copies) and returns their gradients
    in their layout: the autograd graph holds no relaying copy of them."""
    from flowmoe import experts as fx

    x, logits, gate_up, b1, down, b2, dy = problem(3)
    owner = torch.nn.Module()
    ids, w = route(logits)
    y = ft.experts(x, ids, w, gate_up, down, recipe=recipe, b1=b1, b2=b2, activation="clamped-swiglu",
                   swiglu_alpha=ALPHA, swiglu_limit=LIMIT, transposed=True, interleaved=True, owner=owner)
    layers = list(fx._layers[id(owner)][1].values())
    assert len(layers) == 1 and layers[0].storage == (H, F, True)
    seen, stack, feeding = set(), [y.grad_fn], []
    while stack:  # every node between y and the leaves: which ones feed gate_up and down
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        for f, _ in n.next_functions:
            if f is not None and type(f).__name__ == "AccumulateGrad" and any(
                    f.variable is p for p in (gate_up, down)):
                feeding.append(type(n).__name__)
            stack.append(f)
    # (the flowmoe operator's own node, nothing that copies or transposes them in between)
    assert len(feeding) == 2 and all("moe_forward" in name for name in feeding), feeding
    y.float().backward(dy)
    assert gate_up.grad.shape == gate_up.shape and down.grad.shape == down.shape


def test_down_bias_skips_dropped_slots_with_its_gradients():
    """The down-projection bias b2 (gpt-oss's down_proj_bias) is added as sum_k p_k b2[e_k] over the
    kept slots only (id -1: dropped, adds nothing and gets no gradient), in FP32 rounded once: values
    and the gradients of y, p and b2 against a float64 loop."""
    from flowmoe.experts import _add_down_bias
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([[0, 2], [-1, 1], [2, 2], [-1, -1]])
    probs = torch.rand(4, 2, generator=g, dtype=torch.float32).requires_grad_()
    b2 = torch.randn(E, 8, generator=g).requires_grad_()
    y = torch.randn(4, 8, generator=g).to(torch.bfloat16).requires_grad_()
    out = _add_down_bias(y, ids, probs, b2)
    want = y.detach().double().clone()
    for t in range(4):
        for s in range(2):
            if ids[t, s] >= 0:
                want[t] += probs[t, s].double().detach() * b2[ids[t, s]].double().detach()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want.to(torch.bfloat16))
    dy = torch.randn(4, 8, generator=g)
    out.float().backward(dy)
    dy = dy.to(torch.bfloat16).float()  # (the gradient reaching the FP32 sum: BF16 output's)
    assert torch.equal(y.grad, dy.to(torch.bfloat16))
    dprobs = torch.stack([torch.stack([(dy[t].double() * b2[ids[t, s]].double()).sum() if ids[t, s] >= 0
                                       else torch.zeros((), dtype=torch.float64) for s in range(2)]) for t in range(4)])
    torch.testing.assert_close(probs.grad.double(), dprobs, rtol=1e-5, atol=1e-6)
    db2 = torch.zeros(E, 8, dtype=torch.float64)
    for t in range(4):
        for s in range(2):
            if ids[t, s] >= 0:
                db2[ids[t, s]] += probs[t, s].double().detach() * dy[t].double()
    torch.testing.assert_close(b2.grad.double(), db2, rtol=1e-5, atol=1e-6)
