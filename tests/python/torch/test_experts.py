"""flowmoe.torch.experts / MoEExperts (the experts-only layer, routing from the caller; issue 31) on
the CPU: against a float64 reference of the same function (values and gradients of x, the routing
weights, w1 and w2), the module equal to the function, BF16 parameters, forwards in flight,
activation checkpointing, and the errors. GPU versions: test_gpu_experts.py."""

import pytest
import torch
import torch.utils.checkpoint

import flowmoe.torch as ft
from reference import experts_reference

T, H, F, E, K = 12, 128, 128, 4, 2


def reference(x, ids, w, w1, w2):
    """y_t = sum_s w[t, s] * W2_e (silu(g) * u), [g; u] = W1_e x_t, in float64 (reference.py)."""
    return experts_reference(x, ids, w, w1, w2)


def problem(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_()
    logits = torch.randn(T, E, generator=g, requires_grad=True)
    w1 = (torch.randn(E, 2 * F, H, generator=g) * 0.05).to(dtype).requires_grad_()
    w2 = (torch.randn(E, H, F, generator=g) * 0.05).to(dtype).requires_grad_()
    dy = torch.randn(T, H, generator=g)
    return x, logits, w1, w2, dy


def route(logits):
    w, ids = torch.topk(torch.softmax(logits, -1), K)
    return ids, w


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("recipe,tol", [("bf16", 0.02), ("blockwise", 0.08), ("fp8-naive", 0.08), ("flow", 0.08),
                                        ("flow-fp4", 0.25)])
def test_values_and_gradients_against_float64(recipe, tol):
    x, logits, w1, w2, dy = problem()
    ids, w = route(logits)
    y = ft.experts(x, ids, w, w1, w2, recipe=recipe)
    assert y.dtype == torch.bfloat16 and y.shape == (T, H)
    got = torch.autograd.grad((y.float() * dy).sum(), [x, logits, w1, w2])
    ids, w = route(logits)
    yr = reference(x, ids, w, w1, w2)
    want = torch.autograd.grad((yr * dy.double()).sum(), [x, logits, w1, w2])
    assert rel(y, yr) < tol
    for name, a, b in zip(("dx", "dlogits (through the routing weights)", "dw1", "dw2"), got, want):
        assert rel(a, b) < tol, name


@pytest.mark.parametrize("recipe", ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_retain_graph_a_second_grad_gives_the_same_bits(recipe, dtype):
    x, logits, w1, w2, dy = problem(2, dtype)
    ids, w = route(logits)
    y = ft.experts(x, ids, w, w1, w2, recipe=recipe)
    loss = (y.float() * dy).sum()
    first = torch.autograd.grad(loss, [x, logits, w1, w2], retain_graph=True)
    second = torch.autograd.grad(loss, [x, logits, w1, w2])
    for name, a, b in zip(("dx", "dlogits", "dw1", "dw2"), first, second):
        assert torch.equal(a, b), name


def test_module_equals_function_bits():
    x, logits, w1, w2, dy = problem(1)
    ids, w = route(logits.detach())
    m = ft.MoEExperts(H, F, E, K, recipe="flow", seed=3)
    with torch.no_grad():
        m.w1.copy_(w1)
        m.w2.copy_(w2)
    y1 = m(x, ids, w)
    y2 = ft.experts(x, ids, w, w1, w2, recipe="flow")
    assert torch.equal(y1, y2)
    g1 = torch.autograd.grad((y1.float() * dy).sum(), [x, m.w1, m.w2])
    g2 = torch.autograd.grad((y2.float() * dy).sum(), [x, w1, w2])
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["bf16", "blockwise", "fp8-naive", "flow", "flow-fp4"])
def test_bf16_parameters_give_the_bits_of_fp32_masters(recipe):
    # BF16 w1 / w2 go to the layer as they are (set_weights with bf16: no FP32 copy); the result is that
    # of FP32 masters holding the same values, and the gradients are the FP32 ones rounded to BF16
    x, logits, w1, w2, dy = problem(2)
    ids, w = route(logits.detach())
    w1b, w2b = w1.detach().to(torch.bfloat16).requires_grad_(), w2.detach().to(torch.bfloat16).requires_grad_()
    w1f, w2f = w1b.detach().float().requires_grad_(), w2b.detach().float().requires_grad_()
    wb, wf = w.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    xb, xf = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    y = ft.experts(xb, ids, wb, w1b, w2b, recipe=recipe)
    y32 = ft.experts(xf, ids, wf, w1f, w2f, recipe=recipe)
    assert torch.equal(y, y32)
    (y.float() * dy).sum().backward()
    (y32.float() * dy).sum().backward()
    assert w1b.grad.dtype == torch.bfloat16 and w2b.grad.dtype == torch.bfloat16
    assert torch.equal(w1b.grad, w1f.grad.to(torch.bfloat16))
    assert torch.equal(w2b.grad, w2f.grad.to(torch.bfloat16))
    assert torch.equal(xb.grad, xf.grad) and torch.equal(wb.grad, wf.grad)


def test_float16_parameters_are_converted_and_get_float16_gradients():
    x, logits, w1, w2, dy = problem(2)
    ids, w = route(logits.detach())
    w1h, w2h = w1.detach().half().requires_grad_(), w2.detach().half().requires_grad_()
    y = ft.experts(x, ids, w, w1h, w2h, recipe="bf16")
    y32 = ft.experts(x, ids, w, w1h.detach().float(), w2h.detach().float(), recipe="bf16")
    assert torch.equal(y, y32)
    (y.float() * dy).sum().backward()
    assert w1h.grad.dtype == torch.float16 and w2h.grad.dtype == torch.float16


def test_forwards_in_flight_and_checkpointing_match_sequential():
    x, logits, w1, w2, dy = problem(3)
    ids, w = route(logits.detach())
    x2 = torch.randn(T, H).to(torch.bfloat16).requires_grad_()
    ref = []
    for xx in (x, x2):
        y = ft.experts(xx, ids, w, w1, w2, recipe="flow")
        ref.append((y.detach(),) + torch.autograd.grad((y.float() * dy).sum(), [xx, w1, w2]))
    ya = ft.experts(x, ids, w, w1, w2, recipe="flow")
    yb = ft.experts(x2, ids, w, w1, w2, recipe="flow")
    gb = torch.autograd.grad((yb.float() * dy).sum(), [x2, w1, w2])  # the second forward's first
    ga = torch.autograd.grad((ya.float() * dy).sum(), [x, w1, w2])
    for got, want in ((ya, ref[0][0]), (yb, ref[1][0])):
        assert torch.equal(got, want)
    for got, want in ((ga, ref[0][1:]), (gb, ref[1][1:])):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    yc = torch.utils.checkpoint.checkpoint(lambda t: ft.experts(t, ids, w, w1, w2, recipe="flow"), x,
                                           use_reentrant=False)
    gc = torch.autograd.grad((yc.float() * dy).sum(), [x, w1, w2])
    for a, b in zip(gc, ref[0][1:]):
        assert torch.equal(a, b)


def test_dropped_slots_and_fp32_input():
    x, logits, w1, w2, dy = problem(4)
    ids, w = route(logits.detach())
    ids = ids.clone()
    ids[::3, 1] = -1
    w = w.clone().requires_grad_()
    y = ft.experts(x.detach().float(), ids, w, w1, w2, recipe="bf16")
    assert y.dtype == torch.float32
    assert rel(y, reference(x, ids, w, w1, w2)) < 0.02
    (dw,) = torch.autograd.grad((y * dy).sum(), [w])
    assert torch.all(dw[::3, 1] == 0)


def test_errors_say_what_is_expected():
    x, logits, w1, w2, _ = problem(5)
    ids, w = route(logits.detach())
    with pytest.raises(ValueError, match="top_k_index"):
        ft.experts(x, ids + E, w, w1, w2, recipe="bf16")
    with pytest.raises(ValueError, match=r"\[12, k\]"):
        ft.experts(x, ids[:5], w[:5], w1, w2)
    with pytest.raises(ValueError, match="w1"):
        ft.experts(x, ids, w, w1[:, :7], w2)
    with pytest.raises(ValueError, match="unknown MoE recipe 'fp16'"):  # the library's words
        ft.experts(x, ids, w, w1, w2, recipe="fp16")
    with pytest.raises(TypeError, match="integer"):
        ft.experts(x, w, w, w1, w2)
    with pytest.raises(ValueError, match="topk"):
        ft.MoEExperts(H, F, E, 1)(x, ids, w)


def test_torch_compile_gives_eager_bits():
    m = ft.MoEExperts(H, F, E, K, recipe="flow", seed=6)
    x = torch.randn(8, H, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.stack([torch.arange(8) % E, (torch.arange(8) + 1) % E], 1)
    w = torch.full((8, K), 0.5, requires_grad=True)
    ye = m(x, ids, w)
    ge = torch.autograd.grad(ye.float().sum(), [x, w, m.w1, m.w2])
    yc = torch.compile(m, backend="aot_eager")(x, ids, w)
    gc = torch.autograd.grad(yc.float().sum(), [x, w, m.w1, m.w2])
    assert torch.equal(ye, yc)
    for a, b in zip(ge, gc):
        assert torch.equal(a, b)


def test_native_op_edges_no_tokens_strides_float16():
    x, logits, w1, w2, dy = problem(5)
    ids, w = route(logits.detach())
    w1d, w2d = w1.detach(), w2.detach()  # (the functional form's layer lives as long as its owner, w1)
    want = ft.experts(x.detach(), ids, w, w1d, w2d, recipe="flow")
    # no tokens: the empty output and zero gradients
    x0, w0 = x.detach()[:0].requires_grad_(), w[:0].clone().requires_grad_()
    y0 = ft.experts(x0, ids[:0], w0, w1, w2, recipe="flow")
    assert y0.shape == (0, H)
    y0.float().sum().backward()
    assert w1.grad is not None and not bool(w1.grad.any()) and not bool(w2.grad.any())
    assert x0.grad.shape == (0, H) and w0.grad.shape == (0, K)
    # any strides: the bits of the contiguous input
    xs = torch.stack([x.detach(), x.detach()], 1).reshape(-1, H)[::2]
    assert not xs.is_contiguous()
    assert torch.equal(ft.experts(xs, ids, w, w1d, w2d, recipe="flow"), want)
    # float16 in, float16 out, computed in BF16
    xh = x.detach().half().requires_grad_()
    yh = ft.experts(xh, ids, w, w1d, w2d, recipe="flow")
    assert yh.dtype == torch.float16
    assert torch.equal(yh, ft.experts(xh.detach().bfloat16(), ids, w, w1d, w2d, recipe="flow").half())
    yh.float().sum().backward()
    assert xh.grad.dtype == torch.float16


def zero_fills_in_backward(loss):
    """aten::zeros calls while `loss` backpropagates (CPU profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    return [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zeros_like")]


@pytest.mark.parametrize("recipe", ("bf16", "flow"))
def test_backward_materialises_no_gradient_for_the_saved_bytes(recipe):
    # The op's `saved` and `step` outputs never get a gradient; autograd would otherwise hand the
    # backward zero-filled tensors of their size (on the GPU a fill of the whole saved buffer, up to
    # gigabytes per step). The backward gets None for them and allocates no zeros.
    x, logits, w1, w2, dy = problem(3)
    ids, w = route(logits.detach())  # (topk's own backward allocates zeros: the routing stays out)
    w.requires_grad_()
    y = ft.experts(x, ids, w, w1, w2, recipe=recipe)
    assert zero_fills_in_backward((y.float() * dy).sum()) == []
    assert x.grad is not None and w.grad is not None and w1.grad is not None and torch.isfinite(w1.grad).all()
