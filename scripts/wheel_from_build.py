#!/usr/bin/env python3
"""Packs the Python package with the C ABI library of an existing CMake build into a wheel, so that
scripts/run.sh installs flowmoe without compiling the library a second time (`pip install .` would
configure and build it again in its own folder).

    python3 scripts/wheel_from_build.py BUILD_DIR OUT_DIR     # prints the wheel's path

The wheel holds what `pip install .` installs: python/flowmoe/*.py, libflowmoe_capi.so in flowmoe/
and the command-line tool in flowmoe/bin/ with its console script `flowmoe` (installed from the
build by `cmake --install --component python`, which gives both their install RPATHs, as
scikit-build-core does), tagged py3-none-<platform> like the
scikit-build-core wheel (no Python ABI: the library is loaded with ctypes).
"""

import base64
import hashlib
import os
import re
import stat
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
LIB = "libflowmoe_capi.so"
TOOL = "flowmoe"  # the command-line tool, flowmoe/bin/flowmoe (the console script `flowmoe` runs it)


def project_metadata():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]

    def field(name):
        m = re.search(rf'^{name}\s*=\s*"([^"]*)"', project, re.M)
        if not m:
            raise SystemExit(f"wheel_from_build: no {name} in pyproject.toml's [project]")
        return m.group(1)

    return field("name"), field("version"), field("description"), field("requires-python")


def installed_files(build):
    """The bytes of libflowmoe_capi.so and of the command-line tool as `cmake --install` writes them
    (install RPATHs): {LIB: bytes, "bin/flowmoe": bytes}."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="flowmoe-stage-") as stage:
        subprocess.run(["cmake", "--install", build, "--component", "python", "--prefix", stage],
                       check=True, stdout=subprocess.DEVNULL)
        for d, _, files in os.walk(stage):
            for name, key in ((LIB, LIB), (TOOL, f"bin/{TOOL}")):
                if name in files and key not in out:
                    with open(os.path.join(d, name), "rb") as f:
                        out[key] = f.read()
    if LIB not in out:
        raise SystemExit(f"wheel_from_build: {build} installed no {LIB} (configured with FLOWMOE_BUILD_CAPI=OFF?)")
    if f"bin/{TOOL}" not in out:
        raise SystemExit(f"wheel_from_build: {build} installed no {TOOL} tool (build the target flowmoe_main first)")
    return out


def record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def main(argv):
    if len(argv) != 3:
        raise SystemExit(__doc__)
    build, out = argv[1], argv[2]
    name, version, description, requires_python = project_metadata()
    files = {}  # archive name -> bytes
    pkg = os.path.join(ROOT, "python", "flowmoe")
    for d, dirs, names in os.walk(pkg):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for n in sorted(names):
            if n.endswith((".pyc", ".so")):
                continue
            path = os.path.join(d, n)
            with open(path, "rb") as f:
                files["flowmoe/" + os.path.relpath(path, pkg).replace(os.sep, "/")] = f.read()
    for key, data in installed_files(build).items():
        files[f"flowmoe/{key}"] = data

    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    tag = f"py3-none-{plat}"
    info = f"{name}-{version}.dist-info"
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 f"Summary: {description}\nRequires-Python: {requires_python}\n").encode()
    files[f"{info}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: flowmoe scripts/wheel_from_build.py\n"
                              f"Root-Is-Purelib: false\nTag: {tag}\n").encode()
    files[f"{info}/top_level.txt"] = b"flowmoe\n"
    files[f"{info}/entry_points.txt"] = b"[console_scripts]\nflowmoe = flowmoe._cli:main\n"
    record = [record_line(k, v) for k, v in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()

    os.makedirs(out, exist_ok=True)
    wheel = os.path.join(out, f"{name}-{version}-{tag}.whl")
    with zipfile.ZipFile(wheel + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data in files.items():
            zi = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            # a regular file's mode (pip keeps the executable bits only with S_IFREG set)
            zi.external_attr = (stat.S_IFREG | (0o755 if arcname.endswith((".so", "/bin/" + TOOL)) else 0o644)) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    os.replace(wheel + ".tmp", wheel)
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
