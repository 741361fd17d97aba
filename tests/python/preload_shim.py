"""Builds an LD_PRELOAD shim for the CLI tests (test_cli_output_set.py, test_cli_set_safety.py): the
C source is compiled at test time, so that flowmoe itself needs no test hook and reads no
environment variable."""

import os
import shutil
import subprocess
import sys


def build_shim(tmp, source, who):
    """Compiles `source` (C) into tmp/shim.so and returns its path; `who` names the test in the
    message when no C compiler is found."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit(f"{who}: no C compiler (cc or gcc) for the LD_PRELOAD shim")
    src, lib = os.path.join(tmp, "shim.c"), os.path.join(tmp, "shim.so")
    with open(src, "w") as f:
        f.write(source)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", lib, src, "-ldl"], check=True)
    return lib
