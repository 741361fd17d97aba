#!/usr/bin/env python3
"""Fuzz test of the `flowmoe` file commands (issue 20), bounded for CI.

usage: test_cli_fuzz.py PATH/TO/flowmoe [--seed N] [--scale F]

Runs the tool on malformed .npy headers, hostile shapes, inconsistent quantized sets, random
mutations of valid files and outputs that cannot be written. Every run has a timeout and must
  - exit with status 0, 1 or 2 (no signal, no other status, no hang),
  - after a non-zero exit, leave the directory exactly as it was: no new file (no temporaries,
    no part of an output set) and every existing file (the inputs, an older set) unchanged.
Prints how many runs of each kind it made. --scale multiplies the number of runs (default 1:
about 1,500 runs, well under a minute on two idle cores). Needs numpy only.
"""
import hashlib
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

FLOWMOE = None
TIMEOUT_S = 20
COUNTS = {}
STATUS = {0: 0, 1: 0, 2: 0}
FAILURES = []


# ---- .npy bytes ---------------------------------------------------------------------------------

def npy_bytes(descr, shape, data=b"", fortran=False, version=1, header=None, pad=True):
    """A .npy file as bytes; `header` replaces the dict text when given."""
    if header is None:
        shape_txt = "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
        header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape_txt)
    h = header.encode("latin1") if isinstance(header, str) else header
    pre = 10 if version == 1 else 12
    if pad:
        total = (pre + len(h) + 1 + 63) // 64 * 64
        h = h + b" " * (total - pre - len(h) - 1) + b"\n"
    if version == 1:
        head = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h) & 0xFFFF)
    else:
        head = b"\x93NUMPY\x02\x00" + struct.pack("<I", len(h))
    return head + h + data


def arr_bytes(a):
    a = np.ascontiguousarray(a)
    descr = {np.dtype(np.float32): "<f4", np.dtype(np.uint16): "<u2", np.dtype(np.uint8): "|u1",
             np.dtype(np.int32): "<i4"}[a.dtype]
    return npy_bytes(descr, a.shape, a.tobytes())


def write(path, blob):
    with open(path, "wb") as f:
        f.write(blob)


# ---- one run ------------------------------------------------------------------------------------

def snapshot(d):
    out = {}
    for root, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(root, n)
            rel = os.path.relpath(p, d)
            if os.path.isdir(p) and not os.path.islink(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha1(f.read()).hexdigest()
    return out


def run(kind, d, *args):
    """Runs flowmoe in directory d; checks the exit status and, after an error, that d is unchanged."""
    COUNTS[kind] = COUNTS.get(kind, 0) + 1
    before = snapshot(d)
    cmd = [FLOWMOE] + [str(a) for a in args]
    try:
        p = subprocess.run(cmd, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        FAILURES.append("%s: HANG (> %d s): %s" % (kind, TIMEOUT_S, " ".join(map(str, args))))
        return None
    rc = p.returncode
    if rc not in (0, 1, 2):
        what = "signal %d" % -rc if rc < 0 else "exit status %d" % rc
        FAILURES.append("%s: %s: %s\n%s" % (kind, what, " ".join(map(str, args)), p.stderr.decode(errors="replace")[-2000:]))
        return rc
    STATUS[rc] += 1
    if rc != 0:
        after = snapshot(d)
        if after != before:
            added = sorted(set(after) - set(before))
            changed = sorted(k for k in before if k in after and before[k] != after[k])
            removed = sorted(set(before) - set(after))
            FAILURES.append("%s: exit %d but the directory changed (added %s, changed %s, removed %s): %s\n%s"
                            % (kind, rc, added, changed, removed, " ".join(map(str, args)),
                               p.stderr.decode(errors="replace")[-500:]))
        if len(p.stderr) > 4000:
            FAILURES.append("%s: error message of %d bytes (long headers must be cut): %s"
                            % (kind, len(p.stderr), " ".join(map(str, args))))
    return rc


def fresh(base, name):
    d = os.path.join(base, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


# ---- valid material -----------------------------------------------------------------------------

LAYOUTS = ("row", "col", "weight", "mxfp4")


def make_valid_sets(d, rng):
    """Quantized sets of every layout, made by the tool itself; returns {name: {suffix: bytes}}."""
    x = (rng.standard_normal((256, 256)) * np.exp2(rng.integers(-20, 20, (256, 1)))).astype(np.float32)
    write(os.path.join(d, "x.npy"), arr_bytes(x))
    sets = {}
    for lay in LAYOUTS:
        args = ["quantize", "--layout", lay]
        if lay == "col":
            args += ["--segments", "100,0,156"]
        p = subprocess.run([FLOWMOE] + args + ["x.npy", "v_" + lay], cwd=d, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=TIMEOUT_S)
        assert p.returncode == 0, p.stderr.decode()
        sets[lay] = {}
        for suf in ("codes", "scales", "segments"):
            path = os.path.join(d, "v_%s.%s.npy" % (lay, suf))
            if os.path.exists(path):
                with open(path, "rb") as f:
                    sets[lay][suf] = f.read()
    with open(os.path.join(d, "x.npy"), "rb") as f:
        sets["input"] = {"x": f.read()}
    return sets


def put_set(d, prefix, files):
    for suf, blob in files.items():
        write(os.path.join(d, "%s.%s.npy" % (prefix, suf)), blob)


def consumers(lay, prefix, out):
    """Commands that read a quantized set of layout `lay`."""
    cmds = [["dequantize", "--layout", lay, prefix, out + ".npy"]]
    if lay == "row":
        cmds.append(["transpose", "--method", "aware", prefix, out])
        cmds.append(["transpose", "--method", "naive", "--segments", "100,156", prefix, out])
    if lay == "mxfp4":
        cmds.append(["fp4-to-fp8", "--to", "row", prefix, out])
        cmds.append(["fp4-to-fp8", "--to", "col", prefix, out])
        cmds.append(["fp4-to-fp8", "--to", "col-stepwise", prefix, out])
    return cmds


# ---- kinds --------------------------------------------------------------------------------------

def malformed_headers(base, rng, n):
    d = fresh(base, "hdr")
    good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 128), }"
    data = np.ones((2, 128), np.float32).tobytes()
    variants = [
        good + "x", good + " }", good + "\x00", good + "#", good + "{}", good + "'", "{" + good,
        good.replace("}", ""), good.replace("{", ""), good.replace("'descr'", "'descrx'"),
        good.replace("'shape': (2, 128), ", ""), good.replace("False", "Maybe"),
        good.replace("False", "True"), good.replace("(2, 128)", "(2, -128)"),
        good.replace("(2, 128)", "(2, 128"), good.replace("(2, 128)", "((2,), 128)"),
        good.replace("(2, 128)", "(2.5, 128)"), good.replace("(2, 128)", "(99999999999999999999999, 1)"),
        good.replace("(2, 128)", "(9223372036854775807, 9223372036854775807)"),
        good.replace("'<f4'", "'>f4'"), good.replace("'<f4'", "'<f8'"), good.replace("'<f4'", "[('a', '<f4')]"),
        good.replace("'<f4'", "'<f4"), good.replace("'<f4'", "'" + "A" * 5000 + "'"),
        good.replace(", }", ", 'extra': 1, }"), good.replace(", }", ", 'descr': '<f4', }"),
        "", " ", "{}", "{" * 3000, "{'descr': " * 500, good + " " * 20000 + "x",
    ]
    kinds = []
    for v in variants:
        kinds.append(npy_bytes(None, None, data, header=v))
    blob = npy_bytes("<f4", (2, 128), data)
    kinds += [b"", b"\x93NUMP", b"\x93NUMPY\x03\x00" + blob[8:], b"\x93NUMPY\x01\x01" + blob[8:],
              blob[:8] + b"\xff\xff" + blob[10:], blob[:8] + b"\x00\x00" + blob[10:], blob[:20], blob[:-1],
              blob + b"\x00", npy_bytes("<f4", (2, 128), data, version=2),
              b"\x93NUMPY\x02\x00" + struct.pack("<I", 0xFFFFFFF0) + b"{}",
              npy_bytes("<f4", (2, 128), data, header=good + "\x00" * 10, pad=False)]
    i = 0
    while i < n:
        blob = kinds[i % len(kinds)]
        if i >= len(kinds):  # random byte edits inside the header region
            b = bytearray(blob)
            for _ in range(rng.integers(1, 4)):
                if len(b) > 10:
                    b[int(rng.integers(6, min(len(b), 140)))] = int(rng.integers(0, 256))
            blob = bytes(b)
        write(os.path.join(d, "h.npy"), blob)
        which = i % 4
        if which == 0:
            run("malformed-header", d, "quantize", "--layout", "row", "h.npy", "o")
        elif which == 1:
            run("malformed-header", d, "decode", "--format", "e4m3", "h.npy", "o.npy")
        elif which == 2:
            write(os.path.join(d, "s.codes.npy"), blob)
            write(os.path.join(d, "s.scales.npy"), npy_bytes("|u1", (1, 2), b"\x7f\x7f"))
            run("malformed-header", d, "dequantize", "--layout", "row", "s", "o.npy")
            os.remove(os.path.join(d, "s.codes.npy"))
            os.remove(os.path.join(d, "s.scales.npy"))
        else:
            run("malformed-header", d, "cast", "--format", "bf16", "h.npy", "o.npy")
        for f in os.listdir(d):  # a success may write o*; start the next run clean
            if f.startswith("o"):
                os.remove(os.path.join(d, f))
        i += 1


HOSTILE_DIMS = [0, 1, 2, 127, 128, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 2 ** 40, 2 ** 62, 2 ** 63 - 1]


def hostile_shapes(base, rng, n):
    d = fresh(base, "shape")
    for i in range(n):
        lay = LAYOUTS[i % 4]
        a, b = (int(HOSTILE_DIMS[rng.integers(len(HOSTILE_DIMS))]) for _ in range(2))
        if rng.random() < 0.7:  # header only: one dimension 0, the other anything
            if rng.random() < 0.5:
                a = 0
            else:
                b = 0
        cs = (a, b)
        numel = a * b
        cdata = bytes(numel) if numel <= 1 << 16 else b""
        write(os.path.join(d, "p.codes.npy"), npy_bytes("|u1", cs, cdata))
        sa, sb = (int(HOSTILE_DIMS[rng.integers(len(HOSTILE_DIMS))]) for _ in range(2))
        if rng.random() < 0.5:
            sa, sb = 0, b
        sdata = bytes(sa * sb) if sa * sb <= 1 << 16 else b""
        write(os.path.join(d, "p.scales.npy"), npy_bytes("|u1", (sa, sb), sdata))
        if lay == "col" and rng.random() < 0.5:
            segs = np.array([0, min(a, 2 ** 31 - 1)], dtype=np.int64).astype(np.int32)
            write(os.path.join(d, "p.segments.npy"), arr_bytes(segs))
        extra = []
        if rng.random() < 0.3:
            extra = ["--shape", "%d,%d" % (int(HOSTILE_DIMS[rng.integers(len(HOSTILE_DIMS))]),
                                           int(HOSTILE_DIMS[rng.integers(len(HOSTILE_DIMS))]))]
        for cmd in consumers(lay, "p", "o"):
            run("hostile-shape", d, *(cmd[:-2] + extra + cmd[-2:]))
        # a high-precision input with a hostile shape (header only)
        if i % 8 == 0:
            write(os.path.join(d, "h.npy"), npy_bytes("<f4", (a, 0) if rng.random() < 0.5 else (0, b)))
            run("hostile-shape", d, "quantize", "--layout", LAYOUTS[i % 4], "h.npy", "o")
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))


def inconsistent_sets(base, rng, sets, n):
    d = fresh(base, "set")
    other = {"row": "mxfp4", "col": "row", "weight": "col", "mxfp4": "weight"}
    edits = [
        lambda s, lay: s.update(scales=sets[other[lay]]["scales"]),
        lambda s, lay: s.update(codes=sets[other[lay]]["codes"]),
        lambda s, lay: s.pop("scales"),
        lambda s, lay: s.update(scales=arr_bytes(np.zeros((3, 5), np.uint8))),
        lambda s, lay: s.update(codes=arr_bytes(np.zeros((256, 256), np.float32))),
        lambda s, lay: s.update(codes=arr_bytes(np.zeros((256,), np.uint8))),
        lambda s, lay: s.update(scales=arr_bytes(np.full((1, 1), 255, np.uint8))),
        lambda s, lay: s.update(segments=arr_bytes(np.array([0, 300, 256], np.int32))),
        lambda s, lay: s.update(segments=arr_bytes(np.array([5, 256], np.int32))),
        lambda s, lay: s.update(segments=arr_bytes(np.array([0, 100, 256], np.float32))),
        lambda s, lay: s.update(segments=arr_bytes(np.zeros((2, 2), np.int32))),
        lambda s, lay: s.update(segments=arr_bytes(np.array([0, 2 ** 31 - 1], np.int32))),
        lambda s, lay: s.update(segments=arr_bytes(np.array([0] * 5000 + [256], np.int32))),
    ]
    opts = [[], ["--shape", "256,256"], ["--shape", "128,512"], ["--shape", "256,255"],
            ["--segments", "256"], ["--segments", "100,156"], ["--segments", "+256"], ["--shape", " 256,256"],
            ["--segments", "1,2,3"], ["--shape", "0,256"]]
    for i in range(n):
        lay = LAYOUTS[i % 4]
        s = dict(sets[lay])
        edits[int(rng.integers(len(edits)))](s, lay)
        put_set(d, "q", s)
        extra = opts[int(rng.integers(len(opts)))]
        cmds = consumers(lay, "q", "o")
        cmd = cmds[int(rng.integers(len(cmds)))]
        run("inconsistent-set", d, *(cmd[:-2] + extra + cmd[-2:]))
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))


def mutations(base, rng, sets, n):
    d = fresh(base, "mut")
    names = [(lay, suf) for lay in LAYOUTS for suf in sets[lay]] + [("input", "x")]
    for i in range(n):
        lay, suf = names[i % len(names)]
        blob = bytearray(sets[lay][suf])
        op = int(rng.integers(4))
        if op == 0:  # flip bytes anywhere
            for _ in range(int(rng.integers(1, 9))):
                blob[int(rng.integers(len(blob)))] ^= 1 << int(rng.integers(8))
        elif op == 1:  # bytes of the header region
            for _ in range(int(rng.integers(1, 4))):
                blob[int(rng.integers(min(len(blob), 128)))] = int(rng.integers(256))
        elif op == 2:  # truncate or extend
            blob = blob[:int(rng.integers(len(blob)))] if rng.random() < 0.5 else blob + bytes(int(rng.integers(1, 300)))
        else:  # random data bytes (scale codes 0xFF, 254, NaN codes, huge segment offsets)
            for _ in range(int(rng.integers(1, 33))):
                pos = int(rng.integers(128, len(blob))) if len(blob) > 128 else 0
                blob[pos] = int(rng.choice([0, 1, 0x7E, 0x7F, 0xFE, 0xFF, int(rng.integers(256))]))
        blob = bytes(blob)
        if lay == "input":
            write(os.path.join(d, "in.npy"), blob)
            q = LAYOUTS[i % 4]
            flags = ["--allow-nonfinite"] if rng.random() < 0.3 else []
            run("mutation", d, *(["quantize", "--layout", q] + flags + ["in.npy", "o"]))
        else:
            s = dict(sets[lay])
            s[suf] = blob
            put_set(d, "m", s)
            cmds = consumers(lay, "m", "o")
            cmd = cmds[int(rng.integers(len(cmds)))]
            if rng.random() < 0.2:
                cmd = cmd[:-2] + ["--allow-nonfinite"] + cmd[-2:] if cmd[0] != "dequantize" else cmd
            run("mutation", d, *cmd)
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))


def unwritable_outputs(base, rng, sets, n):
    """Output sets that cannot be written whole: an older set and the input must stay intact."""
    d = fresh(base, "out")
    for i in range(n):
        lay = LAYOUTS[i % 4]
        write(os.path.join(d, "x.npy"), sets["input"]["x"])
        put_set(d, "old", sets[lay])  # an existing set the run would replace
        case = i % 6
        if case == 0:
            prefix = "nodir/sub/o"
        elif case == 1:
            prefix = "o" * 245  # PREFIX.scales.npy is one byte too long for most file systems
        elif case == 2:  # a later file of the set is a directory: the set cannot be completed
            prefix = "old"
            suf = {"row": "segments", "col": "segments", "weight": "t.scales", "mxfp4": "segments"}[lay]
            p = os.path.join(d, "old.%s.npy" % suf)
            if os.path.exists(p):
                os.remove(p)
            os.makedirs(p)
        elif case == 3:
            prefix = "x.npy/o"  # a file used as a directory
        elif case == 4:
            prefix = "old.codes.npy/o"
        else:  # the first file of the set is a directory
            prefix = "old"
            p = os.path.join(d, "old.codes.npy")
            os.remove(p)
            os.makedirs(p)
        args = ["quantize", "--layout", lay]
        if lay == "col":
            args += ["--segments", "100,0,156"]
        run("unwritable-output", d, *(args + ["x.npy", prefix]))
        # the same with an in-place conversion of the old set (same prefix in and out)
        if case == 2:
            for cmd in consumers(lay, "old", "old")[1:]:
                run("unwritable-output", d, *cmd)
        for f in os.listdir(d):
            p = os.path.join(d, f)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def in_place_ok(base, rng, sets, n):
    """Same-prefix conversions that can be written: exit 0, the new set complete, no temporaries."""
    d = fresh(base, "inplace")
    for i in range(n):
        put_set(d, "r", sets["row" if i % 2 == 0 else "mxfp4"])
        cmd = ["transpose", "--method", "aware", "r", "r"] if i % 2 == 0 else ["fp4-to-fp8", "--to", "col", "r", "r"]
        rc = run("in-place", d, *cmd)
        names = sorted(os.listdir(d))
        if rc != 0 or names != ["r.codes.npy", "r.scales.npy", "r.segments.npy"]:
            FAILURES.append("in-place: %s: exit %s, files %s" % (" ".join(cmd), rc, names))
        else:
            rc2 = run("in-place", d, "dequantize", "--layout", "col", "r", "y.npy")
            if rc2 != 0:
                FAILURES.append("in-place: the replaced set does not read back as col (exit %s)" % rc2)
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))


def main():
    global FLOWMOE
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    FLOWMOE = os.path.abspath(args[0])
    seed, scale = 20, 1.0
    if "--seed" in args:
        seed = int(args[args.index("--seed") + 1])
    if "--scale" in args:
        scale = float(args[args.index("--scale") + 1])
    rng = np.random.default_rng(seed)
    random.seed(seed)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as base:
        sets = make_valid_sets(fresh(base, "valid"), rng)
        malformed_headers(base, rng, int(240 * scale))
        hostile_shapes(base, rng, int(120 * scale))
        inconsistent_sets(base, rng, sets, int(320 * scale))
        mutations(base, rng, sets, int(480 * scale))
        unwritable_outputs(base, rng, sets, int(60 * scale))
        in_place_ok(base, rng, sets, int(10 * scale))
    total = sum(COUNTS.values())
    print("fuzz: %d runs in %.1f s (seed %d): %s" % (
        total, time.time() - t0, seed, ", ".join("%s %d" % kv for kv in sorted(COUNTS.items()))))
    print("fuzz: exit status 0: %d, 1: %d, 2: %d; failures: %d" % (STATUS[0], STATUS[1], STATUS[2], len(FAILURES)))
    for f in FAILURES[:30]:
        print("FAIL " + f)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
