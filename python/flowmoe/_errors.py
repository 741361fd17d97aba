"""Exceptions raised by the flowmoe package (no native code needed to import them).

Messages of the native library end with the C++ source location of the check that failed
("... [src/common/moe_common.cpp:119]"). That is for flowmoe's developers, so the Python package
drops it from the message unless debugging is on (``flowmoe.set_debug(True)``; the package reads no
environment variable); the location is always kept in the exception's ``location``.
"""

import re

# " [src/common/moe_common.cpp:119]": a repository path and a line (include/flowmoe/error.h).
_LOCATION = re.compile(r" \[((?:src|include|tools|tests|bench|python)/[^\]\s]+:\d+)\]")

_debug = False


def set_debug(on: bool) -> None:
    """Whether error messages keep the C++ source location of the failed check (default: off)."""
    global _debug
    _debug = bool(on)


def debug() -> bool:
    return _debug


def split_location(message: str):
    """(message without C++ source locations, the last location or None)."""
    found = _LOCATION.findall(message)
    return _LOCATION.sub("", message), (found[-1] if found else None)


class FlowmoeError(RuntimeError):
    """An error reported by the flowmoe library: what was wrong and what was expected (flowmoe::Error's
    text; its C++ source location only in debug mode, see the module docstring). ``code`` is the C
    ABI status code, ``location`` the C++ source location ("src/...:line") where there was one."""

    def __init__(self, message: str, code: int = 1, location=None):
        super().__init__(message)
        self.code = code
        self.location = location


class ConfigError(FlowmoeError, ValueError):
    """A configuration the library refuses (sizes, top-k, recipe...): a ``ValueError`` like the
    checks the Python modules make themselves, and a FlowmoeError for code that catches those."""


class NonFiniteError(FlowmoeError, ValueError):
    """flowmoe::NonFiniteError: a non-finite value where finite ones are required (e.g. weights).
    Also a ``ValueError``: the values given were wrong, not the library."""


class CommError(FlowmoeError):
    """flowmoe::CommError: a communication failure (timeout, failed peer, mismatch across ranks)."""


try:  # PyTorch's class where it is installed, so that retry-smaller logic catches ours too
    from torch import OutOfMemoryError as _TorchOutOfMemoryError
except ImportError:  # pragma: no cover - the package works without torch for its C ABI
    _TorchOutOfMemoryError = MemoryError


class OutOfMemoryError(FlowmoeError, _TorchOutOfMemoryError):
    """flowmoe::OutOfMemoryError: a device allocation of the library failed. Also a
    ``torch.OutOfMemoryError`` (when PyTorch is installed) and its message says "CUDA out of
    memory.", so batch-size finders (transformers' ``auto_find_batch_size``, accelerate) retry smaller."""


class MissingTorchError(ModuleNotFoundError):
    """PyTorch is not installed but a module that needs it was imported. ``pip install .`` does not
    install PyTorch (``import flowmoe`` and the C ABI work without it); the ``[torch]`` extra does."""


def require_torch(who: str) -> None:
    """Raises MissingTorchError, naming the install command, where PyTorch cannot be imported.
    Called by the modules that need PyTorch before their own ``import torch``."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise MissingTorchError(
            f"{who} needs PyTorch, which is not installed (`pip install .` leaves it out). Install the "
            "package with its [torch] extra: pip install '.[torch]' (from the source folder), or "
            "PyTorch alone: pip install torch (https://pytorch.org for a CUDA build)", name="torch") from None
