"""Up-front checks of a layer's configuration, shared by flowmoe.torch.MoE, MoEExperts and
flowmoe.torch.experts: a mistake in the sizes is a ``ConfigError`` (a ``ValueError``) that says
what was wrong and what is expected, raised by the Python call itself (never a native error with a
C++ location).

The limits are the library's (include/flowmoe/token.h, MoeConfig::validate); the library still
checks everything again, and ``native_config_errors`` turns what it refuses at construction into
``ConfigError`` (a ValueError) too.
"""

from __future__ import annotations

import contextlib

from ._errors import ConfigError, FlowmoeError

MAX_EXPERTS = 1024  # kRouterMaxExperts: the router kernels' limit (one warp per token)
MAX_TOPK = 32       # kMaxTopk: one lane per routing slot
TILE = 128          # H and F are multiples of the layer's 1x128 / 128x128 FP8 tiles

# Where a caller with H or F not a multiple of 128 goes instead: these pad to the next multiple.
PADDING_WAY_OUT = ("flowmoe.torch.experts(...) (the experts with your own router) and flowmoe.hf "
                   "(Hugging Face models) zero-pad any size to the next multiple of 128")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_sizes(who: str, hidden, ffn, experts, topk, *, pads: bool = False) -> None:
    """ConfigError (a ValueError) unless hidden, ffn, experts and topk make a layer the library
    accepts. ``pads``: the caller zero-pads hidden and ffn to multiples of 128 itself (any positive
    size is fine)."""
    for name, v in (("hidden", hidden), ("ffn", ffn), ("experts", experts), ("topk", topk)):
        if not _is_int(v) or v < 1:
            raise ConfigError(f"{who}: {name} = {v!r}; expected a positive int")
    if experts > MAX_EXPERTS:
        raise ConfigError(f"{who}: experts = {experts}; expected at most {MAX_EXPERTS} (the router's limit)")
    if topk > MAX_TOPK:
        raise ConfigError(f"{who}: topk = {topk}; expected at most {MAX_TOPK} experts per token")
    if topk > experts:
        raise ConfigError(f"{who}: topk = {topk} with experts = {experts}; each token picks topk distinct "
                         f"experts, so expected topk <= experts")
    if pads:
        return
    for name, v in (("hidden", hidden), ("ffn", ffn)):
        if v % TILE:
            lower, upper = (v // TILE) * TILE, -(-v // TILE) * TILE
            nearest = f"{lower} or {upper}" if lower else f"{upper}"
            raise ConfigError(f"{who}: {name} = {v} is not a multiple of {TILE} (the layer's FP8 tiles); "
                             f"expected a multiple of {TILE} such as {nearest}. For other sizes, "
                             f"{PADDING_WAY_OUT}")


@contextlib.contextmanager
def native_config_errors(who: str):
    """Inside: a plain FlowmoeError of the library (a configuration it refuses while building a
    layer) becomes ConfigError, a ValueError prefixed with `who`. Other errors pass unchanged."""
    try:
        yield
    except FlowmoeError as e:
        if type(e) is not FlowmoeError:
            raise
        raise ConfigError(f"{who}: {e}", e.code, e.location) from None
