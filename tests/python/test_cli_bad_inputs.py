#!/usr/bin/env python3
"""The `flowmoe` file commands on the inputs a fuzz run found mishandled (issue 34).

usage: test_cli_bad_inputs.py PATH/TO/flowmoe

1. A rename that fails while an output set is committed (the old file is immutable): exit 1, a
   message naming the right file, the old set intact, no temporaries; under valgrind (when
   installed) no invalid read (OutputSet::commit read a freed path for its message).
2. Quantized sets whose code x scale is beyond float32 (scale code 0xFE under a large code): every
   command that reads such a set (dequantize, transpose aware/naive, fp4-to-fp8 row/col/col-stepwise)
   gives the same answer: exit 1 naming the overflow, nothing written; with --allow-nonfinite exit 0
   and 'overflow: 1'. Sets at scale 0xFE that stay finite still convert.
3. Inputs that are not regular files (a FIFO, a directory): refused at once with a message saying
   what they are, never a hang.
Needs numpy. Every run has a timeout.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

FLOWMOE = None
TIMEOUT_S = 20
PASSED = 0
FAILED = 0


def check(name, ok, detail=""):
    global PASSED, FAILED
    if ok:
        PASSED += 1
    else:
        FAILED += 1
        print("FAIL %s\n  %s" % (name, str(detail)[-1500:]))


def run(*args, prefix=(), cwd=None, timeout=TIMEOUT_S):
    try:
        p = subprocess.run(list(prefix) + [FLOWMOE] + [str(a) for a in args], capture_output=True,
                           text=True, errors="replace", timeout=timeout, cwd=cwd)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return "timeout", "", "timed out after %d s" % timeout


def listing(d):
    return sorted(os.listdir(d))


# ---- 1. a failed rename during commit ---------------------------------------------------------

def test_commit_rename_fails(tmp):
    d = os.path.join(tmp, "commit")
    os.makedirs(d)
    np.save(os.path.join(d, "x.npy"), np.ones((128, 256), np.float32))
    rc, _, err = run("quantize", "--layout", "row", "x.npy", d + "/o", cwd=d)
    check("commit: first quantize", rc == 0, err)
    locked = os.path.join(d, "o.scales.npy")
    with open(locked, "rb") as f:
        old = f.read()
    if subprocess.run(["chattr", "+i", locked], capture_output=True).returncode != 0:
        print("skip: chattr +i is not available here (needs root and a file system that supports it)")
        return
    try:
        before = listing(d)
        rc, _, err = run("quantize", "--layout", "row", "x.npy", d + "/o", cwd=d)
        check("commit: an immutable old file: exit 1, the message names it",
              rc == 1 and (locked + ": cannot replace it") in err, (rc, err))
        check("commit: the message is printable text (no bytes of freed memory)",
              all(c == "\n" or " " <= c <= "~" for c in err), repr(err))
        with open(locked, "rb") as f:
            check("commit: the old file is unchanged", f.read() == old)
        check("commit: no temporaries, nothing new", listing(d) == before, listing(d))
        if shutil.which("valgrind"):
            rc, _, err = run("quantize", "--layout", "row", "x.npy", d + "/o", cwd=d, timeout=300,
                             prefix=("valgrind", "-q", "--error-exitcode=99"))
            # (the dynamic loader of an rpath'd binary draws valgrind reports of its own, e.g.
            # strncmp in decompose_rpath: only errors with a frame in flowmoe's code count)
            vg = "\n".join(line for line in err.splitlines() if line.startswith("=="))
            ours = [blk for blk in re.split(r"==\d+== (?=Invalid|Conditional|Use of|Mismatched)", vg)[1:]
                    if re.search(r"flowmoe|output_set|/tools/|/src/", blk)]
            check("commit: under valgrind no invalid access in flowmoe's code (exit 1)",
                  rc in (1, 99) and not ours, (rc, ours[:2]))
        else:
            print("note: valgrind not installed; the memory check of the failed commit is skipped")
    finally:
        subprocess.run(["chattr", "-i", locked], capture_output=True)


# ---- 2. sets that decode beyond float32 --------------------------------------------------------

def row_set(d, name, big_code, scale=0xFE):
    codes = np.full((1, 128), 0x38, np.uint8)  # 1.0
    codes[0, 0] = big_code
    np.save(os.path.join(d, name + ".codes.npy"), codes)
    np.save(os.path.join(d, name + ".scales.npy"), np.full((1, 1), scale, np.uint8))


def mxfp4_set(d, name, big_nibble, scale=0xFE):
    nib = np.full(128, 2, np.uint8)  # 1.0
    nib[0] = big_nibble
    packed = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).reshape(1, 64)
    np.save(os.path.join(d, name + ".codes.npy"), packed)
    sc = np.full((1, 4), 127, np.uint8)
    sc[0, 0] = scale
    np.save(os.path.join(d, name + ".scales.npy"), sc)


def test_overflowing_scales(tmp):
    d = os.path.join(tmp, "fe")
    os.makedirs(d)
    row_set(d, "r", 0x40)      # 2.0 * 2^127 = Inf
    row_set(d, "rok", 0x38)    # 1.0 * 2^127: finite
    mxfp4_set(d, "m", 4)       # E2M1 2.0 * 2^127 = Inf
    mxfp4_set(d, "mok", 2)     # E2M1 1.0 * 2^127: finite
    cmds = [("dequantize", ["dequantize", "--layout", "row", "r", "y.npy"], ["y.npy"]),
            ("dequantize --bf16", ["dequantize", "--layout", "row", "--bf16", "r", "y.npy"], ["y.npy"]),
            ("dequantize mxfp4", ["dequantize", "--layout", "mxfp4", "m", "y.npy"], ["y.npy"]),
            ("transpose aware", ["transpose", "--method", "aware", "r", "o"], ["o.codes.npy"]),
            ("transpose aware column-amax",
             ["transpose", "--method", "aware", "--exponent", "column-amax", "r", "o"], ["o.codes.npy"]),
            ("transpose naive", ["transpose", "--method", "naive", "r", "o"], ["o.codes.npy"]),
            ("fp4-to-fp8 row", ["fp4-to-fp8", "--to", "row", "m", "o"], ["o.codes.npy"]),
            ("fp4-to-fp8 col", ["fp4-to-fp8", "--to", "col", "m", "o"], ["o.codes.npy"]),
            ("fp4-to-fp8 col-stepwise", ["fp4-to-fp8", "--to", "col-stepwise", "m", "o"], ["o.codes.npy"])]
    for name, cmd, outs in cmds:
        before = listing(d)
        rc, out, err = run(*cmd, cwd=d)
        check("0xFE scale, %s: exit 1, names the overflow, nothing written" % name,
              rc == 1 and "overflowed to Inf" in err and "0xFE" in err and listing(d) == before, (rc, out, err))
        allowed = cmd[:-2] + ["--allow-nonfinite"] + cmd[-2:]
        rc, out, err = run(*allowed, cwd=d)
        check("0xFE scale, %s --allow-nonfinite: exit 0, 'overflow: 1'" % name,
              rc == 0 and re.search(r"^overflow: 1$", out, re.M) is not None, (rc, out, err))
        if cmd[0] != "dequantize":
            check("0xFE scale, %s --allow-nonfinite: 'nonfinite: 1'" % name,
                  re.search(r"^nonfinite: 1$", out, re.M) is not None, out)
        for f in outs:
            if os.path.exists(os.path.join(d, f)):
                for g in [x for x in os.listdir(d) if x.startswith(f.split(".")[0] + ".")]:
                    os.remove(os.path.join(d, g))
    y = None
    rc, out, err = run("dequantize", "--layout", "row", "--allow-nonfinite", "r", "y.npy", cwd=d)
    if rc == 0:
        y = np.load(os.path.join(d, "y.npy"))
    check("dequantize --allow-nonfinite: the element decodes to +Inf, the others to 2^127",
          y is not None and np.isposinf(y[0, 0]) and np.all(y[0, 1:] == np.float32(2.0 ** 127)), y)
    # scale 0xFE whose values stay finite: not an error anywhere
    for cmd in (["dequantize", "--layout", "row", "rok", "y.npy"], ["transpose", "--method", "aware", "rok", "o"],
                ["transpose", "--method", "naive", "rok", "o"], ["dequantize", "--layout", "mxfp4", "mok", "y.npy"],
                ["fp4-to-fp8", "--to", "row", "mok", "o"], ["fp4-to-fp8", "--to", "col", "mok", "o"],
                ["fp4-to-fp8", "--to", "col-stepwise", "mok", "o"]):
        rc, out, err = run(*cmd, cwd=d)
        check("0xFE scale, finite values, %s: exit 0, no overflow line" % " ".join(cmd[:3]),
              rc == 0 and "overflow: 1" not in out, (rc, out, err))


# ---- 3. inputs that are not regular files ------------------------------------------------------

def test_non_regular_inputs(tmp):
    d = os.path.join(tmp, "fifo")
    os.makedirs(d)
    if not hasattr(os, "mkfifo"):
        print("skip: no mkfifo on this platform")
        return
    os.mkfifo(os.path.join(d, "f.npy"))
    os.mkdir(os.path.join(d, "dir.npy"))
    for name, cmd in (("quantize", ["quantize", "--layout", "row", "f.npy", "o"]),
                      ("cast", ["cast", "--format", "e4m3", "f.npy", "o.npy"]),
                      ("decode", ["decode", "--format", "e4m3", "f.npy", "o.npy"])):
        rc, _, err = run(*cmd, cwd=d, timeout=10)
        check("FIFO input to %s: exit 1 at once, says FIFO" % name, rc == 1 and "FIFO" in err, (rc, err))
    rc, _, err = run("quantize", "--layout", "row", "dir.npy", "o", cwd=d, timeout=10)
    check("directory input: exit 1, says directory", rc == 1 and "directory" in err, (rc, err))
    # a FIFO inside a quantized set: codes, scales, or col segments
    np.save(os.path.join(d, "x.npy"), np.ones((256, 256), np.float32))
    rc, _, err = run("quantize", "--layout", "col", "--segments", "100,156", "x.npy", "c", cwd=d)
    check("col set for the FIFO cases", rc == 0, err)
    for victim, layout in (("c.segments.npy", "col"), ("c.scales.npy", "col"), ("c.codes.npy", "col")):
        p = os.path.join(d, victim)
        saved = p + ".keep"
        os.rename(p, saved)
        os.mkfifo(p)
        rc, _, err = run("dequantize", "--layout", layout, "c", "y.npy", cwd=d, timeout=10)
        check("FIFO as %s: exit 1 at once, says FIFO, nothing written" % victim,
              rc == 1 and "FIFO" in err and not os.path.exists(os.path.join(d, "y.npy")), (rc, err))
        os.remove(p)
        os.rename(saved, p)
    rc, _, err = run("dequantize", "--layout", "col", "c", "y.npy", cwd=d)
    check("the restored col set still reads", rc == 0, err)


def main():
    global FLOWMOE
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    FLOWMOE = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        for t in (test_commit_rename_fails, test_overflowing_scales, test_non_regular_inputs):
            try:
                t(tmp)
            except Exception as e:  # a crash of the test itself is a failure, not an error
                check(t.__name__ + " ran to the end", False, repr(e))
    print("%d passed, %d failed" % (PASSED, FAILED))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
