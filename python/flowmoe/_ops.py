"""The flowmoe layer as PyTorch operators (torch.library custom ops), used by flowmoe.torch.MoE (the
full layer with its router) and by the experts-only layer of flowmoe.torch.experts / flowmoe.hf
(routing from the caller, issue 31): one operator pair for both, the differences passed as
arguments.

Operators, each opaque to torch.compile and with a fake (meta) implementation:

- ``flowmoe::derive_weights(w1, w2, wr, router_bias, module_id, tokens) -> wbuf``: the layer's
  weight copies (BF16 / FP8 blocks with their transposes) made from the FP32 masters (or from w1, w2
  as BF16 parameters, used as the BF16 copies: no FP32 copy; the experts-only layer, whose wr and
  router_bias are None), into a new uint8 tensor (CUDA; CPU: the copies stay inside the CPU layer
  and wbuf is empty).
- ``flowmoe::moe_forward(x, w1, w2, wr, wbuf, module_id, keep_step, ids, probs, b1) -> (y, saved,
  step)``: y and what the backward needs: a uint8 tensor ``saved`` on x's device (CUDA: codes,
  scales and routing tables; CPU: empty) and ``step``, a uint8 CPU tensor holding the forward's host
  state as a value (_runner.py: the native layer's id and its step_state bytes; CPU: the whole saved
  state). Autograd keeps both as the node's saved tensors, so a second backward
  through one forward (retain_graph=True) gives the same gradients again; nothing outside the graph
  holds a forward's state. w1, w2, wr are passed for autograd (the op reads wbuf), and w1, w2 are
  read in place by the layers that do (bf16 with BF16 parameters: _Runner.params_in_place). The full
  layer passes ids, probs, b1 None; the experts-only layer wr None and the routing: ids [T, k] int32,
  probs [T, k] fp32, and (its gemm1_bias layers) GEMM1's bias b1 [E, 2F] fp32, else None. (No
  defaults: a defaulted argument would be left out of autograd's needs_input_grad.)
- ``flowmoe::moe_backward(dy, wbuf, saved, step, w1, w2, wr, needs, module_id, ...) -> (dx, dw1,
  dw2, dwr, dprobs, db1)``: dx and the gradients asked for (``needs``: w1, w2, wr) as new tensors
  (an empty one for each gradient not computed): dprobs = d loss / d probs of an experts-only layer,
  db1 with ``bias_grad``; the expert weights' gradients in FP32, or in BF16 with ``bf16_grads`` (BF16
  parameters of the experts-only layer: written by the wgrad itself). With ``accumulate`` (main_grad
  mode, eager only) the weight gradients are added in place into the FP32 buffers main_w1, main_w2,
  main_wr instead (the op's mutated arguments) and dw1, dw2, dwr come back empty. Where the layer
  takes them (the FP8 block recipes on CUDA, which quantize the dgrad weights from them, and bf16
  reading BF16 parameters in place), the backward gets the parameters w1, w2 (and wr) instead of
  wbuf: no weight copy outlives its forward.

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
_modules: Dict[int, "weakref.ref"] = {}  # module_id -> its owner (_runner.LayerOwner: MoE, experts layer)
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
            raise FlowmoeError(f"{m.who}: {name} is {t.dtype} on {t.device} (contiguous: "
                               f"{t.is_contiguous()}); expected contiguous {dtype} on {r.device} (w1 and w2: "
                               "both float32 or both bfloat16)")
    wbuf = _bytes(r.plan[0], w1.device)
    tbuf = _bytes(r.plan[2], w1.device) if r.plan[2] else None
    with r.ordered():
        r.layer.set_weights(_addr(w1), _addr(w2), _addr(wr), _addr(router_bias),
                            bf16=expert_dtype == torch.bfloat16, storage=m.storage,
                            memory=(_addr(wbuf), 0, _addr(tbuf)))
    m.weight_updates += 1
    return wbuf


@derive_weights.register_fake
def _(w1, w2, wr, router_bias, module_id, tokens):
    r = _module(module_id)._ensure_runner(w1.device, tokens)
    return w1.new_empty((r.plan[0],), dtype=torch.uint8)


# ---- forward ----------------------------------------------------------------------------------------
def _run_forward(r, x, wbuf, keep_step, routing=None, b1=None, params=None, storage=None):
    """One forward of the native layer on PyTorch memory: y, the saved bytes and the step tensor
    (the forward's host state; empty when keep_step is off: no backward will follow).
    routing: (ids [T, k] int32, probs [T, k] fp32) of the experts-only layer; b1: its GEMM1 bias
    [E, 2F] fp32 (gemm1_bias layers); params: (w1, w2) the BF16 parameters the layer reads in place
    (its params_in_place; where `storage` says they are stored), else None."""
    y = torch.empty_like(x)
    saved = _bytes(r.plan[1], x.device)
    tbuf = _bytes(r.plan[2], x.device) if r.plan[2] else None
    buf = r.step_buffer() if keep_step else None
    with r.ordered():
        n = r.layer.forward_call(x.data_ptr(), x.shape[0], y.data_ptr(), (_addr(wbuf), _addr(saved), _addr(tbuf)),
                                 ids=routing[0].data_ptr() if routing is not None else None,
                                 probs=routing[1].data_ptr() if routing is not None else None,
                                 b1=b1.data_ptr() if b1 is not None else None,
                                 params=(params[0].data_ptr(), params[1].data_ptr()) if params is not None else None,
                                 params_storage=storage,
                                 step=(buf.data_ptr() + 8, buf.numel() - 8) if keep_step else None)
        step = r.step(buf, n) if keep_step else _no_step()
    return y, saved, step


@torch.library.custom_op("flowmoe::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, wr: Optional[torch.Tensor], wbuf: torch.Tensor,
                module_id: int, keep_step: bool, ids: Optional[torch.Tensor], probs: Optional[torch.Tensor],
                b1: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = _module(module_id)
    r = m._runner
    if r is None or r.device != x.device or x.shape[0] > r.max_tokens:
        raise FlowmoeError(f"{m.who}: moe_forward without the layer's weights for this input "
                           "(derive_weights first; the module's forward does)")
    m._check_call(x, ids)
    if (b1 is not None) != m.gemm1_bias:
        raise FlowmoeError(f"{m.who}: b1 given to a layer without GEMM1 biases" if b1 is not None
                           else f"{m.who}: b1 missing; the layer's experts have a GEMM1 bias")
    if b1 is not None and (b1.dtype != torch.float32 or not b1.is_contiguous() or b1.device != x.device):
        raise FlowmoeError(f"{m.who}: b1 {b1.dtype} on {b1.device}; expected contiguous float32 on {x.device}")
    # (the parameters read in place: as derive_weights took them, contiguous; a copy lives as long as
    # the call's work on the stream)
    params = layer_weights(w1.detach(), w2.detach()) if r.params_in_place else None
    out = _run_forward(r, x, wbuf, keep_step, routing=(ids, probs) if ids is not None else None, b1=b1,
                       params=params, storage=m.storage)
    m._have_forward = True
    return out


@moe_forward.register_fake
def _(x, w1, w2, wr, wbuf, module_id, keep_step, ids, probs, b1):
    r = _module(module_id)._runner
    saved = r.plan[1] if r is not None else 0
    return torch.empty_like(x), x.new_empty((saved,), dtype=torch.uint8), _fake_step(keep_step)


# ---- backward ---------------------------------------------------------------------------------------
def _run_backward(m, dy, wbuf, saved, step, params, grads, db1, accumulate, stored_grads=False):
    """dx and dprobs (d loss / d probs [T, k] fp32 of an experts-only layer, else empty); the weight
    gradients written (or, accumulate, added) into grads (dw1, dw2, dwr: None where not wanted),
    db1 written where given. BF16 gradient tensors (BF16 parameters of the experts-only layer) are
    written by the wgrad itself, rounded once from its FP32 sums; stored_grads: dw1, dw2 in m.storage's
    layout (the layer's writes_stored_grads)."""
    runner = _Runner.of_step(step, f"{m.who} backward")
    dy = dy.to(torch.bfloat16).contiguous()
    dx = torch.empty_like(dy)
    dprobs = _dprobs_buffer(m, dy)
    tbuf = _bytes(runner.plan[2], dy.device) if runner.plan[2] else None
    bf16_grads = any(g is not None and g.dtype == torch.bfloat16 for g in grads[:2])
    # params: (w1, w2, wr) the dgrad weights are derived from (wbuf then None; wr None for the
    # experts-only layer; w1, w2 where m.storage says they are stored), or None
    p = None if params is None else (params[0].data_ptr(), params[1].data_ptr(),
                                     params[0].dtype == torch.bfloat16, _addr(params[2]))
    step = step.contiguous()  # (the runner's id, then the layer's state: _Runner.step)
    with runner.ordered():
        runner.layer.backward_call(dy.data_ptr(), dx.data_ptr(), (_addr(wbuf), _addr(saved), _addr(tbuf)),
                                   (step.data_ptr() + 8, step.numel() - 8), dw1=_addr(grads[0]),
                                   dw2=_addr(grads[1]), bf16=bf16_grads, dwr=_addr(grads[2]), dprobs=_addr(dprobs),
                                   db1=_addr(db1), accumulate=accumulate,
                                   grads_storage=m.storage if stored_grads else None, params=p,
                                   params_storage=m.storage)
    return dx, dprobs


def _grad_buffers(m, device, needs, bf16: bool, stored: bool = False):
    """New weight-gradient tensors shaped like the parameters (w1, w2, wr), an empty one where not
    needed: FP32, or BF16 (BF16 parameters of the experts-only layer: written by the wgrad directly);
    stored: w1's and w2's as m.storage holds them."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    return [torch.empty(s if n else (0,), dtype=dtype, device=device)
            for s, n in zip(m._param_shapes(stored), needs)]


def _dprobs_buffer(m, dy) -> torch.Tensor:
    """d loss / d probs [T, k] fp32 of an experts-only layer (written by every backward), else empty."""
    return torch.empty((dy.shape[0], m.topk) if m.external_routing else (0,), dtype=torch.float32, device=dy.device)


def _bias_grad_buffer(m, device, needed: bool) -> torch.Tensor:
    """db1 [E, 2F] fp32 (written by the backward, not accumulated), or an empty tensor."""
    return torch.empty((m.experts, 2 * m.ffn) if needed else (0,), dtype=torch.float32, device=device)


@torch.library.custom_op("flowmoe::moe_backward", mutates_args=("main_w1", "main_w2", "main_wr"))
def moe_backward(dy: torch.Tensor, wbuf: Optional[torch.Tensor], saved: torch.Tensor, step: torch.Tensor,
                 w1: Optional[torch.Tensor], w2: Optional[torch.Tensor], wr: Optional[torch.Tensor],
                 needs: List[bool], module_id: int, bf16_grads: bool, bias_grad: bool, accumulate: bool,
                 stored_grads: bool, main_w1: Optional[torch.Tensor], main_w2: Optional[torch.Tensor],
                 main_wr: Optional[torch.Tensor]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # (no argument has a default: a boxed call drops trailing arguments equal to their defaults, and
    # PyTorch 2.11 then fails to bump the versions of the mutated main_* arguments, indexing past them)
    # stored_grads: dw1, dw2 returned where the module's storage keeps the weights: written there by
    # the layer where it can (_stored_grads), else written in its layout and mapped here, inside the
    # op (so that a traced backward sees only the op and its fake)
    m = _module(module_id)
    direct = stored_grads and m._stored_grads(_Runner.of_step(step, f"{m.who} backward"), bf16_grads)
    grads = _grad_buffers(m, dy.device, [n and not accumulate for n in needs], bf16_grads, direct)
    db1 = _bias_grad_buffer(m, dy.device, bias_grad)
    # (w1, w2: the parameters as the caller holds them, converted as the forward did, for as long as
    # the backward runs)
    params = (*layer_weights(w1.detach(), w2.detach()), wr.detach() if wr is not None else None) \
        if w1 is not None else None
    into = [main_w1, main_w2, main_wr] if accumulate else [g if n else None for g, n in zip(grads, needs)]
    dx, dprobs = _run_backward(m, dy, wbuf, saved, step, params, into, db1 if bias_grad else None, accumulate,
                               direct)
    del into, params
    if stored_grads and not direct:  # each layer-layout gradient freed once mapped (one pair lives at a time)
        in_layer = [grads[0] if needs[0] else None, grads[1] if needs[1] else None]
        empty = [grads[0] if not needs[0] else None, grads[1] if not needs[1] else None]
        del grads[:2]
        dw1, dw2 = m._grads_to_storage(in_layer)
        grads[:0] = [dw1 if dw1 is not None else empty[0], dw2 if dw2 is not None else empty[1]]
    return dx, grads[0], grads[1], grads[2], dprobs, db1


@moe_backward.register_fake
def _(dy, wbuf, saved, step, w1, w2, wr, needs, module_id, bf16_grads, bias_grad, accumulate, stored_grads, main_w1,
      main_w2, main_wr):
    m = _module(module_id)
    grads = _grad_buffers(m, dy.device, [n and not accumulate for n in needs], bf16_grads, stored_grads)
    return (torch.empty_like(dy, dtype=torch.bfloat16), grads[0], grads[1], grads[2], _dprobs_buffer(m, dy),
            _bias_grad_buffer(m, dy.device, bias_grad))


# ---- autograd ---------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    """What a forward node keeps for its backward: the module, the weight copies (or None and the
    parameters w1, w2, wr they are derived from again), the saved bytes and the step, all as saved
    tensors; and (eager) the native layer that ran the forward, so that it lives as long as the node
    even when the module builds a larger one.

    The parameters are kept instead of the copies where the layer's backward takes them (the FP8
    block recipes on CUDA derive the dgrad weights from them, bf16 in place reads them): no copy;
    autograd's version counters refuse
    an in-place change before the backward, as for any op that saves its weight.

    Gradients are not materialised: `saved` and `step` never get one, and autograd would otherwise
    hand the backward a zero-filled tensor of the saved bytes' size (a fill of up to gigabytes per
    step on the GPU). dy is None only when y itself got no gradient (_dy makes it zeros then)."""
    x, w1, w2, wr, wbuf, module_id, keep_step, ids, probs, b1 = inputs
    y, saved, step = output
    ctx.set_materialize_grads(False)
    ctx.y_like = (y.shape, y.dtype, y.device)
    ctx.module_id = module_id
    ctx.runner = _module(module_id)._runner
    from_params = ctx.runner is not None and ctx.runner.backward_weights
    ctx.save_for_backward(None if from_params else wbuf, saved, step, *((w1, w2, wr) if from_params else ()))
    ctx.weight_dtypes = (w1.dtype, w2.dtype)
    ctx.has_b1 = b1 is not None


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
    wants = ctx.needs_input_grad  # x, w1, w2, wr, wbuf, module_id, keep_step, ids, probs, b1
    needs = [bool(n) for n in wants[1:4]]
    dx_wanted = bool(wants[0])
    if module.grad_mode == "main_grad":
        bufs = [module._main_grad(i) if n else None for i, n in enumerate(needs)]
        dx = moe_backward(dy, wbuf, saved, step, w1, w2, wr, needs, ctx.module_id, False, False, True, False,
                          bufs[0], bufs[1], bufs[2])[0]
        return (dx if dx_wanted else None,) + (None,) * 9
    # BF16 parameters of the experts-only layer get BF16 gradients straight from the wgrad (no FP32
    # copy, no rounding pass); others FP32 ones, converted to their parameter's dtype here
    d1, d2 = ctx.weight_dtypes
    bf16 = module.external_routing and d1 == d2 == torch.bfloat16
    bias_grad = ctx.has_b1 and bool(wants[9])
    # weights read where the model stores them: their gradients returned in the same layout
    dx, dw1, dw2, dwr, dprobs, db1 = moe_backward(dy, wbuf, saved, step, w1, w2, wr, needs, ctx.module_id, bf16,
                                                  bias_grad, False, module.storage is not None, None, None, None)
    return (dx if dx_wanted else None, dw1.to(d1) if needs[0] else None, dw2.to(d2) if needs[1] else None,
            dwr if needs[2] else None, None, None, None, None, dprobs if wants[8] else None,
            db1 if bias_grad else None)


moe_forward.register_autograd(_backward, setup_context=_setup_context)
