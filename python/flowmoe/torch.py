"""flowmoe.torch.MoE: the flowmoe MoE layer as a PyTorch module (docs/PYTHON.md).

The native library is loaded on first use (constructing a module), so ``import flowmoe.torch``
works without it. CPU tensors run the CPU backend (the readable reference, small shapes), CUDA
tensors the CUDA backend (Hopper).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Optional

from ._errors import require_torch

require_torch("flowmoe.torch")  # where PyTorch is missing: an error naming pip install '.[torch]'
import torch  # noqa: E402
from torch import nn

from . import _native, _ops
from ._errors import FlowmoeError
from ._validate import check_config
from ._runner import LayerOwner, _NoTokens, _Runner, keep_fp32  # noqa: F401  (MoE uses them)
from .experts import MoEExperts, experts  # noqa: F401  (flowmoe.torch.experts, MoEExperts)

__all__ = ["MoE", "FlowmoeError", "microbatch"]


_optimizer_steps = 0  # optimizer.step() calls of any optimizer in this process (global post-hook)
_hook_handle = None


def _count_optimizer_step(_optimizer, _args, _kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _install_optimizer_hook() -> None:
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook_handle = register_optimizer_step_post_hook(_count_optimizer_step)


_microbatch = threading.local()


@contextlib.contextmanager
def microbatch(first: bool):
    """Gradient accumulation over micro-batches: inside ``with microbatch(first=False):`` the
    modules' forwards reuse the weight copies of the latest refresh (as ``forward(x,
    is_first_microbatch=False)``); ``first=True`` refreshes them. See MoE.forward."""
    old = getattr(_microbatch, "first", None)
    _microbatch.first = bool(first)
    try:
        yield
    finally:
        _microbatch.first = old


class MoE(nn.Module, LayerOwner):
    """A Mixture-of-Experts FFN (router, top-k, SwiGLU experts) computed by flowmoe.

    Parameters (FP32 masters): ``w1 [E, 2F, H]`` (rows [0, F) gate, [F, 2F) up), ``w2 [E, H, F]``,
    ``wr [E, H]`` (router); with ``ep_group`` w1 and w2 hold this rank's E / world local experts.
    Buffer ``router_bias [E]`` when ``router_bias=True`` (selection only, not differentiated).

    ``forward(x, is_first_microbatch=None)``: x bf16 (or fp32, converted) ``[T, H]`` or
    ``[B, S, H]`` -> y of x's shape and dtype. Every forward re-derives the layer's weight copies
    from the parameters (one weight pass), so no update can be missed; with gradient accumulation
    pass ``is_first_microbatch=False`` (or use ``flowmoe.torch.microbatch(first=False)``) on the
    later micro-batches to reuse them. Gradients reach ``w1``/``w2``/``wr`` through autograd
    (``grad_mode="main_grad"``: accumulated in place into FP32 ``main_grad`` attributes instead).
    After a forward, ``aux_loss`` is the load-balancing loss (a detached scalar); its
    gradient is already applied by the layer's backward: do not add it to the loss you
    differentiate (add ``aux_loss.item()`` only to what you log). See docs/PYTHON.md.
    """

    who = "flowmoe.torch.MoE"  # (LayerOwner: the name its messages begin with)

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int, *, router: str = "softmax",
                 renormalize: bool = False, routed_scaling: float = 1.0, aux_loss_coef: float = 0.0,
                 recipe: str = "flow", align: int = 128, max_tokens: Optional[int] = None,
                 router_bias: bool = False, seed: Optional[int] = None, init_std: Optional[float] = None,
                 ep_group=None, grad_mode: str = "autograd", check_finite: Optional[bool] = None,
                 check_columns: bool = False, transpose_exponent: str = "row-max",
                 comm_timeout_s: float = 300.0, sync_free: bool = False, device=None):
        super().__init__()
        who = "flowmoe.torch.MoE"
        # Python's own arguments are checked here; the configuration's rules (sizes, top-k, recipe,
        # router, alignment, sync_free's needs, expert parallelism) are the library's, asked below.
        if grad_mode not in ("autograd", "main_grad"):
            raise ValueError(f"{who}: grad_mode {grad_mode!r}; expected 'autograd' (gradients "
                             "through autograd into .grad) or 'main_grad' (accumulated into p.main_grad)")
        self.hidden, self.ffn, self.experts, self.topk = hidden, ffn, experts, topk
        self.router, self.renormalize, self.routed_scaling = router, bool(renormalize), float(routed_scaling)
        self.aux_loss_coef, self.recipe, self.align = float(aux_loss_coef), recipe, align
        self.max_tokens = max_tokens
        self.grad_mode = grad_mode
        self.check_finite = check_finite
        self.check_columns = bool(check_columns)
        self.transpose_exponent = transpose_exponent
        self.comm_timeout_s = float(comm_timeout_s)
        self.sync_free = bool(sync_free)

        self.ep_group = ep_group
        self.ep_rank, self.ep_world = 0, 1
        if ep_group is not None:
            import torch.distributed as dist

            self.ep_rank, self.ep_world = dist.get_rank(ep_group), dist.get_world_size(ep_group)
            if max_tokens is None:
                raise ValueError(f"{who}: ep_group needs max_tokens (every rank must build "
                                 "its layer with the same configuration)")

        # The library checks the configuration now (not at the first forward), without making a
        # layer: with the communicator's rank count, and sync_free's rules on any device (a module
        # built on the CPU may move to a GPU; the CUDA runner uses caller memory).
        check_config(who, lambda: self._config(1 if max_tokens is None else max_tokens),
                     ep_world=self.ep_world if ep_group is not None else 0, sync_free=self.sync_free,
                     sizes=(hidden, ffn))
        self.local_experts = experts // self.ep_world

        E, El, H, F = experts, self.local_experts, hidden, ffn
        self.w1 = nn.Parameter(torch.empty(El, 2 * F, H, dtype=torch.float32, device=device))
        self.w2 = nn.Parameter(torch.empty(El, H, F, dtype=torch.float32, device=device))
        self.wr = nn.Parameter(torch.empty(E, H, dtype=torch.float32, device=device))
        if router_bias:
            self.register_buffer("router_bias", torch.zeros(E, dtype=torch.float32, device=device))
        else:
            self.router_bias = None
        self.reset_parameters(seed=seed, init_std=init_std)

        self._runner: Optional[_Runner] = None
        self._comm = None
        self._comm_device = None
        self.weight_updates = 0  # weight refreshes (re-quantizations of the masters) so far
        self._have_forward = False
        # the copies of the latest refresh and what they were made from (MoE._weights_current)
        self._wbuf: Optional[torch.Tensor] = None
        self._wkey = None
        self._op_id = _ops.register_module(self)
        _install_optimizer_hook()
        self.register_load_state_dict_post_hook(MoE._loaded)

    # ---- initialisation ------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: Optional[int] = None, init_std: Optional[float] = None) -> None:
        """nn.Linear's default per expert (uniform in +-1/sqrt(fan_in)), or normal(0, init_std).
        Drawn on the CPU for all E experts from torch.Generator(seed) (the global generator when
        seed is None), then this rank's experts are copied: the same seed gives the same experts
        on any device and any expert-parallel world size."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(int(seed))
        E, H, F = self.experts, self.hidden, self.ffn

        def draw(shape, fan_in):
            t = torch.empty(shape, dtype=torch.float32)
            if init_std is not None:
                t.normal_(0.0, float(init_std), generator=gen)
            else:
                b = 1.0 / math.sqrt(fan_in)
                t.uniform_(-b, b, generator=gen)
            return t

        w1, w2, wr = draw((E, 2 * F, H), H), draw((E, H, F), F), draw((E, H), H)
        lo, hi = self.ep_rank * self.local_experts, (self.ep_rank + 1) * self.local_experts
        self.w1.copy_(w1[lo:hi])
        self.w2.copy_(w2[lo:hi])
        self.wr.copy_(wr)

    def extra_repr(self) -> str:
        s = (f"hidden={self.hidden}, ffn={self.ffn}, experts={self.experts}, topk={self.topk}, "
             f"router={self.router}, recipe={self.recipe}, align={self.align}")
        if self.ep_world > 1:
            s += f", ep={self.ep_rank}/{self.ep_world}"
        return s

    def _param_name(self, p) -> str:
        for n, q in self.named_parameters():
            if q is p:
                return n
        return "parameter"

    def _config(self, max_tokens: int) -> _native.Config:
        return _native.make_config(self.hidden, self.ffn, self.experts, self.topk, self.router,
                                   self.renormalize, self.routed_scaling, self.aux_loss_coef,
                                   self.align, self.recipe, max_tokens, self.check_columns,
                                   self.transpose_exponent)

    # ---- the native layer (built and grown by LayerOwner._ensure_runner) -----------------------------
    def _ep_comm(self, device: torch.device):
        if self.ep_group is None:
            return None
        if self._comm is not None and self._comm_device == device:
            return self._comm
        from . import _dist

        if device.type == "cuda":
            self._comm = _dist.nccl_comm_from_group(self.ep_group, device, self.comm_timeout_s)
        else:
            self._comm = _dist.host_comm_from_group(self.ep_group, self.comm_timeout_s)
        self._comm_device = device
        return self._comm

    # ---- weights -----------------------------------------------------------------------------------
    def _drop_kept_weights(self) -> None:
        self._wbuf, self._wkey = None, None

    def _weights_key(self):
        ts = (self.w1, self.w2, self.wr, self.router_bias)
        return (_optimizer_steps, self._runner,
                tuple((t._version, t.data_ptr(), t.device) if t is not None else None for t in ts))

    def _weights_current(self) -> bool:
        """The copies of the latest refresh still stand for the parameters: same layer, no
        optimizer step anywhere since, no state-dict load, the same tensors at the same versions."""
        return self._wbuf is not None and self._wkey == self._weights_key()

    @staticmethod
    def _loaded(module, _incompatible_keys) -> None:
        module._wkey = None  # the next forward refreshes

    def _params(self):
        return self.w1, self.w2, self.wr

    def _main_grad(self, i: int) -> torch.Tensor:
        p = self._params()[i]
        g = getattr(p, "main_grad", None)
        if g is None:
            g = torch.zeros_like(p)
            p.main_grad = g
        if g.dtype != torch.float32 or g.shape != p.shape or g.device != p.device or not g.is_contiguous():
            raise FlowmoeError(f"flowmoe.torch.MoE: {self._param_name(p)}.main_grad is {g.dtype} "
                               f"{tuple(g.shape)} on {g.device} (contiguous: {g.is_contiguous()}); "
                               "expected a contiguous float32 tensor like the parameter")
        return g

    # ---- forward -----------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"flowmoe.torch.MoE: input of type {type(x).__name__}; expected a torch.Tensor")
        if x.dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise TypeError(f"flowmoe.torch.MoE: input dtype {x.dtype}; expected torch.bfloat16 "
                            "(or torch.float32 / torch.float16, computed in bfloat16)")
        if x.dim() not in (2, 3) or x.shape[-1] != self.hidden:
            raise ValueError(f"flowmoe.torch.MoE: input shape {tuple(x.shape)}; expected [T, {self.hidden}] "
                             f"or [B, S, {self.hidden}]")
        if x.numel() == 0 and self.ep_group is not None:
            raise ValueError(f"flowmoe.torch.MoE: empty input {tuple(x.shape)} with expert parallelism; "
                             "expected at least one token per rank (the exchange is collective)")
        if x.device != self.w1.device:
            raise ValueError(f"flowmoe.torch.MoE: input on {x.device} but the parameters on "
                             f"{self.w1.device}; expected the same device")
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"flowmoe.torch.MoE: input on {x.device}; expected a CPU or CUDA tensor")

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """y = MoE(x). ``is_first_microbatch``: None (default) refreshes the weight copies from the
        parameters (and keeps them only while this forward's backward needs them); True refreshes
        and keeps them; False reuses those kept by the latest True (the later micro-batches of
        gradient accumulation) unless an optimizer step, a state-dict load or an in-place change
        of a parameter happened since, or none were kept. ``flowmoe.torch.microbatch(first=...)`` sets
        it for every module inside its ``with`` block."""
        self._check_input(x)
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(f"flowmoe.torch.MoE: is_first_microbatch = {is_first_microbatch!r}; expected None, "
                            "True or False")
        if x.numel() == 0:  # (main_grad mode: nothing to add, and autograd gets no weight gradient)
            return _NoTokens.apply(x, *(self._params() if self.grad_mode != "main_grad" else ()))
        with self._keep_layer_on_failure():
            return self._forward(x, is_first_microbatch)

    def _forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool]) -> torch.Tensor:
        xb = x.reshape(-1, self.hidden)  # (any strides: a copy where the view is not contiguous)
        if xb.dtype != torch.bfloat16:
            xb = xb.to(torch.bfloat16)
        xb = xb.contiguous()
        tokens = int(xb.shape[0])
        compiling = torch.compiler.is_compiling()
        if not compiling and xb.is_cuda and torch.cuda.is_current_stream_capturing():
            self._check_call(xb)  # before the weight refresh, which a refused capture must not record
        if is_first_microbatch is None:
            is_first_microbatch = getattr(_microbatch, "first", None)
        wbuf = None
        if not compiling and is_first_microbatch is False and not (
                xb.is_cuda and torch.cuda.is_current_stream_capturing()):
            r = self._runner
            if r is not None and r.device == xb.device and tokens <= r.max_tokens and self._weights_current():
                wbuf = self._wbuf
        if wbuf is None:
            if not compiling:  # the old copies go back to the allocator before the new ones are made
                self._drop_kept_weights()
            bias = self.router_bias.detach() if self.router_bias is not None else None
            wbuf = _ops.derive_weights(self.w1.detach(), self.w2.detach(), self.wr.detach(), bias,
                                       self._op_id, tokens)
            if not compiling and is_first_microbatch is True:
                # kept for the later micro-batches only when asked: otherwise the copies live as
                # long as the forwards that use them (autograd frees them after the backward)
                self._wbuf, self._wkey = wbuf, self._weights_key()
        keep = self._backward_follows(xb, *self._params())
        y, _saved, _step = _ops.moe_forward(xb, self.w1, self.w2, self.wr, wbuf, self._op_id, keep, None, None, None)
        return y.reshape(x.shape).to(x.dtype)

    # ---- reports -----------------------------------------------------------------------------------
    def _layer(self) -> _Runner:
        if self._runner is None:
            raise FlowmoeError("flowmoe.torch.MoE: no layer yet; call forward first")
        return self._runner

    @property
    def aux_loss(self) -> Optional[torch.Tensor]:
        """The load-balancing loss of the last forward: a detached float32 scalar on the module's
        device (None before the first forward). Its gradient is part of the layer's backward.
        Reading it on CUDA synchronises the layer's stream."""
        if not self._have_forward or self._runner is None:
            return None
        return torch.tensor(self.status()["aux_loss"], dtype=torch.float32, device=self.w1.device)

    def status(self) -> dict:
        """MoeStatus of the current step: {'nonfinite', 'underflow', 'aux_loss'} (forward resets,
        backward adds)."""
        r = self._layer()
        with r.ordered():
            return r.layer.status()

    def cast_report(self, as_text: bool = False):
        """The cast report (moe.h CastReport) of the last set_weights / forward / backward: a dict
        (ops, saved tensors with their bytes, column checks, wire transfers, quantization stats,
        saved_bytes, saved_bytes_per_token, ...) or, with as_text, the library's table."""
        r = self._layer()
        with r.ordered():
            return r.layer.cast_report(as_json=not as_text)

    def saved_bytes(self) -> int:
        """Bytes the last forward saved for backward (codes + scales, padding rows included)."""
        return int(self.cast_report()["saved_bytes"])

    def saved_bytes_per_token(self) -> float:
        return float(self.cast_report()["saved_bytes_per_token"])

    def release(self) -> None:
        """Drops the native layer (and communicator); the next forward builds them again. Forwards
        in flight keep the layer they ran on until their backward."""
        self._runner = None
        self._comm = None
        self._drop_kept_weights()

    def _apply(self, fn, *args, **kwargs):
        # .to(device) / .cuda() move the masters; a dtype conversion (.to(torch.bfloat16), .half())
        # leaves them float32 (the layer needs FP32 masters; convert the input instead). The layer
        # follows the parameters at the next forward.
        own = (self.w1, self.w2, self.wr, self.router_bias)
        return super()._apply(keep_fp32(fn, own), *args, **kwargs)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_runner"] = None
        state["_comm"] = None
        state["_wbuf"], state["_wkey"] = None, None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._op_id = _ops.register_module(self)  # a copy is a module of its own


# The experts-only layer (routing from the caller, issue 31): flowmoe/experts.py.

__all__ += ["MoEExperts", "experts"]
