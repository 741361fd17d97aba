"""The C ABI's one-call forward and backward (version 9: flowmoe_layer_forward_call /
flowmoe_layer_backward_call, everything a call needs in its arguments) on the CPU layer: the bits of
the earlier entry points called after their setters, a step given back as bytes, the gradients'
struct with db1; the stored-weights rules as the library states them; bad arguments as clear errors."""

import ctypes

import pytest
import torch

import flowmoe._native as native
from flowmoe._errors import FlowmoeError
from flowmoe.torch import MoE

H, F, E, K, T = 128, 128, 4, 2, 24


def problem(recipe):
    m = MoE(H, F, E, K, recipe=recipe, seed=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).bfloat16()
    dy = torch.randn(T, H, generator=g).bfloat16()
    return m, x, dy


def weights(m):
    return m.w1.detach(), m.w2.detach(), m.wr.detach()


@pytest.mark.parametrize("recipe", ["bf16", "flow"])
def test_one_call_forward_and_backward_give_the_bits_of_the_setter_sequence(recipe):
    m, x, dy = problem(recipe)
    w1, w2, wr = weights(m)
    outs = []
    for one_call in (False, True):
        layer = native.Layer(m._config(T))
        layer.set_weights(w1.data_ptr(), w2.data_ptr(), wr.data_ptr())
        y, dx = torch.empty_like(x), torch.empty_like(x)
        gs = [torch.full_like(w, float("nan")) for w in (w1, w2, wr)]
        if one_call:
            layer.forward_call(x.data_ptr(), T, y.data_ptr())
            # a second forward, then the first one's state given back as bytes
            cap = layer.step_state(0, 0)
            step = torch.empty(cap, dtype=torch.uint8)
            layer.step_state(step.data_ptr(), cap)
            x2, y2 = x.flip(0).contiguous(), torch.empty_like(x)  # (alive while the call runs)
            layer.forward_call(x2.data_ptr(), T, y2.data_ptr())
            layer.backward_call(dy.data_ptr(), dx.data_ptr(), (0, 0, 0), (step.data_ptr(), cap),
                                dw1=gs[0].data_ptr(), dw2=gs[1].data_ptr(), bf16=False, dwr=gs[2].data_ptr())
        else:
            layer.forward(x.data_ptr(), T, y.data_ptr())
            layer.backward(dy.data_ptr(), dx.data_ptr(), *[g.data_ptr() for g in gs], False)
        layer.close()
        outs.append((y, dx, *gs))
    for name, a, b in zip(("y", "dx", "dw1", "dw2", "dwr"), *outs):
        assert torch.equal(a, b), name
    assert all(bool(torch.isfinite(g).all()) for g in outs[1][2:])


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
    # a gradients struct with a flag that is not 0 / 1
    g = native.Grads(None, None, 0, None, None, None, 0, 0, 0, 2)
    c = native.BackwardCall(dy.data_ptr(), dx.data_ptr(), g, None, native.Memory(None, None, None), None, 0)
    with pytest.raises(FlowmoeError, match="interleaved = 2"):
        native.check(native.lib().flowmoe_layer_backward_call(layer.handle, ctypes.byref(c)))
    # weights described as stored with sizes larger than the layer's: refused, the sizes named
    with pytest.raises(FlowmoeError, match="stored sizes H 129"):
        layer.set_weights(w1.data_ptr(), w2.data_ptr(), wr.data_ptr(), storage=(H + 1, 64, True))
    # parameters with the forward: only the CUDA bf16 layer with bf16_params_in_place reads them there
    assert not layer.reads_params_in_place
    with pytest.raises(FlowmoeError, match="reads_params_in_place"):
        layer.forward_call(x.data_ptr(), T, y.data_ptr(), params=(w1.data_ptr(), w2.data_ptr()))
    assert layer.reads_stored_weights(True) and layer.reads_stored_weights(False)  # (the CPU reference)
    assert layer.writes_stored_grads((100, 64, True), False) and not layer.writes_stored_grads((H + 1, 64, True), False)
    layer.close()


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
