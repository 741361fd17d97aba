"""flowmoe: FP8/MXFP4 Mixture-of-Experts layers for training, from Python.

``import flowmoe`` never loads the native library; ``flowmoe.torch`` (the PyTorch module
``flowmoe.torch.MoE``) loads it on first use. See docs/PYTHON.md.
"""

from ._errors import CommError, ConfigError, FlowmoeError, NonFiniteError, OutOfMemoryError, set_debug
from ._recipes import RECIPES

__version__ = "0.1.0"

__all__ = ["FlowmoeError", "ConfigError", "NonFiniteError", "CommError", "OutOfMemoryError", "RECIPES", "__version__",
           "native_available", "set_debug"]


def native_available() -> bool:
    """True when the native library (libflowmoe_capi.so) can be loaded."""
    from . import _native

    try:
        _native.lib()
    except FlowmoeError:
        return False
    return True
