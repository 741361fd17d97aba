"""pytest setup of the flowmoe.torch tests.

The native library comes from --flowmoe-lib (a CMake build's libflowmoe_capi.so; ctest passes it)
or from the installed package. python/ is put first on sys.path unless the package is installed.
GPU tests are marked `gpu` and skipped without a CUDA device or a CUDA build of the library.
"""

import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def pytest_addoption(parser):
    parser.addoption("--flowmoe-lib", default=None,
                     help="path of libflowmoe_capi.so (default: the one inside the flowmoe package)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and a CUDA build of flowmoe")
    lib = config.getoption("--flowmoe-lib")
    if lib:
        if os.path.join(ROOT, "python") not in sys.path:
            sys.path.insert(0, os.path.join(ROOT, "python"))
        import flowmoe._native

        flowmoe._native.set_library_path(os.path.abspath(lib))


def pytest_collection_modifyitems(config, items):
    import torch

    import flowmoe._native as native

    has_gpu = torch.cuda.is_available() and native.has_cuda()
    skip = pytest.mark.skip(reason="needs a CUDA device and a CUDA build of flowmoe")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
