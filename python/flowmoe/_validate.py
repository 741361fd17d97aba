"""Up-front configuration checks of flowmoe.torch.MoE, MoEExperts and flowmoe.torch.experts.

The rules are the library's, each written once there (MoeConfig::validate and the sync-free rules of
check_sync_free_options, src/common/moe_common.cpp): ``check_config`` asks the C ABI's
``flowmoe_config_check`` when a module is built, which checks the configuration without making a
layer, allocating or touching a GPU. What it refuses is a ``ConfigError`` (a ``ValueError``) raised
by the Python call itself, carrying the library's message (what was wrong, what is expected; its
C++ location only in debug mode) prefixed with the Python call's name.

What stays on the Python side is the package's own: the ints and strings the C fields take
(_native.make_config: ctypes would wrap or truncate a value silently) and, for sizes that are not a
multiple of the library's (``flowmoe_config_size_multiple``), the hint naming the package's calls
that zero-pad them.
"""

from __future__ import annotations

from . import _native
from ._errors import ConfigError, FlowmoeError


def padding_way_out() -> str:
    """Where a caller with H or F not a multiple of the layer's size goes instead: these pad."""
    return ("flowmoe.torch.experts(...) (the experts with your own router) and flowmoe.hf (Hugging Face "
            f"models) zero-pad any size to the next multiple of {_native.size_multiple()}")


def _unpadded(sizes) -> bool:
    m = _native.size_multiple()
    return any(isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % m for v in sizes)


def check_config(who: str, make, *, ep_world: int = 0, sync_free: bool = False, sizes=()) -> None:
    """ConfigError (a ValueError) prefixed with ``who`` unless the library accepts the configuration
    ``make()`` builds (a _native.Config; its own ConfigError for a value the C fields cannot take)
    with a communicator of ``ep_world`` ranks (0: none) and, with ``sync_free``, the CUDA layer's
    sync-free options. ``sizes``: the caller's (hidden, ffn) where it does not pad them itself; when
    one is not a multiple of the library's size, the message adds the padding way out."""
    try:
        _native.check_config(make(), ep_world=ep_world, sync_free=sync_free)
    except FlowmoeError as e:
        if type(e) not in (FlowmoeError, ConfigError):
            raise
        msg = f"{who}: {e}"
        if _unpadded(sizes):
            msg += f". For other sizes, {padding_way_out()}"
        raise ConfigError(msg, e.code, e.location) from None
