"""The C ABI's one-call forward and backward (flowmoe_layer_forward_call / flowmoe_layer_backward_call,
everything a call needs in its arguments; version 10 removed the per-call setters) on the CPU layer:
the forward returns its step (version 11), a backward given an earlier forward's step bytes equals
the backward right after that forward, the same bytes back a second backward, the gradients' struct accumulates; the header and the library
keep no per-call setter; the stored-weights rules as the library states them; bad arguments as
clear errors."""

import ctypes
import os
import re

import pytest
import torch

import flowmoe._native as native
from flowmoe._errors import FlowmoeError
from flowmoe.torch import MoE

H, F, E, K, T = 128, 128, 4, 2, 24
HEADER = os.path.join(os.path.dirname(__file__), "..", "..", "..", "include", "flowmoe", "c_api.h")
# What version 10 removed: the per-call setters and the calls that needed them (flowmoe_layer_<name>),
# and the Python wrappers of them (Layer.<name>; Layer.set_weights stays, on set_weights_ex).
SETTERS = ("bind_memory", "set_routing", "set_gemm1_bias", "set_gemm1_bias_grad", "load_step",
           "set_backward_weights", "set_backward_weights_bf16")
REMOVED_C = SETTERS + ("forward", "backward", "backward_ex", "backward_bf16", "set_weights", "set_weights_bf16")
REMOVED_PY = SETTERS + ("forward", "backward", "backward_bf16", "set_weights_bf16")


def problem(recipe):
    m = MoE(H, F, E, K, recipe=recipe, seed=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).bfloat16()
    dy = torch.randn(T, H, generator=g).bfloat16()
    return m, x, dy


def weights(m):
    return m.w1.detach(), m.w2.detach(), m.wr.detach()


def layer_of(m):
    w1, w2, wr = weights(m)
    layer = native.Layer(m._config(T))
    layer.set_weights(w1.data_ptr(), w2.data_ptr(), wr.data_ptr())
    return layer


def backward(layer, dy, step, grads, accumulate=False):
    """backward_call of `step` (None: the latest forward) into grads [dw1, dw2, dwr] (overwritten, or
    += with accumulate): (dx, dw1, dw2, dwr)."""
    dx = torch.empty_like(dy)
    layer.backward_call(dy.data_ptr(), dx.data_ptr(), (0, 0, 0), step, dw1=grads[0].data_ptr(),
                        dw2=grads[1].data_ptr(), bf16=False, dwr=grads[2].data_ptr(), accumulate=accumulate)
    return (dx, *grads)


@pytest.mark.parametrize("recipe", ["bf16", "flow"])
def test_backward_of_an_earlier_step_equals_the_backward_after_its_forward(recipe):
    m, x, dy = problem(recipe)
    nan = [torch.full_like(w, float("nan")) for w in weights(m)]
    # the plain sequence: forward x, then its backward (no step: the latest forward)
    a = layer_of(m)
    ya = torch.empty_like(x)
    a.forward_call(x.data_ptr(), T, ya.data_ptr())
    want = backward(a, dy, None, [g.clone() for g in nan])
    a.close()
    # forward x, keep its step bytes, forward another input, then backward x's step
    b = layer_of(m)
    yb = torch.empty_like(x)
    # (the forward's output: asked with no room, its size alone and nothing written; then with room)
    cap = b.forward_call(x.data_ptr(), T, yb.data_ptr(), step=(0, 0))
    assert cap > 0 and cap == b.step_state(0, 0)
    small = torch.full((cap - 1,), 7, dtype=torch.uint8)
    assert b.forward_call(x.data_ptr(), T, yb.data_ptr(), step=(small.data_ptr(), cap - 1)) == cap
    assert bool((small == 7).all())
    step = torch.empty(cap + 5, dtype=torch.uint8)
    assert b.forward_call(x.data_ptr(), T, yb.data_ptr(), step=(step.data_ptr(), cap + 5)) == cap
    step = step[:cap].clone()
    same = torch.empty(cap, dtype=torch.uint8)
    assert b.step_state(same.data_ptr(), cap) == cap and torch.equal(step, same)
    x2, y2 = x.flip(0).contiguous(), torch.empty_like(x)  # (alive while the calls run)
    b.forward_call(x2.data_ptr(), T, y2.data_ptr())
    # without the step the backward is the second forward's: the step is what makes them equal below
    latest = backward(b, dy, None, [g.clone() for g in nan])
    assert not torch.equal(latest[0], want[0])
    got = backward(b, dy, (step.data_ptr(), cap), [g.clone() for g in nan])
    assert torch.equal(ya, yb)
    for name, u, v in zip(("dx", "dw1", "dw2", "dwr"), want, got):
        assert torch.equal(u, v), name
    assert all(bool(torch.isfinite(g).all()) for g in got[1:])
    # the bytes are not consumed: a second backward of them, accumulated into the first's gradients,
    # gives the same dx and twice the gradients (the expert wgrads may add inside their sums: within
    # rounding; the router gradient is added as one sum per element: exactly)
    again = backward(b, dy, (step.data_ptr(), cap), [g.clone() for g in got[1:]], accumulate=True)
    assert torch.equal(again[0], want[0])
    for u, v in zip(want[1:3], again[1:3]):
        torch.testing.assert_close(v, 2 * u, rtol=1e-6, atol=1e-6)
    assert torch.equal(again[3], 2 * want[3])
    b.close()


def test_header_and_library_have_no_per_call_setter():
    with open(HEADER) as f:
        # the declarations, not the comments (the version note names what was removed)
        code = "\n".join(line.split("//")[0] for line in f)
    assert "flowmoe_layer_forward_call" in code and "flowmoe_layer_set_weights_ex" in code
    for name in REMOVED_C:
        assert not re.search(rf"\bflowmoe_layer_{name}\b", code), f"c_api.h declares flowmoe_layer_{name}"
        assert not hasattr(native.lib(), f"flowmoe_layer_{name}"), f"the library exports flowmoe_layer_{name}"
    for name in REMOVED_PY:
        assert not hasattr(native.Layer, name), f"flowmoe._native.Layer.{name}"


def test_bad_call_arguments_are_clear_errors():
    m, x, dy = problem("flow")
    w1, w2, wr = weights(m)
    layer = native.Layer(m._config(T))
    layer.set_weights(w1.data_ptr(), w2.data_ptr(), wr.data_ptr())
    y = torch.empty_like(x)
    layer.forward_call(x.data_ptr(), T, y.data_ptr())
    dx = torch.empty_like(x)
    with pytest.raises(FlowmoeError, match="step"):
        layer.backward_call(dy.data_ptr(), dx.data_ptr(), (0, 0, 0), (0, 16), dw1=None, dw2=None, bf16=False)
    with pytest.raises(FlowmoeError, match="routing"):  # ids to a layer with its own router
        ids = torch.zeros(T, K, dtype=torch.int32)
        probs = torch.zeros(T, K)
        layer.forward_call(x.data_ptr(), T, y.data_ptr(), ids=ids.data_ptr(), probs=probs.data_ptr())
    # a step buffer without the size pointer, or a negative capacity: refused before the forward runs
    room = torch.empty(64, dtype=torch.uint8)
    for out, cap, size in ((room.data_ptr(), 64, None), (0, -1, ctypes.pointer(ctypes.c_int64()))):
        c = native.ForwardCall(x.data_ptr(), T, y.data_ptr(), None, None, None, native.Memory(None, None, None), None,
                               out, cap, size)
        with pytest.raises(FlowmoeError, match="step_out"):
            native.check(native.lib().flowmoe_layer_forward_call(layer.handle, ctypes.byref(c)))
    # a gradients struct with a flag that is not 0 / 1
    g = native.Grads(None, None, 0, None, None, None, 0, 0, 0, 2)
    c = native.BackwardCall(dy.data_ptr(), dx.data_ptr(), g, None, native.Memory(None, None, None), None, 0)
    with pytest.raises(FlowmoeError, match="interleaved = 2"):
        native.check(native.lib().flowmoe_layer_backward_call(layer.handle, ctypes.byref(c)))
    # weights described as stored with sizes larger than the layer's: refused, the sizes named
    with pytest.raises(FlowmoeError, match="stored sizes H 129"):
        layer.set_weights(w1.data_ptr(), w2.data_ptr(), wr.data_ptr(), storage=(H + 1, 64, True))
    # memory for a layer that owns it: refused; a null memory pointer is the same as none
    region = torch.empty(256, dtype=torch.uint8)
    with pytest.raises(FlowmoeError, match="owns its memory"):
        layer.set_weights(w1.data_ptr(), w2.data_ptr(), wr.data_ptr(), memory=(region.data_ptr(), 0, 0))
    cw = native.Weights(w1.data_ptr(), w2.data_ptr(), 0, wr.data_ptr(), None, 0, 0, 0)
    native.check(native.lib().flowmoe_layer_set_weights_ex(layer.handle, ctypes.byref(cw), None))
    # parameters with the forward: only the CUDA bf16 layer with bf16_params_in_place reads them there
    assert not layer.reads_params_in_place
    with pytest.raises(FlowmoeError, match="reads_params_in_place"):
        layer.forward_call(x.data_ptr(), T, y.data_ptr(), params=(w1.data_ptr(), w2.data_ptr()))
    assert layer.reads_stored_weights(True) and layer.reads_stored_weights(False)  # (the CPU reference)
    assert layer.writes_stored_grads((100, 64, True), False) and not layer.writes_stored_grads((H + 1, 64, True), False)
    layer.close()


@pytest.mark.gpu
def test_caller_memory_layer_takes_its_regions_with_set_weights():
    """set_weights_ex writes a caller-memory layer's weight copies into the regions passed with it
    (no bind_memory since version 10): the forward then gives the bits of the layer that owns its
    memory; without them, an error naming the missing region."""
    m, x, _ = problem("flow")
    w1, w2, wr = [t.cuda() for t in weights(m)]
    x = x.cuda()
    outs = []
    for caller_memory in (False, True):
        layer = native.Layer(m._config(T), device=torch.cuda.current_device(), caller_memory=caller_memory)
        regions = [torch.empty(n, dtype=torch.uint8, device="cuda") if n else None for n in layer.memory_plan()]
        memory = tuple(r.data_ptr() if r is not None else 0 for r in regions)
        assert (memory[0] != 0) == caller_memory
        if caller_memory:
            with pytest.raises(FlowmoeError, match="memory.weights is null"):
                layer.set_weights(w1.data_ptr(), w2.data_ptr(), wr.data_ptr())
        layer.set_weights(w1.data_ptr(), w2.data_ptr(), wr.data_ptr(), memory=(memory[0], 0, memory[2]))
        y = torch.empty_like(x)
        if caller_memory:
            assert layer.forward_call(x.data_ptr(), T, y.data_ptr(), memory, step=(0, 0)) > 0
        else:  # (a layer that owns its memory has no step to give: refused before the forward)
            with pytest.raises(FlowmoeError, match="owns its memory"):
                layer.forward_call(x.data_ptr(), T, y.data_ptr(), memory, step=(0, 0))
        layer.forward_call(x.data_ptr(), T, y.data_ptr(), memory)
        torch.cuda.synchronize()
        outs.append(y)
        layer.close()
    assert torch.equal(outs[0], outs[1])


def test_stored_weights_rule_is_the_librarys():
    rule = native.recipe_reads_stored_weights
    for recipe in ("blockwise", "flow", "flow-fp4"):
        assert rule(recipe, "cuda", False) and rule(recipe, "cuda", True)
    for recipe in ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4"):
        assert rule(recipe, "cpu", False) and rule(recipe, "cpu", True)  # (the CPU layer relays them)
    assert rule("bf16", "cuda", True) and not rule("bf16", "cuda", False)
    assert not rule("fp8-naive", "cuda", True)
    with pytest.raises(FlowmoeError, match="backend 'tpu'"):
        rule("flow", "tpu", True)
    with pytest.raises(FlowmoeError):
        rule("no-such-recipe", "cuda", True)


def test_config_check_takes_the_in_place_options_rules():
    """flowmoe_config_check refuses what make_cuda_layer refuses of the BF16-parameters options (one
    rule, moe.h check_param_options): bf16_params_stored without bf16_params_in_place, and
    bf16_params_in_place without caller memory; a flag that is not 0 / 1 is named."""
    m, _, _ = problem("bf16")
    cfg = m._config(T)

    def check(sync_free, caller_memory, in_place, stored, storage=(0, 0, 0)):
        opts = native.CudaOptions(sync_free, caller_memory, in_place, stored, *storage)
        native.check(native.lib().flowmoe_config_check(ctypes.byref(cfg), 0, ctypes.byref(opts)))

    check(0, 1, 1, 1)  # (accepted: what flowmoe.torch.experts builds for gpt-oss's BF16 parameters)
    check(0, 1, 1, 0)
    with pytest.raises(FlowmoeError, match="bf16_params_stored without bf16_params_in_place"):
        check(0, 1, 0, 1)
    with pytest.raises(FlowmoeError, match="bf16_params_in_place without caller_memory"):
        check(0, 0, 1, 0)
    with pytest.raises(FlowmoeError, match="bf16_params_stored = 2"):
        check(0, 1, 1, 2)
    # (version 12) the storage known at construction: only with stored parameters, sizes >= 1
    check(0, 1, 1, 1, (2880, 2880, 1))  # (gpt-oss-20b's, what flowmoe.torch.experts passes)
    with pytest.raises(FlowmoeError, match="bf16_storage without bf16_params_stored"):
        check(0, 1, 1, 0, (2880, 2880, 1))
    with pytest.raises(FlowmoeError, match="bf16_storage of H = 2880, F = 0"):
        check(0, 1, 1, 1, (2880, 0, 1))
    with pytest.raises(FlowmoeError, match="stored_interleaved = 3"):
        check(0, 1, 1, 1, (2880, 2880, 3))
