"""Where PyTorch is not installed (`pip install .` leaves it out), the modules that need it fail
with one clear error naming `pip install '.[torch]'`, not a bare ModuleNotFoundError, and
`import flowmoe` still works. PyTorch is hidden from a child interpreter (None in sys.modules)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    return subprocess.run([sys.executable, "-c", HIDE_TORCH + code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_import_flowmoe_works_without_torch():
    r = run_without_torch("import flowmoe; print(flowmoe.__version__)")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("module", ["flowmoe.torch", "flowmoe.hf", "flowmoe.lm", "flowmoe.data"])
def test_modules_that_need_torch_name_the_extra(module):
    r = run_without_torch(f"""
import flowmoe._errors as errors
try:
    import {module}
except ModuleNotFoundError as e:
    assert isinstance(e, errors.MissingTorchError), type(e)
    print(e)
else:
    raise SystemExit("imported without torch")
""")
    assert r.returncode == 0, r.stderr
    assert f"{module} needs PyTorch" in r.stdout and "pip install '.[torch]'" in r.stdout


def test_train_help_without_torch_is_one_line_naming_the_extra():
    r = run_without_torch("import runpy; sys.argv = ['flowmoe.train', '--help']; "
                          "runpy.run_module('flowmoe.train', run_name='__main__')")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("flowmoe.train: python -m flowmoe.train needs PyTorch")
    assert "pip install '.[torch]'" in r.stderr
