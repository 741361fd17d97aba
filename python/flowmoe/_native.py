"""ctypes binding of the C ABI (include/flowmoe/c_api.h) in libflowmoe_capi.so.

Nothing here depends on PyTorch: tensors are passed as raw addresses (host pointers for a CPU
layer, device pointers for a CUDA layer). ``flowmoe.torch`` builds on this module.
"""

from __future__ import annotations

import ctypes
import json
import operator
import os
import threading
from typing import Callable, Optional, Tuple

from ._errors import CommError, ConfigError, FlowmoeError, NonFiniteError, OutOfMemoryError, debug, split_location

LIBRARY_NAME = "libflowmoe_capi.so"
CAPI_VERSION = 12

OK, ERROR, ERROR_NONFINITE, ERROR_COMM, ERROR_UNSUPPORTED, ERROR_OUT_OF_MEMORY = 0, 1, 2, 3, 4, 5

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None


class Config(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("ffn", ctypes.c_int64),
        ("num_experts", ctypes.c_int32),
        ("topk", ctypes.c_int32),
        ("router", ctypes.c_char_p),
        ("renormalize", ctypes.c_int32),
        ("routed_scaling", ctypes.c_float),
        ("aux_loss_coef", ctypes.c_float),
        ("align", ctypes.c_int32),
        ("recipe", ctypes.c_char_p),
        ("max_tokens", ctypes.c_int64),
        ("check_columns", ctypes.c_int32),
        ("transpose_exponent", ctypes.c_char_p),
        ("external_routing", ctypes.c_int32),
        ("activation", ctypes.c_char_p),
        ("swiglu_alpha", ctypes.c_float),
        ("swiglu_limit", ctypes.c_float),
        ("gemm1_bias", ctypes.c_int32),
    ]


class CudaOptions(ctypes.Structure):
    _fields_ = [("sync_free", ctypes.c_int32), ("caller_memory", ctypes.c_int32),
                ("bf16_params_in_place", ctypes.c_int32), ("bf16_params_stored", ctypes.c_int32),  # (version 10)
                ("stored_hidden", ctypes.c_int64), ("stored_ffn", ctypes.c_int64),
                ("stored_interleaved", ctypes.c_int32)]  # (version 12)


class Weights(ctypes.Structure):  # flowmoe_weights (version 9)
    _fields_ = [("w1", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("bf16", ctypes.c_int32),
                ("wr", ctypes.c_void_p), ("router_bias", ctypes.c_void_p), ("stored_hidden", ctypes.c_int64),
                ("stored_ffn", ctypes.c_int64), ("interleaved", ctypes.c_int32)]


class Grads(ctypes.Structure):  # flowmoe_grads (version 9)
    _fields_ = [("dw1", ctypes.c_void_p), ("dw2", ctypes.c_void_p), ("bf16", ctypes.c_int32),
                ("dwr", ctypes.c_void_p), ("dprobs", ctypes.c_void_p), ("db1", ctypes.c_void_p),
                ("accumulate", ctypes.c_int32), ("stored_hidden", ctypes.c_int64), ("stored_ffn", ctypes.c_int64),
                ("interleaved", ctypes.c_int32)]


class Memory(ctypes.Structure):  # flowmoe_memory (version 9)
    _fields_ = [("weights", ctypes.c_void_p), ("saved", ctypes.c_void_p), ("transient", ctypes.c_void_p)]


class ForwardCall(ctypes.Structure):  # flowmoe_forward_call (version 10: params; 11: the step out)
    _fields_ = [("x", ctypes.c_void_p), ("tokens", ctypes.c_int64), ("y", ctypes.c_void_p), ("ids", ctypes.c_void_p),
                ("probs", ctypes.c_void_p), ("b1", ctypes.c_void_p), ("memory", Memory),
                ("params", ctypes.POINTER(Weights)), ("step_out", ctypes.c_void_p), ("step_capacity", ctypes.c_int64),
                ("step_size", ctypes.POINTER(ctypes.c_int64))]


class BackwardCall(ctypes.Structure):  # flowmoe_backward_call (version 9)
    _fields_ = [("dy", ctypes.c_void_p), ("dx", ctypes.c_void_p), ("grads", Grads),
                ("params", ctypes.POINTER(Weights)), ("memory", Memory), ("step", ctypes.c_void_p),
                ("step_bytes", ctypes.c_int64)]


class LayerStatus(ctypes.Structure):
    _fields_ = [("nonfinite", ctypes.c_int64), ("underflow", ctypes.c_int64), ("aux_loss", ctypes.c_float)]


class P2p(ctypes.Structure):
    _fields_ = [("peer", ctypes.c_int32), ("data", ctypes.c_void_p), ("bytes", ctypes.c_int64)]


ALLTOALL_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32),
                               ctypes.POINTER(ctypes.c_int32), ctypes.c_int32)
EXCHANGE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(P2p), ctypes.c_int32,
                               ctypes.POINTER(P2p), ctypes.c_int32)
BARRIER_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class HostCommOps(ctypes.Structure):
    _fields_ = [("ctx", ctypes.c_void_p), ("alltoall_i32", ALLTOALL_FN), ("exchange", EXCHANGE_FN),
                ("barrier", BARRIER_FN)]


def set_library_path(path: str) -> None:
    """Use the library at `path` instead of the one installed in the package (e.g. a CMake build
    tree's build/libflowmoe_capi.so). Must be called before the library is first loaded."""
    global _path
    with _lock:
        if _lib is not None and os.path.realpath(path) != os.path.realpath(_path or ""):
            raise FlowmoeError(f"flowmoe: the native library is already loaded from {_path}; "
                               f"set_library_path({path!r}) must come before its first use")
        _path = path


def library_path() -> str:
    return _path or os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)


def _declare(lib: ctypes.CDLL) -> None:
    c_int, vp, i64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
    sig = {
        "flowmoe_capi_version": (c_int, []),
        "flowmoe_last_error": (ctypes.c_char_p, []),
        "flowmoe_has_cuda": (c_int, []),
        "flowmoe_has_nccl": (c_int, []),
        "flowmoe_recipe_names": (ctypes.c_char_p, []),
        "flowmoe_layer_create_cpu": (c_int, [ctypes.POINTER(Config), vp, ctypes.POINTER(vp)]),
        "flowmoe_layer_create_cuda": (c_int, [ctypes.POINTER(Config), vp, c_int, vp, ctypes.POINTER(vp)]),
        "flowmoe_layer_create_cuda_opts": (c_int, [ctypes.POINTER(Config), vp, c_int, vp,
                                                   ctypes.POINTER(CudaOptions), ctypes.POINTER(vp)]),
        "flowmoe_layer_destroy": (c_int, [vp]),
        "flowmoe_config_check": (c_int, [ctypes.POINTER(Config), c_int, ctypes.POINTER(CudaOptions)]),
        "flowmoe_config_size_multiple": (i64, []),
        "flowmoe_expert_relayout": (c_int, [vp, vp, c_int, c_int, i64, i64, i64, i64, ctypes.POINTER(i64), c_int,
                                            vp]),
        "flowmoe_layer_backend": (ctypes.c_char_p, [vp]),
        "flowmoe_layer_local_experts": (c_int, [vp]),
        "flowmoe_layer_set_weights_ex": (c_int, [vp, ctypes.POINTER(Weights), ctypes.POINTER(Memory)]),
        "flowmoe_layer_reads_stored_weights": (c_int, [vp, c_int, ctypes.POINTER(c_int)]),
        "flowmoe_recipe_reads_stored_weights": (c_int, [ctypes.c_char_p, ctypes.c_char_p, c_int,
                                                        ctypes.POINTER(c_int)]),
        "flowmoe_layer_takes_backward_weights": (c_int, [vp, ctypes.POINTER(c_int)]),
        "flowmoe_layer_reads_params_in_place": (c_int, [vp, ctypes.POINTER(c_int)]),
        "flowmoe_layer_forward_call": (c_int, [vp, ctypes.POINTER(ForwardCall)]),
        "flowmoe_layer_backward_call": (c_int, [vp, ctypes.POINTER(BackwardCall)]),
        "flowmoe_layer_writes_stored_grads": (c_int, [vp, i64, i64, c_int, c_int, ctypes.POINTER(c_int)]),
        "flowmoe_layer_status_get": (c_int, [vp, ctypes.POINTER(LayerStatus)]),
        "flowmoe_layer_memory_plan": (c_int, [vp, ctypes.POINTER(i64)]),
        "flowmoe_layer_step_state": (c_int, [vp, vp, i64, ctypes.POINTER(i64)]),
        "flowmoe_layer_cast_report": (c_int, [vp, c_int, ctypes.POINTER(ctypes.c_char_p)]),
        "flowmoe_set_callback_error": (None, [ctypes.c_char_p]),
        "flowmoe_comm_create_host": (c_int, [c_int, c_int, ctypes.POINTER(HostCommOps), ctypes.c_double,
                                             ctypes.POINTER(vp)]),
        "flowmoe_nccl_unique_id": (c_int, [ctypes.POINTER(ctypes.c_uint8)]),
        "flowmoe_comm_create_nccl": (c_int, [c_int, c_int, ctypes.POINTER(ctypes.c_uint8), c_int,
                                             ctypes.c_double, ctypes.POINTER(vp)]),
        "flowmoe_comm_destroy": (c_int, [vp]),
        "flowmoe_comm_rank": (c_int, [vp]),
        "flowmoe_comm_world_size": (c_int, [vp]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def lib() -> ctypes.CDLL:
    """The loaded native library (loaded on first call). Raises FlowmoeError when it is missing."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not os.path.exists(path):
            raise FlowmoeError(
                f"flowmoe: the native library {path} is missing; expected the package installed with "
                "`pip install .` from the repository (or flowmoe._native.set_library_path(<build>/"
                f"{LIBRARY_NAME}) for a CMake build tree)")
        try:
            handle = ctypes.CDLL(path)
        except OSError as e:
            raise FlowmoeError(f"flowmoe: cannot load {path}: {e}") from e
        _declare(handle)
        version = handle.flowmoe_capi_version()
        if version != CAPI_VERSION:
            raise FlowmoeError(f"flowmoe: {path} implements C ABI version {version}; this Python "
                               f"package expects {CAPI_VERSION} (rebuild the package)")
        _lib = handle
        return _lib


_ERRORS = {ERROR_NONFINITE: NonFiniteError, ERROR_COMM: CommError, ERROR_OUT_OF_MEMORY: OutOfMemoryError}


def check(rc: int) -> None:
    """Raises the Python exception of a failed C call (status rc, message flowmoe_last_error)."""
    if rc == OK:
        return
    msg = lib().flowmoe_last_error().decode("utf-8", "replace")
    text, location = split_location(msg)
    raise _ERRORS.get(rc, FlowmoeError)(msg if debug() else text, rc, location)


def has_cuda() -> bool:
    return bool(lib().flowmoe_has_cuda())


def has_nccl() -> bool:
    return bool(lib().flowmoe_has_nccl())


def recipe_names() -> tuple:
    return tuple(lib().flowmoe_recipe_names().decode().split(","))


def _weights(w1: int, w2: int, bf16: bool, wr: Optional[int], router_bias: Optional[int],
             storage: Optional[Tuple[int, int, bool]]) -> "Weights":
    hs, fs, interleaved = storage if storage is not None else (0, 0, False)
    return Weights(w1, w2, int(bool(bf16)), wr or None, router_bias or None, int(hs), int(fs), int(bool(interleaved)))


def recipe_reads_stored_weights(recipe: str, backend: str, bf16: bool) -> bool:
    """Whether the layer of `recipe` on `backend` ("cpu", "cuda") reads BF16 (bf16) or FP32 expert
    weights where a model stores them (transposed, interleaved, unpadded: MoeWeights::storage), the
    library's rule."""
    out = ctypes.c_int()
    check(lib().flowmoe_recipe_reads_stored_weights(recipe.encode(), backend.encode(), int(bool(bf16)),
                                                    ctypes.byref(out)))
    return bool(out.value)


def expert_relayout(src: int, dst: int, elem_bytes: int, experts: int, c: int, l: int, r: int, cp: int,
                    row_map, to_layer: bool, stream: int) -> None:
    """flowmoe_expert_relayout (flowmoe/expert_layout.h) on device addresses."""
    m = (ctypes.c_int64 * 5)(*[int(v) for v in row_map])
    check(lib().flowmoe_expert_relayout(src, dst, int(elem_bytes), int(experts), int(c), int(l), int(r), int(cp), m,
                                        int(bool(to_layer)), stream))


def _c_int(name: str, v, bits: int) -> int:
    """v as a C int<bits> field: an int (operator.index: also numpy's; not a bool, not a float) that
    fits, else ConfigError. ctypes would wrap or truncate silently, and the library would then check
    another value than the caller's."""
    try:
        if isinstance(v, bool):
            raise TypeError
        i = operator.index(v)
    except TypeError:
        raise ConfigError(f"{name} = {v!r}; expected an int") from None
    hi = (1 << (bits - 1)) - 1
    if not -hi - 1 <= i <= hi:
        raise ConfigError(f"{name} = {i} does not fit the C ABI's int{bits}; expected at most {hi}")
    return i


def _c_str(name: str, v) -> bytes:
    if not isinstance(v, str):
        raise ConfigError(f"{name} = {v!r}; expected a str")
    return v.encode()


def make_config(hidden: int, ffn: int, experts: int, topk: int, router: str, renormalize: bool,
                routed_scaling: float, aux_loss_coef: float, align: int, recipe: str,
                max_tokens: int, check_columns: bool = False,
                transpose_exponent: str = "row-max", external_routing: bool = False,
                activation: str = "swiglu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                gemm1_bias: bool = False) -> Config:
    """The C configuration. Only the C types are checked here (ConfigError, named by the argument);
    the values are the library's to judge (check_config, or the layer's construction)."""
    return Config(_c_int("hidden", hidden, 64), _c_int("ffn", ffn, 64), _c_int("experts", experts, 32),
                  _c_int("topk", topk, 32), _c_str("router", router), int(bool(renormalize)),
                  float(routed_scaling), float(aux_loss_coef), _c_int("align", align, 32), _c_str("recipe", recipe),
                  _c_int("max_tokens", max_tokens, 64), int(bool(check_columns)),
                  _c_str("transpose_exponent", transpose_exponent), int(bool(external_routing)),
                  _c_str("activation", activation), float(swiglu_alpha), float(swiglu_limit),
                  int(bool(gemm1_bias)))


def check_config(config: Config, ep_world: int = 0, sync_free: bool = False) -> None:
    """flowmoe_config_check: raises FlowmoeError with the library's message unless a layer of
    `config` would be accepted, given a communicator of `ep_world` ranks (0: none) and the CUDA
    options the package uses (caller memory; `sync_free`). Makes no layer and touches no GPU."""
    opts = CudaOptions(int(bool(sync_free)), 1)
    check(lib().flowmoe_config_check(ctypes.byref(config), int(ep_world), ctypes.byref(opts)))


_size_multiple: Optional[int] = None


def size_multiple() -> int:
    """H and F of a layer are multiples of this (flowmoe_config_size_multiple: 128); callers that
    zero-pad other sizes pad to it."""
    global _size_multiple
    if _size_multiple is None:
        _size_multiple = int(lib().flowmoe_config_size_multiple())
    return _size_multiple


class Comm:
    """A flowmoe communicator handle (comm.h). Keeps the objects its callbacks need alive."""

    def __init__(self, handle: int, keepalive=None):
        self.handle = handle
        self._keepalive = keepalive

    @property
    def rank(self) -> int:
        return lib().flowmoe_comm_rank(self.handle)

    @property
    def world_size(self) -> int:
        return lib().flowmoe_comm_world_size(self.handle)

    def close(self) -> None:
        if self.handle:
            lib().flowmoe_comm_destroy(self.handle)
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def host_comm(rank: int, world_size: int, alltoall_i32: Callable, exchange: Callable,
              barrier: Callable, timeout_s: float = 300.0) -> Comm:
    """A host-memory communicator over Python callables (used for the CPU layer across processes):
    alltoall_i32(send_ptr, recv_ptr, n), exchange(sends, recvs) with lists of (peer, address,
    bytes), barrier(). An exception in a callable fails the communicator with its text."""

    def guard(fn):
        def call(*args):
            try:
                fn(*args)
                return 0
            except BaseException as e:  # the C++ caller turns this into a CommError
                lib().flowmoe_set_callback_error(f"{type(e).__name__}: {e}".encode("utf-8", "replace"))
                return 1
        return call

    def a2a(_ctx, send, recv, n):
        return guard(alltoall_i32)(ctypes.cast(send, ctypes.c_void_p).value,
                                   ctypes.cast(recv, ctypes.c_void_p).value, int(n))

    def exch(_ctx, sends, ns, recvs, nr):
        s = [(sends[i].peer, sends[i].data, sends[i].bytes) for i in range(ns)]
        r = [(recvs[i].peer, recvs[i].data, recvs[i].bytes) for i in range(nr)]
        return guard(exchange)(s, r)

    def bar(_ctx):
        return guard(barrier)()

    ops = HostCommOps(None, ALLTOALL_FN(a2a), EXCHANGE_FN(exch), BARRIER_FN(bar))
    handle = ctypes.c_void_p()
    check(lib().flowmoe_comm_create_host(int(rank), int(world_size), ctypes.byref(ops), float(timeout_s),
                                         ctypes.byref(handle)))
    return Comm(handle.value, keepalive=ops)


def nccl_unique_id() -> bytes:
    buf = (ctypes.c_uint8 * 128)()
    check(lib().flowmoe_nccl_unique_id(buf))
    return bytes(buf)


def nccl_comm(rank: int, world_size: int, unique_id: bytes, device: int, timeout_s: float = 120.0) -> Comm:
    if len(unique_id) != 128:
        raise ValueError(f"flowmoe: NCCL unique id of {len(unique_id)} bytes; expected 128")
    buf = (ctypes.c_uint8 * 128).from_buffer_copy(unique_id)
    handle = ctypes.c_void_p()
    check(lib().flowmoe_comm_create_nccl(int(rank), int(world_size), buf, int(device), float(timeout_s),
                                         ctypes.byref(handle)))
    return Comm(handle.value)


class Layer:
    """A MoE layer handle (moe.h MoeLayer) on raw addresses."""

    def __init__(self, config: Config, comm: Optional[Comm] = None, device: Optional[int] = None,
                 stream: int = 0, sync_free: bool = False, caller_memory: bool = False,
                 bf16_params_in_place: bool = False, bf16_params_stored: bool = False,
                 bf16_storage: Optional[Tuple[int, int, bool]] = None):
        self._comm = comm  # the layer does not own its communicator: keep it alive
        self.config = config
        handle = ctypes.c_void_p()
        comm_h = comm.handle if comm is not None else None
        if device is None:
            check(lib().flowmoe_layer_create_cpu(ctypes.byref(config), comm_h, ctypes.byref(handle)))
        else:
            hs, fs, inter = bf16_storage if bf16_storage is not None else (0, 0, False)
            opts = CudaOptions(int(bool(sync_free)), int(bool(caller_memory)), int(bool(bf16_params_in_place)),
                               int(bool(bf16_params_stored)), int(hs), int(fs), int(bool(inter)))
            check(lib().flowmoe_layer_create_cuda_opts(ctypes.byref(config), comm_h, int(device),
                                                       ctypes.c_void_p(stream or None), ctypes.byref(opts),
                                                       ctypes.byref(handle)))
        self.handle = handle.value
        self.device = device

    @property
    def backend(self) -> str:
        return lib().flowmoe_layer_backend(self.handle).decode()

    @property
    def local_experts(self) -> int:
        return lib().flowmoe_layer_local_experts(self.handle)

    def set_weights(self, w1: int, w2: int, wr: int, router_bias: Optional[int] = None, *, bf16: bool = False,
                    storage: Optional[Tuple[int, int, bool]] = None,
                    memory: Tuple[int, int, int] = (0, 0, 0)) -> None:
        """W1, W2 (FP32, or BF16 bits with bf16: the bits of FP32 masters of the same values), Wr, the
        router bias. storage: (H, F, interleaved) of W1, W2 stored transposed ([E, H, 2F], [E, F, H];
        read in place where reads_stored_weights), or None: the layer's layout. memory: a
        caller-memory layer's regions (weights, saved, transient; saved is not read, 0 where none)
        that receive the weight copies; (0, 0, 0) for a layer that owns its memory."""
        w = _weights(w1, w2, bf16, wr, router_bias, storage)
        m = Memory(*[a or None for a in memory])
        check(lib().flowmoe_layer_set_weights_ex(self.handle, ctypes.byref(w), ctypes.byref(m)))

    def reads_stored_weights(self, bf16: bool) -> bool:
        """Whether set_weights and backward_call's params take a storage (weights read where stored) for
        BF16 (bf16) or FP32 expert weights."""
        out = ctypes.c_int()
        check(lib().flowmoe_layer_reads_stored_weights(self.handle, int(bool(bf16)), ctypes.byref(out)))
        return bool(out.value)

    def forward_call(self, x: int, tokens: int, y: int, memory: Tuple[int, int, int] = (0, 0, 0), *,
                     ids: Optional[int] = None, probs: Optional[int] = None, b1: Optional[int] = None,
                     params: Optional[Tuple[int, int]] = None,
                     params_storage: Optional[Tuple[int, int, bool]] = None,
                     step: Optional[Tuple[int, int]] = None) -> Optional[int]:
        """One forward with everything it needs (C ABI v11): x, y [tokens, H] bf16; memory the caller
        regions (weights, saved, transient; 0 where none); the caller's routing ids / probs
        (external_routing) and GEMM1 bias b1 (gemm1_bias layers); params (w1, w2): the BF16 parameters
        its GEMMs read in place (reads_params_in_place; stored per params_storage: relaid per pass),
        else None. step (host address, capacity): the forward's step is its output, written there when
        it fits; returns its size in bytes (None without `step`; larger than capacity: call
        step_state with that size)."""
        w = _weights(params[0], params[1], True, None, None, params_storage) if params is not None else None
        size = ctypes.c_int64(0)
        c = ForwardCall(x, int(tokens), y, ids or None, probs or None, b1 or None, Memory(*[m or None for m in memory]),
                        ctypes.pointer(w) if w is not None else None, (step[0] or None) if step else None,
                        int(step[1]) if step else 0, ctypes.pointer(size) if step else None)
        check(lib().flowmoe_layer_forward_call(self.handle, ctypes.byref(c)))
        return int(size.value) if step else None

    def backward_call(self, dy: int, dx: int, memory: Tuple[int, int, int], step: Optional[Tuple[int, int]], *,
                      dw1: Optional[int], dw2: Optional[int], bf16: bool, dwr: Optional[int] = None,
                      dprobs: Optional[int] = None, db1: Optional[int] = None, accumulate: bool = False,
                      grads_storage: Optional[Tuple[int, int, bool]] = None,
                      params: Optional[Tuple[int, int, bool, Optional[int]]] = None,
                      params_storage: Optional[Tuple[int, int, bool]] = None) -> None:
        """One backward with everything it needs (C ABI v9): its forward's memory regions and step
        (address, bytes; None: the latest forward); the gradients dw1, dw2 FP32 (+= with accumulate)
        or BF16 (bf16, overwritten), in the layer's layout or where grads_storage (H, F, interleaved)
        says (the layer's writes_stored_grads), dwr, dprobs, db1; and params
        (w1, w2, bf16, wr: the parameters its dgrad weights are derived from, where stored per
        params_storage) or None (the weights region's copies)."""
        hs, fs, inter = grads_storage if grads_storage is not None else (0, 0, False)
        g = Grads(dw1 or None, dw2 or None, int(bool(bf16)), dwr or None, dprobs or None, db1 or None,
                  int(bool(accumulate)), int(hs), int(fs), int(bool(inter)))
        w = _weights(params[0], params[1], params[2], params[3], None, params_storage) if params is not None else None
        c = BackwardCall(dy, dx, g, ctypes.pointer(w) if w is not None else None,
                         Memory(*[m or None for m in memory]), step[0] if step else None, int(step[1]) if step else 0)
        check(lib().flowmoe_layer_backward_call(self.handle, ctypes.byref(c)))

    def writes_stored_grads(self, storage: Tuple[int, int, bool], bf16: bool) -> bool:
        """Whether backward_call writes dW1, dW2 of that kind in `storage`'s layout."""
        out = ctypes.c_int()
        hs, fs, inter = storage
        check(lib().flowmoe_layer_writes_stored_grads(self.handle, int(hs), int(fs), int(bool(inter)),
                                                      int(bool(bf16)), ctypes.byref(out)))
        return bool(out.value)

    @property
    def reads_params_in_place(self) -> bool:
        """Whether every forward takes the BF16 parameters (forward_call's params), read in place."""
        out = ctypes.c_int()
        check(lib().flowmoe_layer_reads_params_in_place(self.handle, ctypes.byref(out)))
        return bool(out.value)

    @property
    def takes_backward_weights(self) -> bool:
        """Whether a backward can derive its dgrad weights from the parameters (backward_call's params)."""
        out = ctypes.c_int()
        check(lib().flowmoe_layer_takes_backward_weights(self.handle, ctypes.byref(out)))
        return bool(out.value)

    def memory_plan(self) -> tuple:
        """(weights, saved, transient) bytes the caller provides (all 0: the layer owns its memory)."""
        out = (ctypes.c_int64 * 3)()
        check(lib().flowmoe_layer_memory_plan(self.handle, out))
        return int(out[0]), int(out[1]), int(out[2])

    def step_state(self, out: int, capacity: int) -> int:
        """After a forward: the size in bytes of its host state (moe.h MoeLayer::step_state),
        written to the host address `out` when `capacity` is at least that (else nothing is written)."""
        size = ctypes.c_int64()
        check(lib().flowmoe_layer_step_state(self.handle, out or None, int(capacity), ctypes.byref(size)))
        return int(size.value)

    def status(self) -> dict:
        s = LayerStatus()
        check(lib().flowmoe_layer_status_get(self.handle, ctypes.byref(s)))
        return {"nonfinite": int(s.nonfinite), "underflow": int(s.underflow), "aux_loss": float(s.aux_loss)}

    def cast_report(self, as_json: bool = True):
        out = ctypes.c_char_p()
        check(lib().flowmoe_layer_cast_report(self.handle, int(bool(as_json)), ctypes.byref(out)))
        text = out.value.decode("utf-8", "replace")
        return json.loads(text) if as_json else text

    def close(self) -> None:
        if getattr(self, "handle", None):
            h, self.handle = self.handle, None
            check(lib().flowmoe_layer_destroy(h))

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
