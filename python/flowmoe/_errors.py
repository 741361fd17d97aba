"""Exceptions raised by the flowmoe package (no native code needed to import them)."""


class FlowmoeError(RuntimeError):
    """An error reported by the flowmoe library: the message is flowmoe::Error's text (source
    location, what was wrong, what was expected). ``code`` is the C ABI status code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class NonFiniteError(FlowmoeError):
    """flowmoe::NonFiniteError: a non-finite value where finite ones are required (e.g. weights)."""


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
