"""flowmoe.torch.MoE on the CUDA backend (marked gpu: skipped without a CUDA device or a CUDA build).

The module equals the CUDA layer called through the C ABI bit for bit; micro-batches accumulate;
an AdamW step changes the weights and the next forward uses them; a non-default current stream
gives the same bits; with two GPUs, expert parallelism over NCCL equals one GPU holding all
experts (bitwise, as the C++ layer)."""

import os
import subprocess
import sys

import pytest
import torch

import flowmoe._native as native
from flowmoe.torch import MoE

pytestmark = pytest.mark.gpu

H, F, E, K = 256, 256, 8, 2
RECIPES = ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4")


def make(recipe, **kw):
    kw.setdefault("seed", 3)
    return MoE(H, F, E, K, recipe=recipe, aux_loss_coef=0.01, **kw).cuda()


def data(T=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    dy = torch.randn(T, H, generator=g).bfloat16().cuda()
    return x, dy


def run_module(m, x, dy):
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(dy)
    torch.cuda.synchronize()
    return [y.detach(), x.grad, m.w1.grad.clone(), m.w2.grad.clone(), m.wr.grad.clone()]


@pytest.mark.parametrize("recipe", RECIPES)
def test_module_equals_cuda_layer_bitwise(recipe):
    m = make(recipe)
    x, dy = data()
    got = run_module(m, x, dy)
    stream = torch.cuda.current_stream()
    layer = native.Layer(m._config(x.shape[0]), device=torch.cuda.current_device(), stream=stream.cuda_stream)
    w = [m.w1.detach(), m.w2.detach(), m.wr.detach()]
    layer.set_weights(*[t.data_ptr() for t in w])
    y = torch.empty_like(x)
    layer.forward_call(x.data_ptr(), x.shape[0], y.data_ptr())
    dx = torch.empty_like(x)
    gs = [torch.full_like(t, float("nan")) for t in w]
    layer.backward_call(dy.data_ptr(), dx.data_ptr(), (0, 0, 0), None, dw1=gs[0].data_ptr(), dw2=gs[1].data_ptr(),
                        bf16=False, dwr=gs[2].data_ptr())
    torch.cuda.synchronize()
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dwr"), got, [y, dx] + gs):
        assert torch.equal(a, b), f"{recipe}: {name} differs from the CUDA layer"
    assert m.status() == layer.status()
    layer.close()


@pytest.mark.parametrize("recipe", ["blockwise", "fp8-naive", "flow", "flow-fp4"])
def test_sync_free_gives_the_same_bits(recipe):
    # CudaLayerOptions::sync_free: no host synchronisation inside forward/backward, same results
    x, dy = data()
    a = run_module(make(recipe), x, dy)
    m = make(recipe, sync_free=True)
    b = run_module(m, x, dy)
    for name, u, v in zip(("y", "dx", "dw1", "dw2", "dwr"), a, b):
        assert torch.equal(u, v), f"{recipe}: {name} differs with sync_free"
    assert m.status()["nonfinite"] == 0


@pytest.mark.parametrize("recipe", ["bf16", "blockwise", "flow-fp4"])
def test_sync_free_step_replays_from_a_torch_cuda_graph(recipe):
    # A sync_free module's forward + backward captured in a torch.cuda.CUDAGraph (torch's recipe:
    # an eager warm-up step on a side stream, then capture with static input and output tensors)
    # and replayed equals the same two eager steps bit for bit; .grad is accumulated into.
    x, dy = data()
    eager = make(recipe, sync_free=True)
    run_module(eager, x, dy)
    want = run_module(eager, x, dy)  # the second step: .grad accumulated

    m = make(recipe, sync_free=True)
    sx = x.clone().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: builds the layer, quantizes the weights, creates .grad
        m(sx).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    sx.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = m(sx)
        sy.backward(dy)
    graph.replay()
    torch.cuda.synchronize()
    got = [sy.detach(), sx.grad, m.w1.grad, m.w2.grad, m.wr.grad]
    for name, u, v in zip(("y", "dx", "dw1", "dw2", "dwr"), want, got):
        assert torch.equal(u, v), f"{recipe}: {name} of the replayed step differs from the eager step"
    graph.replay()  # a second replay accumulates once more, like a third eager step
    want3 = run_module(eager, x, dy)
    torch.cuda.synchronize()
    for name, u, v in zip(("dw1", "dw2", "dwr"), want3[2:], (m.w1.grad, m.w2.grad, m.wr.grad)):
        assert torch.equal(u, v), f"{recipe}: {name} after two replays differs from three eager steps"
    assert m.status()["nonfinite"] == 0


def test_sync_free_graph_replays_follow_optimizer_steps():
    # While capturing, the module records the weight re-quantization even though the weights have
    # not changed since the warm-up, so a loop of (replay, optimizer step on the masters in place,
    # zero_grad in place) equals the same loop run eagerly.
    x, dy = data()
    eager = make("flow", sync_free=True)
    ex = x.clone().requires_grad_()
    eopt = torch.optim.SGD(eager.parameters(), lr=0.5)
    for _ in range(3):
        eager(ex).backward(dy)
        eopt.step()
        eopt.zero_grad(set_to_none=False)
    want_y = eager(x).detach()

    m = make("flow", sync_free=True)
    sx = x.clone().requires_grad_()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up, no optimizer step: builds the layer, creates .grad
        m(sx).backward(dy)
        opt.zero_grad(set_to_none=False)
    torch.cuda.current_stream().wait_stream(s)
    sx.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m(sx).backward(dy)
    for _ in range(3):
        graph.replay()
        opt.step()
        opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    for name, u, v in zip(("w1", "w2", "wr"), (eager.w1, eager.w2, eager.wr), (m.w1, m.w2, m.wr)):
        assert torch.equal(u, v), f"{name} after 3 replayed steps differs from 3 eager steps"
    assert torch.equal(want_y, m(x).detach())


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # (nothing was captured: the point)
def test_capture_without_sync_free_or_warm_up_is_a_clear_error():
    x, _ = data()
    m = make("flow")
    m(x)  # warm-up
    with pytest.raises(Exception, match="sync_free=True"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            m(x)
    cold = make("flow", sync_free=True)  # no eager forward yet: building the layer would allocate
    with pytest.raises(Exception, match="warm-up"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            cold(x)


@pytest.mark.parametrize("recipe", ["bf16", "flow"])
def test_two_micro_batches_accumulate(recipe):
    x1, dy1 = data(T=200, seed=1)
    x2, dy2 = data(T=256, seed=2)
    a = make(recipe)
    g1 = run_module(a, x1, dy1)[2:]
    b = make(recipe)
    g2 = run_module(b, x2, dy2)[2:]
    m = make(recipe)
    run_module(m, x1, dy1)
    for p, g in zip((m.w1, m.w2, m.wr), g1):
        assert torch.equal(p.grad, g)  # .grad None: overwritten
    run_module(m, x2, dy2)
    for p, u, v in zip((m.w1, m.w2, m.wr), g1, g2):
        torch.testing.assert_close(p.grad, u + v, rtol=1e-5, atol=1e-5)


def test_adamw_step_changes_weights_and_next_forward_uses_them():
    m = make("flow")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, dy = data()
    y0 = run_module(m, x, dy)[0]
    before = [p.detach().clone() for p in m.parameters()]
    opt.step()
    opt.zero_grad()
    assert all(not torch.equal(p, q) for p, q in zip(m.parameters(), before))
    y1 = m(x).detach()
    assert m.weight_updates == 2
    assert not torch.equal(y0, y1)
    fresh = make("flow")
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh(x).detach(), y1)


def test_other_current_stream_gives_same_bits():
    m = make("flow")
    x, dy = data()
    ref = run_module(m, x, dy)
    m.zero_grad(set_to_none=True)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        got = run_module(m, x, dy)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_cpu_and_cuda_modules_agree_within_precision():
    m = make("bf16")
    x, dy = data(T=64)
    g = run_module(m, x, dy)
    c = make("bf16").cpu()
    h = run_module(c, x.cpu(), dy.cpu())
    for a, b in zip(g, h):
        err = float((a.cpu().double() - b.double()).norm() / b.double().norm())
        assert err < 0.01


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ep_two_gpus_nccl_equals_one_gpu(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    store = tmp_path / "store"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "ep_worker.py"), str(r), "2", str(store),
                               str(tmp_path), native.library_path(), "values-cuda"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}:\n{o}"
    from ep_common import EP_RECIPES, TOKENS, ep_inputs, ep_module

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    xs, dys = zip(*[ep_inputs(r) for r in range(2)])
    El = ep_module("bf16").experts // 2
    for recipe in EP_RECIPES:
        m = ep_module(recipe).cuda()
        x = torch.cat(xs).cuda().requires_grad_()
        y = m(x)
        y.backward(torch.cat(dys).cuda())
        lo = 0
        for r, res in enumerate(ranks):
            got, hi = res[recipe], lo + TOKENS[r]
            assert torch.equal(got["y"], y.detach()[lo:hi].cpu()), f"{recipe}: y of rank {r}"
            assert torch.equal(got["dx"], x.grad[lo:hi].cpu()), f"{recipe}: dx of rank {r}"
            assert torch.equal(got["dw1"], m.w1.grad[r * El:(r + 1) * El].cpu()), f"{recipe}: dw1 rank {r}"
            assert torch.equal(got["dw2"], m.w2.grad[r * El:(r + 1) * El].cpu()), f"{recipe}: dw2 rank {r}"
            lo = hi
