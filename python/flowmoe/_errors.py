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
