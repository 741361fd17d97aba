"""The experts-only flowmoe layer (issue 31): routing done by the caller.

``flowmoe.torch.experts(x, top_k_index, top_k_weights, w1, w2, recipe=...)`` runs dispatch,
GEMM1, SwiGLU·p, GEMM2 and combine of the recipe for a routing chosen by the caller (e.g. a
Hugging Face model's router, ``flowmoe.hf``), with gradients for x, w1, w2 and the routing weights
(so the caller's router trains). ``flowmoe.torch.MoEExperts`` is the same as a module that owns
w1 and w2. Both run on the operators of ``flowmoe.torch.MoE`` (``flowmoe::moe_forward``, given the
routing, and ``flowmoe::moe_backward``; flowmoe._ops) exactly as that module does: the weight
copies re-derived from the parameters at every forward (``flowmoe::derive_weights``), memory from
PyTorch's caching allocator on CUDA, several forwards in flight, torch.compile sees opaque
operators.

Shapes: x ``[T, H]`` (or ``[..., H]``) bf16 or fp32 (computed in BF16, returned in x's dtype);
top_k_index ``[T, k]`` integer expert ids in ``[0, E)`` (-1: slot dropped); top_k_weights ``[T, k]``
(fp32 or any float dtype: used in FP32); w1 ``[E, 2F, H]`` (rows [0, F) gate, [F, 2F) up: the
layout of transformers' ``gate_up_proj``), w2 ``[E, H, F]`` (``down_proj``). w1 / w2 in float32
(masters) or bfloat16 (e.g. a model loaded in bfloat16) are used as they are: BF16 parameters are
the layer's BF16 copies, quantized straight from the parameters, with the bits of FP32 masters
holding the same values. Other float dtypes are converted to FP32 at every forward (an FP32 copy
alive during the forward). Gradients return in the parameters' dtype (computed in FP32).

Other experts (gpt-oss, issue 46; docs/HF.md): ``b1`` [E, 2F] (GEMM1's bias, added by the layer
before the activation) and ``b2`` [E, H] (added per slot before its routing weight: sum_k p_k
b2[e_k]), ``activation="clamped-swiglu"`` with ``swiglu_alpha`` / ``swiglu_limit``, ``transposed``
weights (w1 [E, H, 2F], w2 [E, F, H]) and ``interleaved`` gate / up (rows, or columns when
transposed, alternating; b1 too). H and F need not be multiples of 128: the weights, x and b1 are
zero-padded to the next multiple (the layer's tiles) and y cropped, the same computation.
Transposed weights are read where they are by the layers that can (the library's rule,
``_reads_stored``: the CPU layer, the CUDA layer of the FP8 block recipes, and of bf16 with BF16
parameters), their
gradients written there by the wgrad where the layer can and otherwise mapped back inside the
backward op; other layouts, and the other layers, get them relaid by differentiable copies at
every forward (_Layout).
"""

from __future__ import annotations

import functools
import weakref
from typing import Dict, Optional, Tuple

from ._errors import require_torch

require_torch("flowmoe.experts")  # where PyTorch is missing: an error naming pip install '.[torch]'
import torch  # noqa: E402
from torch import nn

from . import _native, _ops
from ._errors import FlowmoeError
from ._runner import LayerOwner, _NoTokens, keep_fp32
from ._validate import check_config

__all__ = ["experts", "MoEExperts"]


def _experts_config(hidden, ffn, experts, topk, recipe, align, max_tokens, activation, gemm1_bias) -> _native.Config:
    """The C configuration of an experts-only layer (external routing: no router, no aux loss)."""
    act, alpha, limit = activation
    return _native.make_config(hidden, ffn, experts, topk, "softmax", False, 1.0, 0.0, align, recipe, max_tokens,
                               external_routing=True, activation=act, swiglu_alpha=alpha, swiglu_limit=limit,
                               gemm1_bias=gemm1_bias)


def refusal(experts: int, hidden: int, ffn: int, topk: int, recipe: str, *, align: int = 128,
            activation: Tuple[str, float, float] = ("swiglu", 1.702, 7.0), gemm1_bias: bool = False) -> Optional[str]:
    """Why the library refuses the experts-only layer that ``experts()`` would build for these sizes
    (hidden and ffn zero-padded as it pads them), in its words, or None when it accepts it. For
    callers that check a model before running it (flowmoe.hf), so that the rules stay the library's."""
    try:
        _native.check_config(_experts_config(_pad(hidden), _pad(ffn), experts, topk, recipe, align, 1, activation,
                                             gemm1_bias))
    except FlowmoeError as e:  # the library's message (or make_config's for a value C cannot take)
        return str(e)
    return None


class _ExpertsLayer(LayerOwner):
    """The native experts-only layer of one weight set (the object the operators name by module_id)."""

    external_routing = True  # (LayerOwner) ids and probs come with every forward

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, recipe: str, align: int,
                 max_tokens: Optional[int], sync_free: bool, check_finite: Optional[bool], who: str,
                 activation: Tuple[str, float, float] = ("swiglu", 1.702, 7.0), gemm1_bias: bool = False,
                 storage: Optional["_Layout"] = None, bf16_params: bool = False):
        self.hidden, self.ffn, self.experts, self.topk = hidden, ffn, num_experts, topk
        # (LayerOwner.storage) the caller's transposed weights, read where they are
        self._layout = storage
        self.storage = (storage.H, storage.F, storage.interleaved) if storage is not None else None
        # (LayerOwner.bf16_params) BF16 parameters: bf16 reads them in place (stored: relaid per pass)
        self.bf16_params = bool(bf16_params)
        self.activation, self.gemm1_bias = activation, bool(gemm1_bias)
        self.local_experts = num_experts
        self.recipe, self.align, self.max_tokens = recipe, align, max_tokens
        self.sync_free, self.check_finite, self.who = sync_free, check_finite, who
        self.weight_updates = 0
        self._runner = None  # _runner._Runner
        self._have_forward = False
        # the library checks the configuration now, without making a layer (sizes, top-k, recipe,
        # alignment, activation, biases, sync_free's needs: its rules, its words)
        check_config(who, lambda: self._config(1 if max_tokens is None else max_tokens), sync_free=sync_free,
                     sizes=(hidden, ffn))
        self._op_id = _ops.register_module(self)

    def _config(self, max_tokens: int) -> _native.Config:
        return _experts_config(self.hidden, self.ffn, self.experts, self.topk, self.recipe, self.align, max_tokens,
                               self.activation, self.gemm1_bias)

    def _grads_to_storage(self, in_layer: list):
        """[dW1 [E, 2F', H'], dW2 [E, H', F']] (the layer's layout; None where not wanted) as the stored
        weights' gradients [E, H, 2F] and [E, F, H]; the list's entries are dropped as they are mapped."""
        return self._layout.grads_from_layer(in_layer)

    def run(self, xb: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, w1: torch.Tensor,
            w2: torch.Tensor, b1: Optional[torch.Tensor] = None) -> torch.Tensor:
        with self._keep_layer_on_failure():
            return self._run(xb, ids, probs, w1, w2, b1)

    def _run(self, xb, ids, probs, w1, w2, b1):
        tokens = int(xb.shape[0])
        if xb.is_cuda and torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling():
            self._check_call(xb, ids)
        # the weight copies, re-derived from the parameters at every forward (MoE's default rule);
        # the operator gets the parameters themselves (what its node may keep: no converted copy)
        w1c, w2c = _ops.layer_weights(w1.detach(), w2.detach())
        wbuf = _ops.derive_weights(w1c, w2c, None, None, self._op_id, tokens)
        del w1c, w2c
        keep = self._backward_follows(xb, probs, w1, w2, b1)
        y, _saved, _step = _ops.moe_forward(xb, w1, w2, None, wbuf, self._op_id, keep, ids, probs, b1)
        return y


def _check_inputs(who, x, top_k_index, top_k_weights, w1, w2, transposed=False):
    """E, H, F, k of a call (checked); w1 [E, 2F, H] / w2 [E, H, F], or transposed [E, H, 2F] / [E, F, H]."""
    for name, t in (("x", x), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights), ("w1", w1),
                    ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} of type {type(t).__name__}; expected a torch.Tensor")
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{who}: w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)}; expected 3-D expert weights")
    E = int(w1.shape[0])
    if transposed:
        H, F2 = int(w1.shape[1]), int(w1.shape[2])
        ok = F2 % 2 == 0 and tuple(w2.shape) == (E, F2 // 2, H)
        want = "w1 [E, H, 2F] and w2 [E, F, H] (transposed=True)"
    else:
        F2, H = int(w1.shape[1]), int(w1.shape[2])
        ok = F2 % 2 == 0 and tuple(w2.shape) == (E, H, F2 // 2)
        want = "w1 [E, 2F, H] and w2 [E, H, F]"
    if not ok:
        raise ValueError(f"{who}: w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)}; expected {want}")
    if x.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise TypeError(f"{who}: x dtype {x.dtype}; expected torch.bfloat16, torch.float32 or torch.float16 "
                        "(computed in bfloat16)")
    if x.dim() < 1 or x.shape[-1] != H:
        raise ValueError(f"{who}: x of shape {tuple(x.shape)}; expected [T, {H}]")
    T = x.numel() // H
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T or top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"{who}: top_k_index {tuple(top_k_index.shape)}, top_k_weights "
                         f"{tuple(top_k_weights.shape)} for {T} tokens; expected both [{T}, k]")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise TypeError(f"{who}: top_k_index dtype {top_k_index.dtype}; expected an integer dtype")
    if not top_k_weights.dtype.is_floating_point:
        raise TypeError(f"{who}: top_k_weights dtype {top_k_weights.dtype}; expected a floating dtype")
    for name, t in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights), ("w1", w1), ("w2", w2)):
        if t.device != x.device:
            raise ValueError(f"{who}: {name} on {t.device} but x on {x.device}; expected the same device")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{who}: tensors on {x.device}; expected CPU or CUDA tensors")
    for name, w in (("w1", w1), ("w2", w2)):
        if not w.dtype.is_floating_point:
            raise TypeError(f"{who}: {name} dtype {w.dtype}; expected a floating dtype (float32 masters)")
    return E, H, F2 // 2, int(top_k_index.shape[1])


def _check_biases(who, b1, b2, E, H, F, device):
    for name, b, shape in (("b1", b1, (E, 2 * F)), ("b2", b2, (E, H))):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or not b.dtype.is_floating_point:
            raise TypeError(f"{who}: {name} must be a floating torch.Tensor {list(shape)}")
        if tuple(b.shape) != shape or b.device != device:
            raise ValueError(f"{who}: {name} of shape {tuple(b.shape)} on {b.device}; expected {list(shape)} on {device}")


def _pad(n: int) -> int:
    """n rounded up to the layer's size multiple (the library's: _native.size_multiple(), 128)."""
    m = _native.size_multiple()
    return -(-n // m) * m


class _Layout:
    """How a caller's expert weights map onto the layer's (w1 [E, 2F', H'] gate rows [0, F), up rows
    [F', F' + F); w2 [E, H', F']; b1 [E, 2F'] fp32): transposed ([E, H, 2F] / [E, F, H]) and/or
    interleaved (gate, up alternating: gpt-oss) weights, H and F zero-padded to multiples of 128 (the
    layer's 1x128 and 128x128 tiles; zero rows and columns leave every real output unchanged:
    act(0, 0) = 0 for both activations). Done with differentiable tensor ops, so the gradients come
    back in the caller's layout (the padded parts dropped). Identity (no copy) for the layer's own
    layout at multiples of 128."""

    def __init__(self, H: int, F: int, transposed: bool, interleaved: bool):
        self.H, self.F, self.Hp, self.Fp = H, F, _pad(H), _pad(F)
        self.transposed, self.interleaved = transposed, interleaved
        self.identity = not transposed and not interleaved and self.Hp == H and self.Fp == F

    def _gate_up(self, w1):
        w = w1.transpose(1, 2) if self.transposed else w1  # [E, 2F, H] (a view)
        if self.interleaved:
            return w[:, 0::2], w[:, 1::2]
        return w[:, :self.F], w[:, self.F:]

    def weights(self, w1: torch.Tensor, w2: torch.Tensor):
        if self.identity:
            return w1, w2
        E, H, F, Hp, Fp = w1.shape[0], self.H, self.F, self.Hp, self.Fp
        if self.transposed and w1.is_cuda and w1.element_size() in (2, 4) and w2.element_size() in (2, 4):
            # tiled transposes (flowmoe_expert_relayout): torch's strided copies of a transpose run
            # at a fraction of the bandwidth
            m1, m2 = self.row_maps()
            return (_Relayout.apply(w1, H, 2 * F, 2 * Fp, Hp, m1),
                    _Relayout.apply(w2, F, H, Hp, Fp, m2))
        gate, up = self._gate_up(w1)
        w1l = w1.new_zeros((E, 2 * Fp, Hp))
        w1l[:, :F, :H] = gate
        w1l[:, Fp:Fp + F, :H] = up
        w2c = w2.transpose(1, 2) if self.transposed else w2  # [E, H, F]
        if (Hp, Fp) == (H, F):
            w2l = w2c.contiguous()
        else:
            w2l = w2.new_zeros((E, Hp, Fp))
            w2l[:, :H, :F] = w2c
        return w1l, w2l

    def row_maps(self):
        """The relayout row maps (flowmoe/expert_layout.h) of transposed w1 and w2."""
        F, Fp, H = self.F, self.Fp, self.H
        return (F, 2, 0, 1, Fp) if self.interleaved else (F, 1, 0, F, Fp), (H, 1, 0, 0, -1)

    def grads_from_layer(self, in_layer: list):
        """[dW1, dW2] in the layer's layout -> the transposed weights' [E, H, 2F], [E, F, H] (CUDA); each
        entry of `in_layer` is set to None once mapped, so that it is freed before the next one."""
        m1, m2 = self.row_maps()
        out = []
        for i, (shape, c, l, r, cp, m) in enumerate((((self.H, 2 * self.F), self.H, 2 * self.F, 2 * self.Fp,
                                                      self.Hp, m1),
                                                     ((self.F, self.H), self.F, self.H, self.Hp, self.Fp, m2))):
            g, in_layer[i] = in_layer[i], None
            if g is None:
                out.append(None)
                continue
            g = g.contiguous()
            dst = torch.empty((g.shape[0], *shape), dtype=g.dtype, device=g.device)
            with torch.cuda.device(g.device):
                _native.expert_relayout(g.data_ptr(), dst.data_ptr(), g.element_size(), g.shape[0], c, l, r, cp,
                                        m, False, torch.cuda.current_stream(g.device).cuda_stream)
            del g
            out.append(dst)
        return out[0], out[1]

    def bias1(self, b1: torch.Tensor) -> torch.Tensor:
        """b1 [E, 2F] (the caller's gate/up order) -> [E, 2F'] fp32 contiguous in the layer's."""
        F, Fp = self.F, self.Fp
        b = b1.to(torch.float32)
        gate, up = (b[:, 0::2], b[:, 1::2]) if self.interleaved else (b[:, :F], b[:, F:])
        if Fp == F and not self.interleaved:
            b = b.contiguous()
            return b if b.data_ptr() % 16 == 0 else b.clone()  # (the layer reads it 16 bytes at a time)
        out = b.new_zeros((b.shape[0], 2 * Fp))
        out[:, :F] = gate
        out[:, Fp:Fp + F] = up
        return out

    def pad_x(self, xb: torch.Tensor) -> torch.Tensor:
        return xb if self.Hp == self.H else torch.nn.functional.pad(xb, (0, self.Hp - self.H))

    def crop_y(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.Hp == self.H else y[:, :self.H]


# Layers of the functional form, per owner (an object the caller passes, e.g. an HF experts module)
# or, without one, per w1 tensor (by identity: tensors compare elementwise), each with its
# configurations: built on first use, rebuilt larger when more tokens come, dropped with the owner.
_layers: Dict[int, Tuple["weakref.ref", dict]] = {}


def _layer_for(owner, key, make) -> _ExpertsLayer:
    i = id(owner)
    e = _layers.get(i)
    if e is None or e[0]() is not owner:
        def drop(ref, i=i):
            cur = _layers.get(i)
            if cur is not None and cur[0] is ref:
                del _layers[i]

        e = (weakref.ref(owner, drop), {})
        _layers[i] = e
    lay = e[1].get(key)
    if lay is None:
        lay = make()
        e[1][key] = lay
    return lay


class _Relayout(torch.autograd.Function):
    """A transposed expert weight [E, C, L] to the layer's [E, R, Cp] (flowmoe/expert_layout.h, on
    the CUDA stream PyTorch uses), its gradient back the same way."""

    @staticmethod
    def forward(ctx, w, C, L, R, Cp, row_map):
        wc = w.contiguous()
        out = torch.empty((w.shape[0], R, Cp), dtype=w.dtype, device=w.device)
        stream = torch.cuda.current_stream(w.device).cuda_stream
        with torch.cuda.device(w.device):
            _native.expert_relayout(wc.data_ptr(), out.data_ptr(), wc.element_size(), w.shape[0], C, L, R, Cp,
                                    row_map, True, stream)
        ctx.meta = (tuple(w.shape), C, L, R, Cp, row_map)
        return out

    @staticmethod
    def backward(ctx, g):
        shape, C, L, R, Cp, row_map = ctx.meta
        gc = g.contiguous()
        out = torch.empty(shape, dtype=g.dtype, device=g.device)
        stream = torch.cuda.current_stream(g.device).cuda_stream
        with torch.cuda.device(g.device):
            _native.expert_relayout(gc.data_ptr(), out.data_ptr(), gc.element_size(), shape[0], C, L, R, Cp,
                                    row_map, False, stream)
        return out, None, None, None, None, None


def experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w1: torch.Tensor,
            w2: torch.Tensor, *, recipe: str = "flow", align: int = 128, max_tokens: Optional[int] = None,
            sync_free: bool = False, check_finite: Optional[bool] = None, owner=None,
            b1: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None, activation: str = "swiglu",
            swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, transposed: bool = False,
            interleaved: bool = False) -> torch.Tensor:
    """y [..., H] = sum over k of top_k_weights[t, k] * expert_{top_k_index[t, k]}(x_t), the gated
    experts of w1 / w2 computed by flowmoe in ``recipe`` (see the module docstring for shapes).
    Differentiable in x, top_k_weights, w1, w2, b1 and b2. The native layer is cached per ``owner``
    (any weak-referenceable object; default: the w1 tensor) and configuration.

    gpt-oss and other layouts (docs/HF.md): ``b1`` [E, 2F] is added to GEMM1's output before the
    activation (by the layer), ``b2`` [E, H] to each expert's output before its routing weight
    (sum_k p_k b2[e_k], added here); ``activation="clamped-swiglu"`` is gpt-oss's
    (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit, |up| <= limit; ``transposed``: w1
    [E, H, 2F], w2 [E, F, H]; ``interleaved``: gate and up rows (columns when transposed) alternate
    (b1 too). H and F that are not multiples of 128 are zero-padded to the next multiple."""
    who = "flowmoe.torch.experts"
    E, H, F, k = _check_inputs(who, x, top_k_index, top_k_weights, w1, w2, bool(transposed))
    _check_biases(who, b1, b2, E, H, F, x.device)
    # sizes, top-k, recipe, alignment and activation: the library's checks, when the layer of this
    # configuration is first made (_ExpertsLayer)
    act = (activation, float(swiglu_alpha), float(swiglu_limit)) if activation != "swiglu" else ("swiglu", 1.702, 7.0)
    lay = _Layout(H, F, bool(transposed), bool(interleaved))
    # transposed weights are read where they are by the layers that can (the CPU layer; the CUDA
    # layer of the FP8 block recipes, and of bf16 with BF16 parameters: the library's rule), relaid
    # by differentiable copies for the others
    bf16_params = w1.dtype == w2.dtype == torch.bfloat16  # (else FP32: _ops.layer_weights)
    stored = lay.transposed and _reads_stored(recipe, x.device.type, bf16_params)
    key = (recipe, align, max_tokens, bool(sync_free), check_finite, E, H, F, k, act, b1 is not None,
           lay.transposed, lay.interleaved, stored, bf16_params)
    layer = _layer_for(owner if owner is not None else w1, key,
                       lambda: _ExpertsLayer(lay.Hp, lay.Fp, E, k, recipe, align, max_tokens, bool(sync_free),
                                             check_finite, who, act, b1 is not None, lay if stored else None,
                                             bf16_params))
    return _call(layer, x, top_k_index, top_k_weights, w1, w2, H, lay, b1, b2)


@functools.lru_cache(maxsize=None)
def _reads_stored(recipe: str, device_type: str, bf16: bool) -> bool:
    if device_type not in ("cpu", "cuda"):
        return False
    try:
        return _native.recipe_reads_stored_weights(recipe, device_type, bf16)
    except FlowmoeError:  # (an unknown recipe: the layer's own check says so, in its words)
        return False


def _call(layer: _ExpertsLayer, x, top_k_index, top_k_weights, w1, w2, H: int, lay: Optional[_Layout] = None,
          b1=None, b2=None) -> torch.Tensor:
    """The layer on x (any strides; bfloat16, float32 or float16, computed in bfloat16 and returned in
    x's dtype); no tokens: the empty output and zero gradients, no layer call."""
    if x.numel() == 0:
        return _NoTokens.apply(x, top_k_weights, w1, w2, *[b for b in (b1, b2) if b is not None])
    xb = x.reshape(-1, H)
    if xb.dtype != torch.bfloat16:
        xb = xb.to(torch.bfloat16)
    ids = top_k_index.to(torch.int32).contiguous()
    probs = top_k_weights.to(torch.float32).contiguous()
    if lay is None or (lay.identity and b1 is None):
        y = layer.run(xb.contiguous(), ids, probs, w1, w2)
    elif layer.storage is not None:  # w1, w2 as stored: the layer reads them there
        # (on 16-byte-aligned bases, which its kernels read through TMA: a view at another offset
        # goes as a differentiable copy, which the allocator aligns)
        w1, w2 = (w if w.data_ptr() % 16 == 0 else w.clone() for w in (w1, w2))
        y = lay.crop_y(layer.run(lay.pad_x(xb).contiguous(), ids, probs, w1, w2,
                                 lay.bias1(b1) if b1 is not None else None))
    else:
        w1l, w2l = lay.weights(w1, w2)
        y = lay.crop_y(layer.run(lay.pad_x(xb).contiguous(), ids, probs, w1l, w2l,
                                 lay.bias1(b1) if b1 is not None else None))
    if b2 is not None:  # sum_k p_k b2[e_k] (dropped slots: id -1, no bias)
        y = _add_down_bias(y, ids, probs, b2)
    return y.reshape(x.shape).to(x.dtype)


def _add_down_bias(y: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """y + sum_k p_k b2[e_k] (dropped slots, id -1, add nothing), in FP32 and rounded to BF16 once, as
    one matrix product: the routing weights as a dense [T, E] matrix P (each token's k weights in
    its experts' columns), then addmm(y, P, b2). Its backward is two products and a gather (dP,
    db2 = P^T dy); embedding_bag's sum with per-sample weights took 0.75 ms of a gpt-oss-20b block's
    step in its forward and backward kernels (docs/HF.md)."""
    w = probs.to(torch.float32) * (ids >= 0)
    P = w.new_zeros((ids.shape[0], b2.shape[0])).scatter_add(1, ids.clamp(min=0).long(), w)  # [T, E]
    return torch.addmm(y.to(torch.float32), P, b2.to(torch.float32)).to(torch.bfloat16)


class MoEExperts(nn.Module):
    """The experts of a MoE layer without its router, computed by flowmoe: ``forward(x, top_k_index,
    top_k_weights)`` with the routing chosen by the caller. Parameters (FP32 masters): ``w1 [E, 2F, H]``
    (gate rows first), ``w2 [E, H, F]``, nn.Linear's default initialisation per expert."""

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int, *, recipe: str = "flow",
                 align: int = 128, max_tokens: Optional[int] = None, sync_free: bool = False,
                 check_finite: Optional[bool] = None, seed: Optional[int] = None, device=None):
        super().__init__()
        self.hidden, self.ffn, self.experts, self.topk = hidden, ffn, experts, topk
        self.recipe, self.align, self.max_tokens = recipe, align, max_tokens
        self.sync_free, self.check_finite = bool(sync_free), check_finite
        self._layer = _ExpertsLayer(hidden, ffn, experts, topk, recipe, align, max_tokens, self.sync_free,
                                    check_finite, "flowmoe.torch.MoEExperts")
        gen = torch.Generator(device="cpu")
        if seed is not None:
            gen.manual_seed(int(seed))
        else:
            gen = None
        b1, b2 = 1.0 / hidden ** 0.5, 1.0 / ffn ** 0.5
        self.w1 = nn.Parameter(torch.empty(experts, 2 * ffn, hidden).uniform_(-b1, b1, generator=gen).to(device))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn).uniform_(-b2, b2, generator=gen).to(device))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        who = "flowmoe.torch.MoEExperts"
        E, H, F, k = _check_inputs(who, x, top_k_index, top_k_weights, self.w1, self.w2)
        if k != self.topk:
            raise ValueError(f"{who}: routing of {k} experts per token; expected topk = {self.topk}")
        return _call(self._layer, x, top_k_index, top_k_weights, self.w1, self.w2, H)

    def _apply(self, fn, *args, **kwargs):
        # the masters stay float32 under a dtype conversion (as MoE's): the layer needs FP32 masters
        return super()._apply(keep_fp32(fn, (self.w1, self.w2)), *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn={self.ffn}, experts={self.experts}, topk={self.topk}, "
                f"recipe={self.recipe}, align={self.align}")
