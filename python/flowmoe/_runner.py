"""The native layer as the PyTorch modules use it (flowmoe.torch.MoE, flowmoe.torch.experts): the
runner that builds it on a device and stream with PyTorch's memory, the owner of a runner (what
MoE and the experts-only layer share: building and growing it, the checks of a call, the recovery
after a failed call), the no-token call and the rule that keeps FP32 masters under a dtype
conversion. Shared by torch.py and experts.py (neither imports the other for these)."""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from typing import Optional

import torch

from . import _native
from ._errors import FlowmoeError


def keep_fp32(fn, masters):
    """`fn` for nn.Module._apply that moves the FP32 masters (tensors of `masters`; None allowed)
    but leaves their dtype under a dtype conversion (.to(torch.bfloat16), .half()): the layer
    needs FP32 masters (convert the input instead)."""
    own = {id(t) for t in masters if t is not None}

    def apply(t):
        out = fn(t)
        if id(t) in own and out.dtype != t.dtype:
            out = t.to(device=out.device)
        return out

    return apply


class _Runner:
    """The native layer of one module on one device and stream. A CUDA layer takes all its memory
    from PyTorch (caller memory): ``plan`` = (weights, saved, transient) bytes per call.

    A forward's step (what its backward needs on the host) is a uint8 CPU tensor: this runner's id
    (8 bytes) and the layer's step_state bytes. A backward finds the runner by that id
    (``_Runner.of_step``): the forward's own runner, also when the module has built a larger one
    since (its saved memory is laid out for the runner that made it). Runners are held by their
    module and by the autograd nodes of their forwards, not by this lookup."""

    _ids = itertools.count(1)
    _live: "weakref.WeakValueDictionary[int, _Runner]" = weakref.WeakValueDictionary()

    @staticmethod
    def build(cfg: _native.Config, comm, device: torch.device, max_tokens: int, sync_free: bool,
              who: str, bf16_params: bool = False, storage=None) -> "_Runner":
        """The native layer of `cfg` on `device`: a CUDA layer on PyTorch's current stream there
        (its own stream where that is the legacy default stream), taking its memory from PyTorch
        (caller memory), or a CPU layer. bf16_params: the expert parameters are BF16 (the CUDA layer
        of bf16 then reads them in place, reads_params_in_place, or with `storage` (H, F, interleaved),
        kept as the model stores them, reads them there or relays them in each pass)."""
        if device.type != "cuda":
            if sync_free:
                # Accepted at construction (a module built on the CPU is often moved to a GPU
                # afterwards) but it means nothing here: say so rather than ignore it silently.
                warnings.warn(f"{who}: sync_free=True has no effect on CPU tensors (the CPU layer has no "
                              "host synchronisation to remove); it applies once the module runs on a "
                              "CUDA device", UserWarning, stacklevel=2)
            return _Runner(_native.Layer(cfg, comm), device, None, max_tokens)
        if not _native.has_cuda():
            raise FlowmoeError(f"{who}: CUDA tensors but this flowmoe library was built without the CUDA "
                               "backend (no nvcc at build time); reinstall the package where nvcc is found, "
                               "or run on CPU tensors")
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(device)
        if stream.cuda_stream == 0:
            # The legacy default stream cannot take part in a CUDA graph capture (a later capture
            # on another stream would make it wait on the capturing stream: an error), so a layer
            # built there gets a stream of its own, ordered with the caller's by events (ordered()).
            with torch.cuda.device(index):
                stream = torch.cuda.Stream(device)
        with torch.cuda.device(index):
            layer = _native.Layer(cfg, comm, device=index, stream=stream.cuda_stream, sync_free=sync_free,
                                  caller_memory=True, bf16_params_in_place=bf16_params,
                                  bf16_params_stored=bf16_params and storage is not None,
                                  bf16_storage=storage if bf16_params else None)
        return _Runner(layer, device, stream, max_tokens)

    def __init__(self, layer: _native.Layer, device: torch.device, stream, max_tokens: int):
        self.layer = layer
        self.device = device
        self.stream = stream  # torch.cuda.Stream of a CUDA layer, None for CPU
        self.max_tokens = max_tokens
        self.plan = layer.memory_plan()
        # whether a backward takes the parameters (the experts-only CUDA layer of the FP8 block
        # recipes, which derive the dgrad weights from them, and of bf16 reading them in place): the
        # weight copies then need not outlive the forward
        self.backward_weights = layer.takes_backward_weights
        # whether every forward reads the BF16 parameters in place (forward_call's params): the weights
        # region then holds no BF16 copy of them (the CUDA layer of bf16 built with bf16_params)
        self.params_in_place = layer.reads_params_in_place
        self.id = next(_Runner._ids)
        self.step_capacity = 4096  # bytes of the last step_state (a first guess before the first)
        self.stored_grads = {}  # (storage, bf16) -> the layer's writes_stored_grads (LayerOwner._stored_grads)
        _Runner._live[self.id] = self

    def step_buffer(self) -> torch.Tensor:
        """A buffer for the next forward's step: the runner's id (8 bytes), then room for the layer's
        state (the size of the last one); the forward writes the state there (forward_call's step)."""
        buf = torch.empty(8 + self.step_capacity, dtype=torch.uint8)
        buf[:8].view(torch.int64)[0] = self.id
        return buf

    def step(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """After a forward that wrote n bytes of state into buf (step_buffer; n larger than its room:
        nothing written, read now from the layer): the forward's step, a uint8 CPU tensor (the
        runner's id, then the layer's state)."""
        if n > self.step_capacity:
            self.step_capacity = n
            buf = torch.empty(8 + n, dtype=torch.uint8)
            self.layer.step_state(buf.data_ptr() + 8, n)
            buf[:8].view(torch.int64)[0] = self.id
        return buf if n == buf.numel() - 8 else buf[:8 + n]

    @staticmethod
    def of_step(step: torch.Tensor, who: str) -> "_Runner":
        """The runner that made `step` (a tensor of step())."""
        if step.dtype != torch.uint8 or step.dim() != 1 or step.numel() <= 8 or step.device.type != "cpu":
            raise FlowmoeError(f"{who}: a step of {step.numel()} {step.dtype} values on {step.device}; expected "
                               "the uint8 CPU tensor a flowmoe forward returned")
        r = _Runner._live.get(int(step[:8].contiguous().view(torch.int64)[0]))
        if r is None:
            raise FlowmoeError(f"{who}: the native layer of this forward is gone (the module built a larger one "
                               "and nothing kept the old one, as happens under torch.compile); give the module "
                               "max_tokens to keep one layer for every size")
        return r

    @contextlib.contextmanager
    def ordered(self):
        """The layer's work ordered after the caller's current stream, and the current stream after
        the layer's (so that PyTorch may reuse the call's transient memory on it right away)."""
        if self.stream is None:
            yield
            return
        cur = torch.cuda.current_stream(self.device)
        if cur == self.stream:
            yield
            return
        self.stream.wait_stream(cur)
        try:
            yield
        finally:
            cur.wait_stream(self.stream)


class _NoTokens(torch.autograd.Function):
    """A call with no tokens (T = 0), as a native op treats it: the empty output, zero gradients
    for the weights and routing weights, and no layer call."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.shapes = [(w.shape, w.dtype, w.device) for w in weights]
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, dy):
        return (dy.new_empty(dy.shape), *[torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes])


class LayerOwner:
    """The owner of a native layer, named by the operators of _ops.py by its module id: flowmoe.torch.MoE
    (the full layer) and the experts-only layer of experts.py. An owner sets ``who`` (the name its
    messages begin with), ``hidden``, ``ffn``, ``experts``, ``local_experts``, ``topk``,
    ``max_tokens``, ``sync_free``, ``check_finite``, ``_runner = None``, ``_have_forward = False``
    and defines ``_config(max_tokens)``, the native configuration."""

    external_routing = False  # the caller routes: each forward gets ids and probs (the experts-only layer)
    gemm1_bias = False  # each forward gets GEMM1's bias b1 [E, 2F]
    grad_mode = "autograd"  # MoE: or "main_grad" (weight gradients added into p.main_grad)
    # (H, F, interleaved): w1, w2 come as a model stores them, transposed ([E, H, 2F], [E, F, H]),
    # read in place by the layer (its reads_stored_weights), the gradients mapped back by
    # _grads_to_storage; None: the layer's layout (the experts-only layer of gpt-oss-like models)
    storage = None
    # the expert parameters are BF16 (the experts-only layer keyed so), in the layer's layout or where
    # `storage` says: the layer may read them in place (_Runner.params_in_place)
    bf16_params = False

    def _ep_comm(self, device: torch.device):
        """The communicator of the layer on `device` (expert parallelism), or None."""
        return None

    def _drop_kept_weights(self) -> None:
        """Forgets weight copies kept across forwards (MoE's micro-batches) when the layer changes."""

    def _param_shapes(self, stored: bool = False):
        """The shapes of w1, w2 and wr (the router's: none in an experts-only layer) as the layer takes
        them; stored: w1's and w2's as `storage` holds them ([E, H, 2F], [E, F, H])."""
        El, H, F = self.local_experts, self.hidden, self.ffn
        if stored:
            hs, fs, _ = self.storage
            return (El, hs, 2 * fs), (El, fs, hs), (self.experts, H)
        return (El, 2 * F, H), (El, H, F), (self.experts, H)

    def _stored_grads(self, runner: _Runner, bf16: bool) -> bool:
        """Whether `runner`'s backward writes dW1, dW2 (BF16 with bf16) where `storage` keeps the
        weights (the library's rule, asked once per runner and kind)."""
        key = (self.storage, bool(bf16))
        if key not in runner.stored_grads:
            runner.stored_grads[key] = runner.layer.writes_stored_grads(self.storage, bf16)
        return runner.stored_grads[key]

    def _ensure_runner(self, device: torch.device, tokens: int) -> _Runner:
        """The native layer for `tokens` tokens on `device`, built (or rebuilt larger) when needed. A
        replaced layer lives on while forwards in flight hold it."""
        r = self._runner
        if r is not None and r.device == device and tokens <= r.max_tokens:
            return r
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise ValueError(f"{self.who}: {tokens} tokens; expected at most max_tokens = {self.max_tokens}")
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise FlowmoeError(f"{self.who}: forward inside a CUDA graph capture with {tokens} tokens needs a "
                               f"layer built beforehand (building it allocates memory): run one eager forward "
                               f"(a warm-up step) with at least this many tokens on {device} before capturing")
        max_tokens = self.max_tokens or max(tokens, r.max_tokens if r is not None else 0)
        self._runner = None
        self._drop_kept_weights()
        comm = self._ep_comm(device)
        cfg = self._config(max_tokens)
        self._runner = _Runner.build(cfg, comm, device, max_tokens, self.sync_free, self.who, self.bf16_params,
                                     self.storage)
        return self._runner

    def _check_call(self, xb: torch.Tensor, ids: Optional[torch.Tensor] = None) -> None:
        """Checks of a forward that need the data or the stream state (run inside the operator); ids:
        the caller's routing [T, k] of an experts-only layer."""
        if xb.is_cuda and torch.cuda.is_current_stream_capturing():
            if not self.sync_free:
                raise FlowmoeError(f"{self.who}: forward inside a CUDA graph capture needs sync_free=True "
                                   "(without it every forward synchronises the host to read the routing "
                                   "counts, which capture forbids)")
            if self.check_finite:
                raise FlowmoeError(f"{self.who}: check_finite=True synchronises the host, which a CUDA graph "
                                   "capture forbids; capture with check_finite off")
            return
        check = self.check_finite if self.check_finite is not None else xb.device.type == "cpu"
        if not check:
            return
        if not bool(torch.isfinite(xb).all()):
            bad = int((~torch.isfinite(xb)).sum())
            raise ValueError(f"{self.who}: the input holds {bad} non-finite value(s) (after conversion to "
                             "bfloat16); expected finite values")
        if ids is not None:
            bad = (ids < -1) | (ids >= self.experts)
            if bool(bad.any()):
                raise ValueError(f"{self.who}: top_k_index holds {int(bad.sum())} id(s) outside [0, "
                                 f"{self.experts}) (e.g. {int(ids[bad][0])}); expected expert ids (-1: dropped)")

    @staticmethod
    def _backward_follows(*tensors) -> bool:
        """Whether a forward on these inputs may be differentiated (its step must then be kept)."""
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

    @contextlib.contextmanager
    def _keep_layer_on_failure(self):
        """A call that fails (out of memory, bad input) leaves the owner as it was: a layer built or
        grown for the failed call is dropped (its memory with it) and the previous one, if any,
        stays, so a smaller call after an out-of-memory error runs as before (PyTorch's and
        accelerate's batch-size finders retry smaller)."""
        before = self._runner
        try:
            yield
        except BaseException:
            if self._runner is not before:
                self._runner = before
                self._drop_kept_weights()
            raise
