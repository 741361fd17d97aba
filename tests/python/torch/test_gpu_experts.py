"""flowmoe.torch.experts on the GPU (marker `gpu`; run on the device): the CUDA experts-only layer
against the CPU one (every recipe, values and gradients within the GEMM tolerance), against the
float64 reference, forwards in flight on caller memory, BF16 parameters, and CUDA-graph capture
with sync_free. CPU versions: test_experts.py."""

import pytest
import torch

import flowmoe.torch as ft
from test_experts import E, F, H, K, T, problem, reference, rel, route

pytestmark = pytest.mark.gpu
DEV = "cuda"


def grads(x, ids, w, w1, w2, dy, recipe, **kw):
    x = x.detach().to(DEV).requires_grad_()
    w = w.detach().to(DEV).requires_grad_()
    w1 = w1.detach().to(DEV).requires_grad_()
    w2 = w2.detach().to(DEV).requires_grad_()
    y = ft.experts(x, ids.to(DEV), w, w1, w2, recipe=recipe, **kw)
    g = torch.autograd.grad((y.float() * dy.to(DEV)).sum(), [x, w, w1, w2])
    return [y.detach().cpu()] + [t.cpu() for t in g]


@pytest.mark.parametrize("recipe", ["bf16", "blockwise", "fp8-naive", "flow", "flow-fp4"])
@pytest.mark.parametrize("sync_free", [False, True])
def test_gpu_matches_cpu_layer(recipe, sync_free):
    x, logits, w1, w2, dy = problem(10)
    ids, w = route(logits.detach())
    cpu = grads(x, ids, w, w1, w2, dy, recipe)
    gpu = grads(x, ids, w, w1, w2, dy, recipe, sync_free=sync_free)
    tol = 0.02 if recipe == "bf16" else 0.06
    for name, a, b in zip(("y", "dx", "dprobs", "dw1", "dw2"), gpu, cpu):
        assert rel(a, b) < tol, name
    assert rel(gpu[0], reference(x, ids, w, w1, w2)) < (0.02 if recipe == "bf16" else 0.25)


def test_gpu_forwards_in_flight_equal_sequential():
    x, logits, w1, w2, dy = problem(11)
    ids, w = route(logits.detach())
    x, ids, w, w1, w2, dy = [t.detach().to(DEV) for t in (x, ids, w, w1, w2, dy)]
    w1.requires_grad_()
    w2.requires_grad_()
    xs = [x.clone().requires_grad_(), (x * 0.5).requires_grad_()]
    ref = []
    for xx in xs:
        y = ft.experts(xx, ids, w, w1, w2, recipe="flow")
        ref.append([y.detach()] + list(torch.autograd.grad((y.float() * dy).sum(), [xx, w1, w2])))
    ys = [ft.experts(xx, ids, w, w1, w2, recipe="flow") for xx in xs]
    got = [None, None]
    for i in (1, 0):
        got[i] = [ys[i].detach()] + list(torch.autograd.grad((ys[i].float() * dy).sum(), [xs[i], w1, w2]))
    for a, b in zip(got, ref):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


@pytest.mark.parametrize("recipe", ["bf16", "blockwise", "fp8-naive", "flow", "flow-fp4"])
@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_retain_graph_a_second_grad_gives_the_same_bits(recipe, sync_free, dtype):
    """retain_graph=True: the forward's saved bytes and step back a second backward with the same
    bits (the backward never writes what its forward saved), with and without the parameters kept
    for the dgrad weights (FP8 block recipes) and in any order with another forward in flight."""
    x, logits, w1, w2, dy = problem(12, dtype)
    ids, w = route(logits.detach())
    x, ids, w, w1, w2, dy = [t.detach().to(DEV) for t in (x, ids, w, w1, w2, dy)]
    for t in (x, w, w1, w2):
        t.requires_grad_()
    y = ft.experts(x, ids, w, w1, w2, recipe=recipe, sync_free=sync_free)
    loss = (y.float() * dy).sum()
    first = torch.autograd.grad(loss, [x, w, w1, w2], retain_graph=True)
    other = ft.experts(x * 0.5, ids, w, w1, w2, recipe=recipe, sync_free=sync_free)  # another forward in flight
    torch.autograd.grad((other.float() * dy).sum(), [x, w1])
    second = torch.autograd.grad(loss, [x, w, w1, w2])
    for name, a, b in zip(("dx", "dprobs", "dw1", "dw2"), first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("recipe", ["bf16", "blockwise", "fp8-naive", "flow", "flow-fp4"])
@pytest.mark.parametrize("sync_free", [False, True])
def test_gpu_bf16_parameters_give_the_bits_of_fp32_masters(recipe, sync_free):
    # quantized straight from the BF16 parameters (one launch per weight, no FP32 copy): the bits
    # of FP32 masters of the same values; gradients are the FP32 ones rounded to BF16
    x, logits, w1, w2, dy = problem(12)
    ids, w = route(logits.detach())
    w1b = w1.detach().to(DEV, torch.bfloat16)
    w2b = w2.detach().to(DEV, torch.bfloat16)
    b = grads(x, ids, w, w1b, w2b, dy, recipe, sync_free=sync_free)
    f = grads(x, ids, w, w1b.float(), w2b.float(), dy, recipe, sync_free=sync_free)
    assert b[3].dtype == torch.bfloat16 and b[4].dtype == torch.bfloat16
    for name, u, v in zip(("y", "dx", "dprobs"), b[:3], f[:3]):
        assert torch.equal(u, v), name
    assert torch.equal(b[3], f[3].to(torch.bfloat16)) and torch.equal(b[4], f[4].to(torch.bfloat16))


def test_gpu_module_under_cuda_graph_capture():
    m = ft.MoEExperts(H, F, E, K, recipe="flow", sync_free=True, seed=1, device=DEV)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    ids = torch.stack([torch.arange(T, device=DEV) % E, (torch.arange(T, device=DEV) + 1) % E], 1)
    w = torch.full((T, K), 0.5, device=DEV)
    with torch.no_grad():
        want = m(x, ids, w)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            m(x, ids, w)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = m(x, ids, w)
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("recipe,from_params", [("flow", True), ("flow-fp4", True), ("blockwise", True),
                                                ("fp8-naive", False), ("bf16", True)])
def test_gpu_backward_derives_its_weights_from_the_parameters(recipe, from_params):
    # FP8 block recipes: the autograd node keeps the parameters, not the forward's weight copies
    # (wbuf: 1 byte per expert weight), and the backward quantizes W^T from them; bf16 reads the BF16
    # parameters in place in both passes; an in-place change of a parameter between the forward and
    # its backward is refused as for any op saving its weight
    m = ft.MoEExperts(512, 512, 8, 2, recipe=recipe, seed=3, device=DEV)
    w1 = torch.nn.Parameter(m.w1.detach().to(torch.bfloat16))
    w2 = torch.nn.Parameter(m.w2.detach().to(torch.bfloat16))
    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(256, 512, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    ids = torch.randint(0, 8, (256, 2), device=DEV, generator=g, dtype=torch.int32)
    w = torch.rand(256, 2, device=DEV, generator=g)
    owner = torch.nn.Module()  # (the functional form keeps its layer per owner, by weak reference)
    ft.experts(x, ids, w, w1, w2, recipe=recipe, owner=owner)  # the layer built, its memory cached
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = ft.experts(x, ids, w, w1, w2, recipe=recipe, owner=owner)
    held = torch.cuda.memory_allocated() - before
    from flowmoe.experts import _layers
    plan = next(iter(_layers[id(owner)][1].values()))._runner.plan
    wbuf, saved = plan[0], plan[1]
    y_bytes = y.numel() * y.element_size()
    if from_params:  # y and saved (the step is on the CPU; PyTorch rounds each block to 512 bytes): no copies
        assert held <= (saved + 511) // 512 * 512 + y_bytes, (held, y_bytes, plan)
    else:
        assert held >= wbuf + saved, (held, plan)
    dy = torch.randn_like(y)
    gx, gw1, gw2 = torch.autograd.grad(y, [x, w1, w2], dy, retain_graph=False)
    assert gw1.dtype == torch.bfloat16 and torch.isfinite(gw1.float()).all() and gw1.abs().sum() > 0
    if from_params:  # (the other recipes' backward reads the forward's own copies)
        y = ft.experts(x, ids, w, w1, w2, recipe=recipe, owner=owner)
        with torch.no_grad():
            w1.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(y, [x, w1, w2], dy)


# ---- gpt-oss's experts (issue 46): the CUDA relayout kernels and the layer ----------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("H_", [200, 201])  # even sizes: the 32-bit pair kernels (BF16); odd: the others
def test_gpu_relayout_kernels_equal_the_tensor_copies(dtype, interleaved, H_):
    """flowmoe_expert_relayout (transposed weights, on CUDA) moves every value as the CPU path's
    tensor copies do, and the gradients back; padding is zeros."""
    from flowmoe.experts import _Layout

    g = torch.Generator().manual_seed(3)
    E_, F_ = 3, 72
    w1 = torch.randn(E_, H_, 2 * F_, generator=g).to(dtype)
    w2 = torch.randn(E_, F_, H_, generator=g).to(dtype)
    lay = _Layout(H_, F_, True, interleaved)
    want = lay.weights(w1, w2)  # CPU: tensor copies
    a1, a2 = w1.to(DEV).requires_grad_(), w2.to(DEV).requires_grad_()
    got = lay.weights(a1, a2)  # CUDA: the kernels
    for w, gt in zip(want, got):
        assert torch.equal(w, gt.detach().cpu())
    d1 = torch.randn(got[0].shape, generator=g).to(dtype)
    d2 = torch.randn(got[1].shape, generator=g).to(dtype)
    c1, c2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    cw = lay.weights(c1, c2)
    torch.autograd.backward(cw, [d1, d2])
    torch.autograd.backward(got, [d1.to(DEV), d2.to(DEV)])
    assert torch.equal(c1.grad, a1.grad.cpu()) and torch.equal(c2.grad, a2.grad.cpu())


@pytest.mark.parametrize("recipe,tol", [("bf16", 0.02), ("flow", 0.12), ("flow-fp4", 0.3)])
def test_gpu_gpt_oss_experts_against_float64(recipe, tol):
    import test_experts_gpt_oss as go

    x, logits, gate_up, b1, down, b2, dy = (t.detach().to(DEV) for t in go.problem())
    leaves = [t.requires_grad_() for t in (x, logits, gate_up, b1, down, b2)]
    y, grads_ = go.run(recipe, *leaves, dy)
    ref_leaves = [t.detach().cpu().clone().requires_grad_() for t in leaves]
    ids, w = go.route(ref_leaves[1])
    ref = go.reference(ref_leaves[0], ids, w, *ref_leaves[2:])
    ref.backward(dy.cpu().double())
    assert go.rel(y.cpu(), ref) < tol
    for name, g_, leaf in zip(("x", "logits", "gate_up", "b1", "down", "b2"), grads_, ref_leaves):
        assert go.rel(g_.cpu(), leaf.grad) < 2 * tol, f"d{name}: {go.rel(g_.cpu(), leaf.grad):.4f}"


@pytest.mark.parametrize("recipe", ["bf16", "flow", "flow-fp4"])
@pytest.mark.parametrize("frozen", ["w1", "w2", "both"])
def test_gpu_frozen_expert_weights_give_the_other_gradients_bits(recipe, frozen):
    """Frozen expert weights (LoRA on attention, experts frozen by hand): the backward skips their
    wgrads and, in the flow recipes, the column copies only those read; every gradient still asked
    for has the bits of the backward that computes them all."""
    x, logits, w1, w2, dy = problem(12)
    ids, w = route(logits.detach())
    x, ids, w, w1, w2, dy = [t.detach().to(DEV) for t in (x, ids, w, w1, w2, dy)]
    full_in = [x.clone().requires_grad_(), w.clone().requires_grad_(), w1.clone().requires_grad_(),
               w2.clone().requires_grad_()]
    y = ft.experts(full_in[0], ids, full_in[1], full_in[2], full_in[3], recipe=recipe)
    full = torch.autograd.grad((y.float() * dy).sum(), full_in)
    part_in = [x.clone().requires_grad_(), w.clone().requires_grad_(), w1.clone(), w2.clone()]
    if frozen != "w1" and frozen != "both":
        part_in[2].requires_grad_()
    if frozen != "w2" and frozen != "both":
        part_in[3].requires_grad_()
    y2 = ft.experts(part_in[0], ids, part_in[1], part_in[2], part_in[3], recipe=recipe)
    assert torch.equal(y2, y)
    wanted = [i for i, t in enumerate(part_in) if t.requires_grad]
    part = torch.autograd.grad((y2.float() * dy).sum(), [part_in[i] for i in wanted])
    for i, g in zip(wanted, part):
        assert torch.equal(g, full[i]), ("dx", "dprobs", "dw1", "dw2")[i]


# ---- gpt-oss's weights read where they are stored (issue 52) ----------------------------------------
@pytest.mark.parametrize("recipe,dtype,align", [(r, d, 128) for r in ("blockwise", "flow", "flow-fp4")
                                                for d in (torch.float32, torch.bfloat16)]
                         + [("bf16", torch.bfloat16, 128), ("flow", torch.bfloat16, 64)])
def test_gpu_gpt_oss_weights_read_in_place_give_the_bits_of_relaid_ones(recipe, dtype, align):
    """The FP8 block recipes quantize gpt-oss's gate_up_proj [E, H, 2F] (interleaved) and down_proj
    [E, F, H], H and F not multiples of 128, where they are (no relaid copy) and their wgrad writes
    the gradients there (align 128; with align 64 the layer's layout, mapped back); bf16 relays BF16
    weights straight into its copies. Every output and gradient has the bits of the same weights
    given in the layer's layout."""
    import test_experts_gpt_oss as go
    from flowmoe import experts as fx

    bf16 = dtype == torch.bfloat16
    assert fx._reads_stored(recipe, "cuda", bf16)
    x, logits, gate_up, b1, down, b2, dy = (t.detach().to(DEV) for t in go.problem(1, dtype))
    leaves = [t.clone().requires_grad_() for t in (x, logits, gate_up, b1, down, b2)]
    y, g = go.run(recipe, *leaves, dy, align=align)
    assert g[2].dtype == dtype and g[2].shape == gate_up.shape and g[4].shape == down.shape
    go.assert_same_bits_as_relaid(y, g, go.run_relaid(recipe, x, logits, gate_up, b1, down, b2, dy, align))


def test_gpu_gpt_oss_bf16_grouped_kernels_write_the_stored_gradients():
    """bf16 on its grouped kernels (sync_free, as flowmoe.hf runs it) reads gate_up_proj and down_proj
    where they are stored (no relaid copy: gemm.h StoredW) and its BF16 wgrad writes their gradients
    there (the layer's writes_stored_grads; no mapping pass): y and the routing and bias gradients
    with the bits of the weights relaid by hand; dx within a BF16 rounding (GEMM1's dgrad reduces over
    the stored gate / up pairs' order); the two weights' within one BF16 rounding of theirs (the
    swapped operands' FP32 sums, rounded once)."""
    import test_experts_gpt_oss as go
    from flowmoe.experts import _layers

    x, logits, gate_up, b1, down, b2, dy = (t.detach().to(DEV) for t in go.problem(3, torch.bfloat16))
    leaves = [t.clone().requires_grad_() for t in (x, logits, gate_up, b1, down, b2)]
    y, g = go.run("bf16", *leaves, dy, sync_free=True)
    layer = next(iter(_layers[id(leaves[2])][1].values()))
    assert layer._stored_grads(layer._runner, True), "the layer maps the gradients instead of writing them"
    y2, (dx, dl, dw1, db1, dw2, db2) = go.run_relaid("bf16", x, logits, gate_up, b1, down, b2, dy, sync_free=True)
    assert torch.equal(y, y2) and torch.equal(g[1], dl) and torch.equal(g[5], db2)
    assert torch.equal(torch.cat([g[3][:, 0::2], g[3][:, 1::2]], 1), db1)
    # (a row's rounding differences scale with the row, not with each element: bounded per row)
    ddx = (g[0].float() - dx.float()).abs()
    row = dx.float().abs().amax(dim=-1, keepdim=True)
    assert bool((ddx <= row * 2.0 ** -6 + 2.0 ** -20).all()), float(ddx.max())
    g1 = g[2].transpose(1, 2)
    for got, want, name in ((torch.cat([g1[:, 0::2], g1[:, 1::2]], 1), dw1, "gate_up_proj"),
                            (g[4].transpose(1, 2), dw2, "down_proj")):
        assert got.dtype == torch.bfloat16 and float(want.float().abs().sum()) > 0, name
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= want.float().abs() * 2.0 ** -7).all()), (name, float(diff.max()))


def test_gpu_gpt_oss_bf16_plans_no_relay_and_takes_unaligned_weights():
    """bf16 on its grouped kernels, built knowing gpt-oss's storage (C ABI v12 bf16_storage): its
    transient region keeps no room for relaying the weights (the relaid W1 and W2 less than the same
    layer built without the storage), and weights whose bases are not 16-byte aligned (a view at an
    odd offset) are given to it as aligned copies, with the bits of the aligned weights."""
    import test_experts_gpt_oss as go
    from flowmoe import _native
    from flowmoe.experts import _layers

    x, logits, gate_up, b1, down, b2, dy = (t.detach().to(DEV) for t in go.problem(4, torch.bfloat16))
    leaves = [t.clone().requires_grad_() for t in (x, logits, gate_up, b1, down, b2)]
    y, g = go.run("bf16", *leaves, dy, sync_free=True)
    layer = next(iter(_layers[id(leaves[2])][1].values()))
    r = layer._runner
    cfg = layer._config(r.max_tokens)
    without = _native.Layer(cfg, device=torch.cuda.current_device(), stream=r.stream.cuda_stream, sync_free=True,
                            caller_memory=True, bf16_params_in_place=True, bf16_params_stored=True).memory_plan()
    hp, fp = layer.hidden, layer.ffn
    relay = 2 * go.E * (2 * fp * hp + hp * fp)
    assert without[2] - r.plan[2] >= relay, (without, r.plan, relay)

    def unaligned(t):  # the same values at a base 2 bytes past a 16-byte boundary
        buf = torch.zeros(t.numel() + 8, dtype=t.dtype, device=DEV)
        v = buf[1:1 + t.numel()].view(t.shape)
        v.copy_(t)
        return v.detach().requires_grad_()

    odd = [t.clone().requires_grad_() for t in (x, logits)] + [unaligned(gate_up), b1.clone().requires_grad_(),
                                                               unaligned(down), b2.clone().requires_grad_()]
    assert odd[2].data_ptr() % 16 != 0 and odd[4].data_ptr() % 16 != 0
    y2, g2 = go.run("bf16", *odd, dy, sync_free=True)
    assert torch.equal(y, y2)
    for a, b, name in zip(g, g2, ("x", "logits", "gate_up", "b1", "down", "b2")):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("recipe", ["flow", "bf16"])
def test_gpu_gpt_oss_forward_keeps_no_relaid_weights(recipe):
    """Between forward and backward the node of the in-place path holds no copy of the weights (flow
    quantizes them where stored; bf16 relays them in each pass into scratch): the relaying path
    holds at least the relaid W1 and W2 more."""
    import test_experts_gpt_oss as go

    x, logits, gate_up, b1, down, b2, dy = (t.detach().to(DEV) for t in go.problem(2, torch.bfloat16))
    relaid_bytes = 0

    def held(transposed):
        nonlocal relaid_bytes
        leaves = [t.clone().requires_grad_() for t in (x, logits, gate_up, b1, down, b2)]
        ids, w = go.route(leaves[1])
        if transposed:
            w1, w2, b1_ = leaves[2], leaves[4], leaves[3]
        else:
            gu = leaves[2].transpose(1, 2)
            w1 = torch.cat([gu[:, 0::2], gu[:, 1::2]], 1)  # (differentiable copies, kept by the node)
            w2 = leaves[4].transpose(1, 2).contiguous()
            b1_ = torch.cat([leaves[3][:, 0::2], leaves[3][:, 1::2]], 1)
            relaid_bytes = w1.numel() * w1.element_size() + w2.numel() * w2.element_size()
        kw = dict(transposed=True, interleaved=True) if transposed else {}
        ft.experts(leaves[0], ids, w, w1, w2, recipe=recipe, b1=b1_, b2=leaves[5], activation="clamped-swiglu",
                   swiglu_alpha=go.ALPHA, swiglu_limit=go.LIMIT, **kw)  # warm-up: the layer is built
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = ft.experts(leaves[0], ids, w, w1, w2, recipe=recipe, b1=b1_, b2=leaves[5], activation="clamped-swiglu",
                       swiglu_alpha=go.ALPHA, swiglu_limit=go.LIMIT, **kw)
        torch.cuda.synchronize()
        out = torch.cuda.memory_allocated() - before
        del y
        return out

    stored, relaid = held(True), held(False)
    assert relaid_bytes > 0 and relaid - stored >= relaid_bytes, (stored, relaid, relaid_bytes)


def test_gpu_bf16_reads_bf16_parameters_in_place():
    """bf16 with BF16 parameters in the layer's layout: the weights region holds no BF16 copy (the
    layer of FP32 masters does: 2 bytes per expert weight more), the forward and the backward read
    the parameters (the bits of the copies: test_gpu_bf16_parameters_give_the_bits_of_fp32_masters),
    a non-finite parameter is still refused, and the weights train in a loop with fused AdamW."""
    from flowmoe.experts import _layers
    from flowmoe import FlowmoeError

    m = ft.MoEExperts(512, 384, 8, 2, recipe="bf16", seed=5, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(6)
    x = torch.randn(300, 512, device=DEV, dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, 8, (300, 2), device=DEV, generator=g, dtype=torch.int32)
    w = torch.rand(300, 2, device=DEV, generator=g)

    def plan(w1, w2):
        owner = torch.nn.Module()
        ft.experts(x, ids, w, w1, w2, recipe="bf16", owner=owner)
        r = next(iter(_layers[id(owner)][1].values()))._runner
        return r.plan, r.params_in_place

    (p16, in_place16), (p32, in_place32) = plan(m.w1.detach().bfloat16(), m.w2.detach().bfloat16()), \
        plan(m.w1.detach(), m.w2.detach())
    assert in_place16 and not in_place32
    weight_elems = m.w1.numel() + m.w2.numel()
    assert p32[0] - p16[0] >= 2 * weight_elems, (p16, p32)
    assert p16[0] < weight_elems  # (no copy of the expert weights at all: the router's tables only)

    w1 = torch.nn.Parameter(m.w1.detach().bfloat16())
    w2 = torch.nn.Parameter(m.w2.detach().bfloat16())
    bad = w1.detach().clone()
    bad[3, 5, 7] = float("nan")
    with pytest.raises(FlowmoeError, match="non-finite"):
        ft.experts(x, ids, w, bad, w2, recipe="bf16")
    opt = torch.optim.AdamW([w1, w2], lr=1e-3, fused=True)
    before = [w1.detach().clone(), w2.detach().clone()]
    losses = []
    for _ in range(3):
        opt.zero_grad()
        y = ft.experts(x, ids, w, w1, w2, recipe="bf16")
        loss = y.float().square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert not torch.equal(w1, before[0]) and not torch.equal(w2, before[1])
    assert losses[-1] < losses[0], losses
