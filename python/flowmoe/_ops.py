"""The flowmoe MoE layer as PyTorch operators (torch.library custom ops), used by flowmoe.torch.MoE.

Operators, each opaque to torch.compile and with a fake (meta) implementation:

- ``flowmoe::derive_weights(w1, w2, wr, router_bias, module_id, tokens) -> wbuf``: the layer's
  weight copies (BF16 / FP8 blocks with their transposes) made from the FP32 masters (or from w1, w2
  as BF16 parameters, used as the BF16 copies: no FP32 copy; the experts-only layer), into a new
  uint8 tensor (CUDA; CPU: the copies stay inside the CPU layer and wbuf is empty).
- ``flowmoe::moe_forward(x, w1, w2, wr, wbuf, module_id, keep_step) -> (y, saved, step)``: y and
  what the backward needs: a uint8 tensor ``saved`` on x's device (CUDA: codes, scales and routing
  tables; CPU: empty) and ``step``, a uint8 CPU tensor holding the forward's host state as a value
  (_runner.py: the native layer's id and its step_state bytes; CPU: the whole saved state). Autograd
  keeps both as the node's saved tensors, so a second backward through one forward
  (retain_graph=True) gives the same gradients again; nothing outside the graph holds a forward's
  state. w1, w2, wr are passed for autograd only (the op reads wbuf).
- ``flowmoe::moe_backward(...)`` / ``flowmoe::moe_backward_accumulate(...)``: dx and the weight
  gradients as new tensors, or (main_grad mode, eager only) accumulated into given FP32 buffers.
- ``flowmoe::experts_forward(x, ids, probs, w1, w2, wbuf, module_id, keep_step)`` and
  ``flowmoe::experts_backward(...)``: the experts-only layer (routing from the caller, issue 31;
  wr is None in its derive_weights): the same contract, with the routing's ids [T, k] int32 and
  probs [T, k] fp32 as inputs and d loss / d probs as an output of the backward. Its weight
  gradients come in the parameters' dtype (BF16 parameters: BF16 written by the wgrad itself). Where
  the layer takes them (the FP8 block recipes on CUDA), its backward gets the parameters w1, w2
  instead of wbuf and quantizes the dgrad weights from them: no weight copy outlives its forward.

Memory (CUDA): every buffer comes from PyTorch's caching allocator: wbuf per weight refresh, saved
per forward (freed when autograd frees the graph), and one transient scratch per call, returned to
the allocator when the call's work on the stream is done and reused by every layer.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ._errors import FlowmoeError
from ._runner import _Runner

_lock = threading.Lock()
_modules: Dict[int, "weakref.ref"] = {}  # module_id -> the MoE module
_ids = itertools.count(1)


def register_module(module) -> int:
    with _lock:
        i = next(_ids)
        _modules[i] = weakref.ref(module)
    return i


def _module(module_id: int):
    ref = _modules.get(module_id)
    m = ref() if ref is not None else None
    if m is None:
        raise FlowmoeError(f"flowmoe: operator called for module id {module_id}, which no longer exists")
    return m


def _no_step() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _fake_step(keep_step: bool) -> torch.Tensor:
    """The fake step of a forward: its size is known only when the layer has run."""
    if not keep_step:
        return _no_step()
    return torch.empty(torch.library.get_ctx().new_dynamic_size(min=9), dtype=torch.uint8)


def _addr(t: Optional[torch.Tensor]) -> int:
    return t.data_ptr() if t is not None and t.numel() > 0 else 0


def _bytes(n: int, device) -> torch.Tensor:
    return torch.empty(int(n), dtype=torch.uint8, device=device)


def layer_weights(w1: torch.Tensor, w2: torch.Tensor):
    """w1, w2 as the layer takes them: contiguous FP32 masters, or BF16 parameters as they are (the
    layer's BF16 copies are then their values: no FP32 copy, the bits of FP32 masters holding them).
    Other dtypes (float16, float64, mixed) and strides are converted to contiguous FP32, a copy that
    lives as long as the call that needs it."""
    if w1.dtype == w2.dtype and w1.dtype in (torch.float32, torch.bfloat16):
        return w1.contiguous(), w2.contiguous()  # (no copy for contiguous parameters)
    return w1.to(torch.float32).contiguous(), w2.to(torch.float32).contiguous()


# ---- derive_weights ---------------------------------------------------------------------------------
@torch.library.custom_op("flowmoe::derive_weights", mutates_args=())
def derive_weights(w1: torch.Tensor, w2: torch.Tensor, wr: Optional[torch.Tensor], router_bias: Optional[torch.Tensor],
                   module_id: int, tokens: int) -> torch.Tensor:
    m = _module(module_id)
    r = m._ensure_runner(w1.device, tokens)
    # w1 / w2: FP32 masters, or BF16 parameters (both of one dtype: the layer's BF16 copies are then
    # their values, the bits of FP32 masters holding them, with no FP32 copy)
    expert_dtype = w1.dtype if w1.dtype in (torch.float32, torch.bfloat16) and w2.dtype == w1.dtype else torch.float32
    for name, t, dtype in (("w1", w1, expert_dtype), ("w2", w2, expert_dtype), ("wr", wr, torch.float32),
                           ("router_bias", router_bias, torch.float32)):
        if t is not None and (t.dtype != dtype or not t.is_contiguous() or t.device != r.device):
            raise FlowmoeError(f"flowmoe.torch.MoE: {name} is {t.dtype} on {t.device} (contiguous: "
                               f"{t.is_contiguous()}); expected contiguous {dtype} on {r.device} (w1 and w2: "
                               "both float32 or both bfloat16)")
    wbuf = _bytes(r.plan[0], w1.device)
    tbuf = _bytes(r.plan[2], w1.device) if r.plan[2] else None
    set_weights = r.layer.set_weights_bf16 if expert_dtype == torch.bfloat16 else r.layer.set_weights
    with r.ordered():
        r.layer.bind_memory(_addr(wbuf), 0, _addr(tbuf))
        set_weights(_addr(w1), _addr(w2), _addr(wr), _addr(router_bias))
    m.weight_updates += 1
    return wbuf


@derive_weights.register_fake
def _(w1, w2, wr, router_bias, module_id, tokens):
    r = _module(module_id)._ensure_runner(w1.device, tokens)
    return w1.new_empty((r.plan[0],), dtype=torch.uint8)


# ---- forward ----------------------------------------------------------------------------------------
def _run_forward(r, x, wbuf, keep_step, routing=None, b1=None):
    """One forward of the native layer on PyTorch memory: y, the saved bytes and the step tensor
    (the forward's host state; empty when keep_step is off: no backward will follow).
    routing: (ids [T, k] int32, probs [T, k] fp32) of the experts-only layer; b1: its GEMM1 bias
    [E, 2F] fp32 (gemm1_bias layers)."""
    y = torch.empty_like(x)
    saved = _bytes(r.plan[1], x.device)
    tbuf = _bytes(r.plan[2], x.device) if r.plan[2] else None
    with r.ordered():
        r.layer.bind_memory(_addr(wbuf), _addr(saved), _addr(tbuf))
        if routing is not None:
            r.layer.set_routing(routing[0].data_ptr(), routing[1].data_ptr())
        if b1 is not None:
            r.layer.set_gemm1_bias(b1.data_ptr())
        r.layer.forward(x.data_ptr(), x.shape[0], y.data_ptr())
        step = r.step() if keep_step else _no_step()
    return y, saved, step


@torch.library.custom_op("flowmoe::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, wr: torch.Tensor, wbuf: torch.Tensor,
                module_id: int, keep_step: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = _module(module_id)
    r = m._runner
    if r is None or r.device != x.device or x.shape[0] > r.max_tokens:
        raise FlowmoeError("flowmoe.torch.MoE: moe_forward without the layer's weights for this input "
                           "(derive_weights first; the module's forward does)")
    m._check_call(x)
    out = _run_forward(r, x, wbuf, keep_step)
    m._have_forward = True
    return out


@moe_forward.register_fake
def _(x, w1, w2, wr, wbuf, module_id, keep_step):
    r = _module(module_id)._runner
    saved = r.plan[1] if r is not None else 0
    return torch.empty_like(x), x.new_empty((saved,), dtype=torch.uint8), _fake_step(keep_step)


# ---- backward ---------------------------------------------------------------------------------------
def _set_backward_weights(runner, params):
    """params: (w1, w2[, wr]) the backward derives its weights from (wbuf then None), or None."""
    if params is not None:
        w1, w2 = params[0], params[1]
        wr = params[2] if len(params) > 2 else None
        runner.layer.set_backward_weights(w1.data_ptr(), w2.data_ptr(), w1.dtype == torch.bfloat16, _addr(wr))


def _run_backward(dy, wbuf, saved, step, params, grads, accumulate):
    runner = _Runner.of_step(step, "flowmoe.torch.MoE backward")
    dy = dy.to(torch.bfloat16).contiguous()
    dx = torch.empty_like(dy)
    tbuf = _bytes(runner.plan[2], dy.device) if runner.plan[2] else None
    with runner.ordered():
        runner.layer.bind_memory(_addr(wbuf), _addr(saved), _addr(tbuf))
        runner.load_step(step)
        _set_backward_weights(runner, params)
        runner.layer.backward(dy.data_ptr(), dx.data_ptr(), *[_addr(g) for g in grads], accumulate)
    return dx


def _grad_buffers(module_id: int, device, needs):
    """New FP32 weight-gradient tensors (an empty one where not needed), shaped like the parameters."""
    shapes = _module(module_id)._param_shapes()
    return [torch.empty(s, dtype=torch.float32, device=device) if n else torch.empty(0, device=device)
            for s, n in zip(shapes, needs)]


def _params(w1, w2, wr):
    return (w1.detach(), w2.detach(), wr.detach()) if w1 is not None else None


@torch.library.custom_op("flowmoe::moe_backward", mutates_args=())
def moe_backward(dy: torch.Tensor, wbuf: Optional[torch.Tensor], saved: torch.Tensor, step: torch.Tensor,
                 w1: Optional[torch.Tensor], w2: Optional[torch.Tensor], wr: Optional[torch.Tensor],
                 needs: List[bool], module_id: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _grad_buffers(module_id, dy.device, needs)
    dx = _run_backward(dy, wbuf, saved, step, _params(w1, w2, wr), [g if n else None for g, n in zip(grads, needs)],
                       False)
    return dx, grads[0], grads[1], grads[2]


@moe_backward.register_fake
def _(dy, wbuf, saved, step, w1, w2, wr, needs, module_id):
    grads = _grad_buffers(module_id, dy.device, needs)
    return torch.empty_like(dy, dtype=torch.bfloat16), grads[0], grads[1], grads[2]


@torch.library.custom_op("flowmoe::moe_backward_accumulate", mutates_args=("dw1", "dw2", "dwr"))
def moe_backward_accumulate(dy: torch.Tensor, wbuf: Optional[torch.Tensor], saved: torch.Tensor, step: torch.Tensor,
                            w1: Optional[torch.Tensor], w2: Optional[torch.Tensor], wr: Optional[torch.Tensor],
                            dw1: Optional[torch.Tensor], dw2: Optional[torch.Tensor],
                            dwr: Optional[torch.Tensor]) -> torch.Tensor:
    return _run_backward(dy, wbuf, saved, step, _params(w1, w2, wr), [dw1, dw2, dwr], True)


@moe_backward_accumulate.register_fake
def _(dy, wbuf, saved, step, w1, w2, wr, dw1, dw2, dwr):
    return torch.empty_like(dy, dtype=torch.bfloat16)


# ---- autograd ---------------------------------------------------------------------------------------
def _save_step(ctx, module_id, y, wbuf, saved, step, params=()):
    """What a forward node keeps for its backward (both ops): the module, the weight copies (or
    None and the parameters `params` they are derived from again), the saved bytes and the step,
    all as saved tensors; and (eager) the native layer that ran the forward, so that it lives as
    long as the node even when the module builds a larger one.

    Gradients are not materialised: `saved` and `step` never get one, and autograd would otherwise
    hand the backward a zero-filled tensor of the saved bytes' size (a fill of up to gigabytes per
    step on the GPU). dy is None only when y itself got no gradient (_dy makes it zeros then)."""
    ctx.set_materialize_grads(False)
    ctx.y_like = (y.shape, y.dtype, y.device)
    ctx.module_id = module_id
    ctx.runner = _module(module_id)._runner
    ctx.save_for_backward(wbuf, saved, step, *params)


def _from_params(module_id) -> bool:
    """Whether the layer derives a backward's dgrad weights from the parameters (the FP8 block
    recipes on CUDA): the autograd node then keeps the parameters (no copy; autograd's version
    counters refuse an in-place change before the backward, as for any op that saves its weight)
    instead of the forward's weight copies."""
    r = _module(module_id)._runner
    return r is not None and r.backward_weights


def _setup_context(ctx, inputs, output):
    x, w1, w2, wr, wbuf, module_id, keep_step = inputs
    y, saved, step = output
    from_params = _from_params(module_id)
    _save_step(ctx, module_id, y, None if from_params else wbuf, saved, step, (w1, w2, wr) if from_params else ())


def _dy(ctx, dy):
    """The output's gradient, zeros where autograd gave none (gradients are not materialised)."""
    if dy is not None:
        return dy
    shape, dtype, device = ctx.y_like
    return torch.zeros(shape, dtype=dtype, device=device)


def _backward(ctx, dy, _dsaved, _dstep):
    dy = _dy(ctx, dy)
    wbuf, saved, step, *params = ctx.saved_tensors
    w1, w2, wr = params if params else (None, None, None)
    module = _module(ctx.module_id)
    needs = [bool(n) for n in ctx.needs_input_grad[1:4]]
    if module.grad_mode == "main_grad":
        bufs = [module._main_grad(i) if n else None for i, n in enumerate(needs)]
        dx = moe_backward_accumulate(dy, wbuf, saved, step, w1, w2, wr, *bufs)
        return dx if ctx.needs_input_grad[0] else None, None, None, None, None, None, None
    dx, dw1, dw2, dwr = moe_backward(dy, wbuf, saved, step, w1, w2, wr, needs, ctx.module_id)
    gs = [g if n else None for g, n in zip((dw1, dw2, dwr), needs)]
    return (dx if ctx.needs_input_grad[0] else None, gs[0], gs[1], gs[2], None, None, None)


moe_forward.register_autograd(_backward, setup_context=_setup_context)


# ---- the experts-only layer (routing from the caller: flowmoe.torch.experts, flowmoe.hf) -------------
@torch.library.custom_op("flowmoe::experts_forward", mutates_args=())
def experts_forward(x: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    wbuf: torch.Tensor, module_id: int, keep_step: bool, b1: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = _module(module_id)
    r = m._runner
    if r is None or r.device != x.device or x.shape[0] > r.max_tokens:
        raise FlowmoeError("flowmoe.torch.experts: experts_forward without the layer's weights for this input "
                           "(derive_weights first; flowmoe.torch.experts does)")
    m._check_call(x, ids, probs)
    if (b1 is not None) != m.gemm1_bias:
        raise FlowmoeError(f"{m.who}: b1 given to a layer without GEMM1 biases" if b1 is not None
                           else f"{m.who}: b1 missing; the layer's experts have a GEMM1 bias")
    if b1 is not None and (b1.dtype != torch.float32 or not b1.is_contiguous() or b1.device != x.device):
        raise FlowmoeError(f"{m.who}: b1 {b1.dtype} on {b1.device}; expected contiguous float32 on {x.device}")
    return _run_forward(r, x, wbuf, keep_step, routing=(ids, probs), b1=b1)


@experts_forward.register_fake
def _(x, ids, probs, w1, w2, wbuf, module_id, keep_step, b1=None):
    r = _module(module_id)._runner
    saved = r.plan[1] if r is not None else 0
    return torch.empty_like(x), x.new_empty((saved,), dtype=torch.uint8), _fake_step(keep_step)


def _run_experts_backward(dy, wbuf, saved, step, params, dw1, dw2, topk, db1=None):
    """dx and d loss / d probs, the weight gradients written into dw1 / dw2 (FP32, or BF16 for BF16
    parameters: rounded once by the wgrad itself). params: (w1, w2) when the layer derives the
    backward's dgrad weights from them (wbuf is then None: no weight copy outlived the forward)."""
    runner = _Runner.of_step(step, "flowmoe.torch.experts backward")
    dy = dy.to(torch.bfloat16).contiguous()
    dx = torch.empty_like(dy)
    dprobs = torch.empty((dy.shape[0], topk), dtype=torch.float32, device=dy.device)
    tbuf = _bytes(runner.plan[2], dy.device) if runner.plan[2] else None
    bf16_grads = any(g is not None and g.dtype == torch.bfloat16 for g in (dw1, dw2))
    with runner.ordered():
        runner.layer.bind_memory(_addr(wbuf), _addr(saved), _addr(tbuf))
        runner.load_step(step)
        _set_backward_weights(runner, params)
        if db1 is not None:
            runner.layer.set_gemm1_bias_grad(db1.data_ptr())
        if bf16_grads:
            runner.layer.backward_bf16(dy.data_ptr(), dx.data_ptr(), _addr(dw1), _addr(dw2),
                                       dprobs=dprobs.data_ptr())
        else:
            runner.layer.backward(dy.data_ptr(), dx.data_ptr(), _addr(dw1), _addr(dw2), None, False,
                                  dprobs=dprobs.data_ptr())
    return dx, dprobs


def _experts_grad_buffers(module_id: int, device, needs, bf16: bool):
    """New weight-gradient tensors in the parameters' dtype (BF16 parameters: BF16, written by the
    wgrad directly; else FP32), an empty one where not needed."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    shapes = _module(module_id)._param_shapes()
    return [torch.empty(s, dtype=dtype, device=device) if n else torch.empty(0, dtype=dtype, device=device)
            for s, n in zip(shapes, needs)]


@torch.library.custom_op("flowmoe::experts_backward", mutates_args=())
def experts_backward(dy: torch.Tensor, wbuf: Optional[torch.Tensor], saved: torch.Tensor, step: torch.Tensor,
                     w1: Optional[torch.Tensor], w2: Optional[torch.Tensor], needs: List[bool], bf16_grads: bool,
                     module_id: int, bias_grad: bool = False
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m = _module(module_id)
    grads = _experts_grad_buffers(module_id, dy.device, needs, bf16_grads)
    db1 = _bias_grad_buffer(m, dy.device, bias_grad)
    params = layer_weights(w1.detach(), w2.detach()) if w1 is not None else None
    dx, dprobs = _run_experts_backward(dy, wbuf, saved, step, params, grads[0] if needs[0] else None,
                                       grads[1] if needs[1] else None, m.topk, db1 if bias_grad else None)
    return dx, grads[0], grads[1], dprobs, db1


def _bias_grad_buffer(m, device, needed: bool) -> torch.Tensor:
    """db1 [E, 2F] fp32 (written by the backward, not accumulated), or an empty tensor."""
    return torch.empty((m.experts, 2 * m.ffn) if needed else (0,), dtype=torch.float32, device=device)


@experts_backward.register_fake
def _(dy, wbuf, saved, step, w1, w2, needs, bf16_grads, module_id, bias_grad=False):
    m = _module(module_id)
    grads = _experts_grad_buffers(module_id, dy.device, needs, bf16_grads)
    return (torch.empty_like(dy, dtype=torch.bfloat16), grads[0], grads[1],
            dy.new_empty((dy.shape[0], m.topk), dtype=torch.float32), _bias_grad_buffer(m, dy.device, bias_grad))


def _experts_setup_context(ctx, inputs, output):
    x, ids, probs, w1, w2, wbuf, module_id, keep_step, b1 = inputs
    y, saved, step = output
    from_params = _from_params(module_id)
    # (w1, w2: the parameters as the caller holds them, any dtype and strides; the backward converts
    # them as the forward did, for as long as it runs)
    _save_step(ctx, module_id, y, None if from_params else wbuf, saved, step, (w1, w2) if from_params else ())
    ctx.weight_dtypes = (w1.dtype, w2.dtype)
    ctx.has_b1 = b1 is not None


def _experts_backward(ctx, dy, _dsaved, _dstep):
    dy = _dy(ctx, dy)
    wbuf, saved, step, *params = ctx.saved_tensors
    w1, w2 = params if params else (None, None)
    needs = [bool(ctx.needs_input_grad[3]), bool(ctx.needs_input_grad[4])]
    # BF16 parameters get BF16 gradients straight from the wgrad (no FP32 copy, no rounding pass);
    # others FP32 ones, converted to their parameter's dtype here
    d1, d2 = ctx.weight_dtypes
    bf16 = d1 == d2 == torch.bfloat16
    bias_grad = ctx.has_b1 and bool(ctx.needs_input_grad[8])
    dx, dw1, dw2, dprobs, db1 = experts_backward(dy, wbuf, saved, step, w1, w2, needs, bf16, ctx.module_id,
                                                 bias_grad)
    return (dx if ctx.needs_input_grad[0] else None, None, dprobs if ctx.needs_input_grad[2] else None,
            dw1.to(d1) if needs[0] else None, dw2.to(d2) if needs[1] else None, None, None, None,
            db1 if bias_grad else None)


experts_forward.register_autograd(_experts_backward, setup_context=_experts_setup_context)
