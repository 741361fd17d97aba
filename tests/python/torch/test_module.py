"""flowmoe.torch.MoE on the CPU backend: values, gradients, .grad semantics, re-quantization, errors.

Each recipe's forward and gradients equal the C++ CPU layer called through the C ABI bit for bit,
and a float64 PyTorch reference of the same function within the recipe's precision; finite
differences check the gradients of the module itself.
"""

import math

import pytest
import torch

import flowmoe
import flowmoe._native as native
from flowmoe.torch import MoE

from reference import moe_reference

H, F, E, K = 128, 128, 4, 2
RECIPES = ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4")


def make(recipe="bf16", **kw):
    kw.setdefault("seed", 1)
    return MoE(H, F, kw.pop("experts", E), kw.pop("topk", K), recipe=recipe, **kw)


def data(T=24, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(T, H, generator=g)).bfloat16()
    dy = torch.randn(T, H, generator=g).bfloat16()
    return x, dy


def run_module(m, x, dy):
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(dy)
    return y.detach(), x.grad, m.w1.grad.clone(), m.w2.grad.clone(), m.wr.grad.clone()


def run_capi(m, x, dy, accumulate=False, fill=float("nan")):
    """The C++ CPU layer through the C ABI on the module's weights (no module code involved)."""
    layer = native.Layer(m._config(x.shape[0]))
    w1, w2, wr = m.w1.detach(), m.w2.detach(), m.wr.detach()
    bias = m.router_bias
    layer.set_weights(w1.data_ptr(), w2.data_ptr(), wr.data_ptr(), bias.data_ptr() if bias is not None else 0)
    y = torch.empty_like(x)
    layer.forward_call(x.data_ptr(), x.shape[0], y.data_ptr())
    dx = torch.empty_like(x)
    gs = [torch.full_like(w, fill) for w in (w1, w2, wr)]
    layer.backward_call(dy.data_ptr(), dx.data_ptr(), (0, 0, 0), None, dw1=gs[0].data_ptr(), dw2=gs[1].data_ptr(),
                        bf16=False, dwr=gs[2].data_ptr(), accumulate=accumulate)
    status = layer.status()
    layer.close()
    return (y, dx, *gs), status


def rel_err(a, b):
    """||a - b|| / ||b|| (the error norm relative to the reference's norm)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---- equal to the C++ layer ----------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("router,renorm,bias", [("softmax", False, False), ("sigmoid", True, True)])
def test_module_equals_cpp_layer_bitwise(recipe, router, renorm, bias):
    m = make(recipe, router=router, renormalize=renorm, routed_scaling=1.5, aux_loss_coef=0.01,
             router_bias=bias, align=16)
    if bias:
        with torch.no_grad():
            m.router_bias.copy_(torch.linspace(-0.1, 0.1, E))
    x, dy = data(T=40)
    got = run_module(m, x, dy)
    want, status = run_capi(m, x, dy)
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dwr"), got, want):
        assert torch.equal(a, b), f"{recipe}: {name} differs from the C++ layer"
    assert m.status() == status
    assert m.aux_loss.item() == pytest.approx(status["aux_loss"], rel=0, abs=0)
    assert status["aux_loss"] > 0


@pytest.mark.parametrize("recipe", ("flow", "flow-fp4"))
def test_column_amax_exponent_reaches_the_layer(recipe):
    """transpose_exponent='column-amax' is MoeConfig::kColumnAmax: the module equals the C++ layer
    built with it, and on outlier tokens it counts less underflow than row-max (docs/NUMERICS.md)."""
    x, dy = data(T=40)
    x[3] *= 2.0 ** 12  # one outlier token raises its 128-token block's row-max exponent
    under = {}
    for rule in ("row-max", "column-amax"):
        m = make(recipe, align=16, transpose_exponent=rule)
        got = run_module(m, x, dy)
        want, status = run_capi(m, x, dy)
        for name, a, b in zip(("y", "dx", "dw1", "dw2", "dwr"), got, want):
            assert torch.equal(a, b), f"{recipe} {rule}: {name} differs from the C++ layer"
        under[rule] = status["underflow"]
    assert under["column-amax"] < under["row-max"], under
    with pytest.raises(ValueError, match="transpose_exponent"):
        make(recipe, transpose_exponent="col-amax")


# ---- equal to a float64 reference within the recipe's precision ----------------------------------
# Relative error norms measured at these shapes: bf16 ~0.005, the FP8 recipes ~0.07 (E4M3: 3
# mantissa bits), flow-fp4 ~0.2-0.3 (E2M1 entry). A broken gradient is off by O(1).
TOL = {"bf16": 0.012, "blockwise": 0.1, "fp8-naive": 0.1, "flow": 0.1, "flow-fp4": 0.45}


@pytest.mark.parametrize("recipe", RECIPES)
def test_module_matches_float64_reference(recipe):
    kw = dict(router="softmax", renormalize=True, routed_scaling=1.0, aux_loss_coef=0.05)
    m = make(recipe, **kw)
    x, dy = data(T=32, seed=3)
    y, dx, dw1, dw2, dwr = run_module(m, x, dy)
    leaves = [t.detach().double().requires_grad_() for t in (x.float(), m.w1, m.w2, m.wr)]
    yr, aux, _ = moe_reference(leaves[0], *leaves[1:], topk=K, **kw)
    ((yr * dy.double()).sum() + aux).backward()
    tol = TOL[recipe]
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dwr"), (y, dx, dw1, dw2, dwr),
                          [yr.detach()] + [t.grad for t in leaves]):
        assert rel_err(a, b) < tol, f"{recipe}: {name} relative error {rel_err(a, b):.4f} >= {tol}"
    assert m.aux_loss.item() == pytest.approx(float(aux.detach()), rel=1e-4)


# ---- finite differences of the module itself ------------------------------------------------------
def test_gradients_match_finite_differences():
    # all experts selected (k = E): the function is smooth, no routing decision flips
    m = make("bf16", topk=E, aux_loss_coef=0.1)
    x, dy = data(T=16, seed=5)
    _, dx, dw1, dw2, dwr = run_module(m, x, dy)

    def loss(xv):
        with torch.no_grad():
            y = m(xv)
            return float((y.double() * dy.double()).sum()) + float(m.aux_loss)

    g = torch.Generator().manual_seed(11)
    for name, grad in (("x", dx), ("w1", dw1), ("w2", dw2), ("wr", dwr)):
        base = x.float() if name == "x" else getattr(m, name).detach().clone()
        # half along the gradient (a signal far above the BF16 rounding of y), half random (so a
        # gradient pointing elsewhere is caught too); a 5% step
        r = torch.randn(base.shape, generator=g)
        d = grad.float() / grad.float().norm() + r / r.norm()
        d *= 0.05 * base.abs().mean() / d.abs().mean()
        if name == "x":
            # the steps the BF16 input actually takes up and down (rounded, so not equal)
            up, down = (base + d).bfloat16(), (base - d).bfloat16()
            lp, lm = loss(up), loss(down)
            d = (up.double() - down.double()) / 2
        else:
            p = getattr(m, name)
            with torch.no_grad():
                p.copy_(base + d)
            lp = loss(x)
            with torch.no_grad():
                p.copy_(base - d)
            lm = loss(x)
            with torch.no_grad():
                p.copy_(base)
        fd = (lp - lm) / 2
        analytic = float((grad.double() * d.double()).sum())
        assert abs(fd - analytic) <= 0.015 * abs(analytic) + 1e-6, f"{name}: FD {fd} vs analytic {analytic}"


# ---- .grad semantics and micro-batches ------------------------------------------------------------
def test_grad_none_is_overwritten_and_existing_grad_accumulates():
    m = make("flow")
    x1, dy1 = data(T=24, seed=1)
    x2, dy2 = data(T=20, seed=2)
    (_, _, *g1), _ = run_capi(m, x1, dy1)
    (_, _, *g2), _ = run_capi(m, x2, dy2)
    assert m.w1.grad is None
    m(x1).backward(dy1)  # .grad None: created and overwritten
    for p, g in zip((m.w1, m.w2, m.wr), g1):
        assert torch.equal(p.grad, g)
    m(x2).backward(dy2)  # .grad exists: accumulated
    for p, a, b in zip((m.w1, m.w2, m.wr), g1, g2):
        torch.testing.assert_close(p.grad, a + b, rtol=1e-6, atol=1e-6)
    # the router gradient is added as one sum per element: exactly a + b
    assert torch.equal(m.wr.grad, g1[2] + g2[2])


def test_zeroed_grad_accumulates_to_the_same_bits():
    m = make("blockwise")
    x, dy = data()
    m(x).backward(dy)
    first = [p.grad.clone() for p in (m.w1, m.w2, m.wr)]
    m.zero_grad(set_to_none=False)
    m(x).backward(dy)
    for p, g in zip((m.w1, m.w2, m.wr), first):
        assert torch.equal(p.grad, g)


def test_main_grad_mode_gives_the_same_gradients():
    x, dy = data()
    a, b = make("flow"), make("flow", grad_mode="main_grad")
    for _ in range(2):  # second round: autograd adds to .grad, the layer accumulates into main_grad
        ga = run_module(a, x, dy)
        xb = x.clone().requires_grad_()
        yb = b(xb)
        yb.backward(dy)
        assert b.w1.grad is None and b.wr.grad is None  # nothing through autograd
        gb = (yb.detach(), xb.grad, b.w1.main_grad, b.w2.main_grad, b.wr.main_grad)
        for u, v in zip(ga, gb):
            torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)


def test_frozen_router_gets_no_gradient():
    m = make("bf16")
    m.wr.requires_grad_(False)
    x, dy = data()
    m(x).backward(dy)
    assert m.wr.grad is None and m.w1.grad is not None


def test_batched_input_and_fp32_input():
    m = make("flow")
    x, dy = data(T=24)
    y2 = m(x)
    y3 = m(x.reshape(2, 12, H))
    assert y3.shape == (2, 12, H) and torch.equal(y3.reshape(24, H), y2)
    xf = x.float().requires_grad_()
    yf = m(xf)
    assert yf.dtype == torch.float32 and torch.equal(yf, y2.float())
    yf.backward(dy.float())
    assert xf.grad.dtype == torch.float32


@pytest.mark.parametrize("recipe", flowmoe.RECIPES)
def test_retain_graph_a_second_backward_gives_the_same_gradients(recipe):
    """The forward's state is a value autograd keeps: backward(retain_graph=True) twice accumulates
    exactly twice the gradients of one, and torch.autograd.grad twice gives the same bits."""
    m = make(recipe)
    x, dy = data()
    xr = x.clone().requires_grad_()
    y = m(xr)
    y.backward(dy, retain_graph=True)
    once = [xr.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    y.backward(dy, retain_graph=True)
    twice = [xr.grad] + [p.grad for p in m.parameters()]
    for a, b in zip(once, twice):
        assert torch.equal(b, a + a)
    params = [xr] + list(m.parameters())
    g1 = torch.autograd.grad(y, params, dy, retain_graph=True)
    g2 = torch.autograd.grad(y, params, dy)
    for a, b, c in zip(g1, g2, once):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(RuntimeError, match="second time"):  # the graph is freed now, as for any op
        y.backward(dy)


def test_seeded_init_is_reproducible_and_standard():
    a, b = make("bf16", seed=7), make("bf16", seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = make("bf16", seed=8)
    assert not torch.equal(a.w1, c.w1)
    bound = 1 / math.sqrt(H)
    assert a.w1.abs().max() <= bound and a.w1.abs().max() > 0.9 * bound
    d = make("bf16", seed=7, init_std=0.02)
    assert abs(float(d.w1.std()) - 0.02) < 0.002


def test_reports_are_reachable():
    m = make("flow", check_columns=True)
    x, dy = data()
    m(x).backward(dy)
    rep = m.cast_report()
    assert rep["recipe"] == "flow" and rep["tokens"] == 24
    assert rep["saved_bytes"] == sum(s["bytes"] for s in rep["saved"]) > 0
    assert m.saved_bytes() == rep["saved_bytes"]
    assert m.saved_bytes_per_token() == pytest.approx(rep["saved_bytes"] / 24)
    passes = {op["pass"] for op in rep["ops"]}
    assert {"weights", "forward", "backward"} <= passes
    assert rep["columns"] and all(c["elements"] > 0 and c["differ"] >= 0 for c in rep["columns"])
    assert "recipe flow" in m.cast_report(as_text=True)
    st = m.status()
    assert set(st) == {"nonfinite", "underflow", "aux_loss"} and st["nonfinite"] == 0


def test_max_tokens_grows_unless_fixed():
    m = make("bf16")
    m(data(T=8)[0])
    m(data(T=30)[0])  # rebuilt for 30 tokens
    assert m._runner.max_tokens == 30
    fixed = make("bf16", max_tokens=16)
    with pytest.raises(ValueError, match="max_tokens"):
        fixed(data(T=17)[0])


# ---- bad input --------------------------------------------------------------------------------------
def test_bad_configuration_raises_library_message():
    with pytest.raises(ValueError, match="unknown MoE recipe 'fp3'"):
        make("fp3")
    with pytest.raises(flowmoe.FlowmoeError, match="hidden H = 100"):
        MoE(100, F, E, K)
    with pytest.raises(flowmoe.FlowmoeError, match="top_k|topk"):
        MoE(H, F, E, E + 1)
    with pytest.raises(ValueError, match="router"):
        make("bf16", router="relu")
    # sync_free (CudaLayerOptions::sync_free) takes one GPU and align 128
    for recipe, align in (("bf16", 64), ("flow", 64)):
        with pytest.raises(ValueError, match="sync_free needs align = 128"):
            make(recipe, align=align, sync_free=True)


@pytest.mark.parametrize("bad,exc,match", [
    (lambda x: x.int(), TypeError, "dtype"),
    (lambda x: x[:, :64], ValueError, "shape"),
    (lambda x: x.reshape(2, 2, 6, H), ValueError, "shape"),
    (lambda x: torch.where(torch.arange(x.shape[0])[:, None] == 3, float("nan"), x.float()),
     ValueError, "non-finite"),
    (lambda x: torch.where(torch.arange(x.shape[0])[:, None] == 1, float("inf"), x.float()).bfloat16(),
     ValueError, "non-finite"),
    (lambda x: x.to("meta"), ValueError, "device"),
])
def test_bad_input_raises(bad, exc, match):
    m = make("flow")
    x, _ = data()
    with pytest.raises(exc, match=match):
        m(bad(x))


def test_non_finite_weights_raise_library_error():
    m = make("flow")
    with torch.no_grad():
        m.w2[0, 3, 5] = float("inf")
    with pytest.raises(flowmoe.NonFiniteError, match="non-finite"):
        m(data()[0])


def test_capi_errors_are_exceptions_not_crashes():
    m = make("bf16")
    layer = native.Layer(m._config(8))
    x, _ = data(T=8)
    y = torch.empty_like(x)
    with pytest.raises(flowmoe.FlowmoeError, match="set_weights first"):
        layer.forward_call(x.data_ptr(), 8, y.data_ptr())
    w = [t.detach() for t in (m.w1, m.w2, m.wr)]
    layer.set_weights(*[t.data_ptr() for t in w])
    with pytest.raises(flowmoe.FlowmoeError, match="max_tokens"):
        layer.forward_call(x.data_ptr(), 9, y.data_ptr())
    with pytest.raises(flowmoe.FlowmoeError, match="non-null"):
        layer.forward_call(0, 8, y.data_ptr())
    with pytest.raises(flowmoe.FlowmoeError, match="call forward first"):
        layer.backward_call(x.data_ptr(), y.data_ptr(), (0, 0, 0), None, dw1=None, dw2=None, bf16=False)
    with pytest.raises(flowmoe.FlowmoeError, match="without the CUDA backend|CUDA"):
        if native.has_cuda():
            raise flowmoe.FlowmoeError("CUDA built in: nothing to refuse")
        native.Layer(m._config(8), device=0)
    layer.close()


def test_import_needs_no_native_library():
    import subprocess
    import sys

    code = ("import flowmoe, flowmoe._native as n; n.set_library_path('/nonexistent/lib.so'); "
            "import flowmoe.torch; print(flowmoe.native_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_bad_main_grad_raises():
    m = make("bf16", grad_mode="main_grad")
    x, dy = data()
    m.w2.main_grad = torch.zeros(E, F, H).transpose(1, 2)  # the right shape, not contiguous
    with pytest.raises(flowmoe.FlowmoeError, match="w2.main_grad"):
        m(x).backward(dy)




# ---- native-op edges (issue 44) -----------------------------------------------------------------
def test_native_op_edges_no_tokens_strides_float16():
    m = make("flow")
    x, dy = data()
    # no tokens: the empty output and zero gradients, as a native op
    x0 = x[:0].clone().requires_grad_()
    y0 = m(x0)
    assert y0.shape == (0, H) and y0.dtype == x.dtype
    y0.sum().backward()
    assert x0.grad.shape == (0, H)
    for p in (m.w1, m.w2, m.wr):
        assert p.grad is not None and not bool(p.grad.any())
    m.zero_grad(set_to_none=True)
    # any strides: the bits of the contiguous input
    want = m(x)
    xt = x.reshape(2, 12, H).transpose(0, 1)
    assert torch.equal(m(xt), want.reshape(2, 12, H).transpose(0, 1))
    assert torch.equal(m(torch.stack([x, x], 1).reshape(-1, H)[::2]), want)  # every other row: x again
    # float16 in, float16 out, computed in BF16
    xh = x.half().requires_grad_()
    yh = m(xh)
    assert yh.dtype == torch.float16 and torch.equal(yh, m(xh.detach().bfloat16()).half())
    yh.float().sum().backward()
    assert xh.grad.dtype == torch.float16


def test_a_failed_larger_call_leaves_the_module_as_before():
    # a call that fails (here: more tokens than the module's max_tokens allows is refused before any
    # layer is built; an out-of-memory error inside a grown layer takes the same path) keeps the layer
    m = make("flow")
    x, dy = data()
    m.zero_grad(set_to_none=True)
    want = run_module(m, x, dy)
    layer = m._runner
    failing = torch.randn(4 * x.shape[0], H).bfloat16()
    orig = m._forward

    def oom(*a, **k):
        m._ensure_runner(failing.device, failing.shape[0])  # grows the layer for the failed call
        raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")
    m._forward = oom
    with pytest.raises(torch.OutOfMemoryError):
        m(failing)
    m._forward = orig
    assert m._runner is layer
    m.zero_grad(set_to_none=True)
    got = run_module(m, x, dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_readme_snippet_runs_as_written():
    # the README's PyTorch snippet, unchanged: on a machine without a GPU it picks the CPU backend
    import os
    import re
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")).read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from flowmoe.torch import MoE" in b]
    assert blocks, "README.md has no PyTorch snippet"
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme"})


def test_python_recipe_names_are_the_native_tables():
    """flowmoe.RECIPES (read without the library: argument parsing, scripts/run.sh's check) and the
    Hugging Face names list the native recipe table's names, in its order."""
    import flowmoe.hf

    assert flowmoe.RECIPES == native.recipe_names()
    assert set(flowmoe.hf.IMPLEMENTATIONS.values()) == set(native.recipe_names())


def test_backward_materialises_no_gradient_for_the_saved_bytes():
    # As test_experts.py: the saved bytes and the step get no zero-filled gradient in the backward.
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    moe = MoE(hidden=256, ffn=128, experts=4, topk=2, recipe="flow")
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    loss = moe(x).float().square().mean()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    assert [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zeros_like")] == []
    assert x.grad is not None and moe.w1.grad is not None
