"""flowmoe.torch.MoE as a PyTorch op on the CUDA backend (marked gpu): memory from PyTorch's
allocator, several forwards in flight with the scratch overwritten between calls, every optimizer
step seen, torch.compile, against the module's own (forward, backward) pairs and fresh modules,
bit for bit."""

import pytest
import torch

from flowmoe.torch import MoE

pytestmark = pytest.mark.gpu

H, F, E, K = 256, 256, 8, 2
RECIPES = ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4")


def make(recipe, **kw):
    kw.setdefault("seed", 5)
    return MoE(H, F, E, K, recipe=recipe, router="sigmoid", renormalize=True, aux_loss_coef=0.01, **kw).cuda()


def data(T=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, H, generator=g).bfloat16().cuda(), torch.randn(T, H, generator=g).bfloat16().cuda())


def pair(m, x, dy):
    m.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(dy)
    torch.cuda.synchronize()
    return [y.detach(), x.grad] + [p.grad.clone() for p in (m.w1, m.w2, m.wr)]


def requested_bytes():
    """The bytes PyTorch's live CUDA tensors asked for (the caching allocator's exact sizes)."""
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


def poison(m):
    """Overwrites the layer's scratch: the allocator hands the freed transient block out again."""
    n = m._runner.plan[2]
    if n:
        torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xFF)


@pytest.mark.parametrize("sync_free", (False, True))
@pytest.mark.parametrize("recipe", RECIPES)
def test_retain_graph_second_backward_same_bits_after_a_larger_layer(recipe, sync_free):
    """backward(retain_graph=True) twice: twice the gradients of one, bit for bit, with the scratch
    overwritten in between and the module rebuilt for a larger input (the forward keeps its own
    native layer)."""
    m = make(recipe, sync_free=sync_free)
    x, dy = data(300, 3)
    want = pair(m, x, dy)
    m.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    y = m(xr)
    y.backward(dy, retain_graph=True)
    poison(m)
    m(data(700, 4)[0]).sum().backward()  # a larger input: the module builds a larger layer
    assert m._runner.max_tokens >= 700
    m.zero_grad(set_to_none=True)
    xr.grad = None
    poison(m)
    y.backward(dy)
    torch.cuda.synchronize()
    for a, b in zip(want[1:], [xr.grad] + [p.grad for p in (m.w1, m.w2, m.wr)]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sync_free", (False, True))
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_forwards_in_flight_with_the_scratch_overwritten(recipe, sync_free):
    m = make(recipe, sync_free=sync_free)
    (x1, dy1), (x2, dy2) = data(300, 1), data(211, 2)
    want1, want2 = pair(m, x1, dy1), pair(m, x2, dy2)
    m.zero_grad(set_to_none=True)
    xa, xb = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    ya = m(xa)
    poison(m)
    yb = m(xb)
    poison(m)
    yb.backward(dy2)
    g2 = [p.grad.clone() for p in (m.w1, m.w2, m.wr)]
    poison(m)
    m.zero_grad(set_to_none=True)
    ya.backward(dy1)
    torch.cuda.synchronize()
    g1 = [p.grad.clone() for p in (m.w1, m.w2, m.wr)]
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dwr"), [ya.detach(), xa.grad] + g1, want1):
        assert torch.equal(a, b), f"{recipe}: {name} of the first forward in flight"
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dwr"), [yb.detach(), xb.grad] + g2, want2):
        assert torch.equal(a, b), f"{recipe}: {name} of the second forward in flight"


@pytest.mark.parametrize("fused", (True, False))
@pytest.mark.parametrize("recipe", ("bf16", "flow", "flow-fp4"))
def test_adamw_fused_and_foreach_steps_are_seen(recipe, fused):
    m = make(recipe)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    x, dy = data()
    for _ in range(3):
        pair(m, x, dy)
        opt.step()
        fresh = make(recipe)
        fresh.load_state_dict(m.state_dict())
        got, want = pair(m, x, dy), pair(fresh, x, dy)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_saved_memory_is_pytorchs_and_freed_after_backward():
    m = make("flow")
    x, dy = data(T=1024)
    pair(m, x, dy)  # warm-up: the layer exists, the allocator holds its blocks
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    xr = x.clone().requires_grad_()
    y = m(xr)
    during = torch.cuda.memory_allocated() - base
    saved = m._runner.plan[1]
    assert during >= saved  # the saved region (and y, the weight copies) are PyTorch tensors
    y.backward(dy)
    del y
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() - base
    assert after < during - saved // 2, (during, after, saved)


@pytest.mark.parametrize("recipe", ("flow", "flow-fp4"))
def test_torch_compile_fullgraph_on_the_gpu(recipe):
    torch._dynamo.reset()
    m = make(recipe)
    x, dy = data()
    want = pair(m, x, dy)
    m.zero_grad(set_to_none=True)
    f = torch.compile(lambda t: m(t), fullgraph=True)
    xc = x.clone().requires_grad_()
    y = f(xc)
    y.backward(dy)
    torch.cuda.synchronize()
    for a, b in zip([y.detach(), xc.grad, m.w1.grad, m.w2.grad, m.wr.grad], want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe,from_params", [("flow", True), ("blockwise", True), ("bf16", False)])
def test_backward_derives_its_weights_from_the_parameters(recipe, from_params):
    # FP8 block recipes: a forward's node keeps the parameters, not its weight copies (wbuf), and
    # the backward quantizes W^T (and reads Wr) from them: the bits of the module's previous pairs
    m = make(recipe)
    x, dy = data(T=1024)
    want = pair(m, x, dy)
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    # bytes the live tensors asked for, not the allocator's blocks: a cached block reused for a
    # smaller request counts whole in memory_allocated(), so that figure depends on what earlier
    # calls left in the cache (a blockwise run once held 7.22 MB of blocks against this bound)
    base = requested_bytes()
    xr = x.clone().requires_grad_()
    y = m(xr)
    held = requested_bytes() - base
    wbuf, saved = m._runner.plan[0], m._runner.plan[1]
    assert (held < wbuf + saved) == from_params, (held, wbuf, saved)
    y.backward(dy)
    got = [y.detach(), xr.grad] + [p.grad.clone() for p in (m.w1, m.w2, m.wr)]
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dwr"), got, want):
        assert torch.equal(a, b), name
    if from_params:  # an in-place change between a forward and its backward is refused
        m.zero_grad(set_to_none=True)
        y = m(x.clone().requires_grad_())
        with torch.no_grad():
            m.w1.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward(dy)


def test_out_of_memory_leaves_the_module_usable():
    # a forward too large for the memory left fails with torch.OutOfMemoryError (what batch-size
    # finders catch); the module keeps its previous layer and a small call gives the same bits
    m = make("flow")
    x, dy = data(T=512)
    want = pair(m, x, dy)
    layer = m._runner
    big = torch.randn(1 << 21, H, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_allocated() + (1 << 30)) / total))
    try:
        with pytest.raises(torch.OutOfMemoryError):
            m(big)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert m._runner is layer
    del big
    torch.cuda.empty_cache()
    got = pair(m, x, dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
