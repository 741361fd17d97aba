#!/usr/bin/env python3
"""The `flowmoe` file commands' output sets under races and faults (issue 44's fuzz findings D1-D4).

usage: test_cli_output_set.py PATH/TO/flowmoe

The races are made deterministic with an LD_PRELOAD shim (compiled here with the system C
compiler) that wraps rename(2): SHIM_FAIL_RENAME=i,j fails the i-th and j-th rename of the process
with EACCES (a directory that turns read-only in the middle of a commit), SHIM_DIR_AT_RENAME=i turns
the i-th rename's source into a directory first (a directory appearing at an output name). Checked:
  - D1: a failed commit puts the old set back and says "nothing was written"; when the rollback
    itself fails, the message says so (and never "nothing was written");
  - D2: two processes writing the same prefix at once: both succeed and the set on disk is one
    writer's whole set, with no hidden files left;
  - D3: a directory at an output name is refused and left in place, not moved to a hidden name;
  - D4: a FIFO input (no writer) is refused at once, without hanging;
  - an output prefix naming no file is refused; dequantize prints a 'nonfinite: N' line.
Needs numpy and a C compiler (cc / gcc).
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

import preload_shim

FLOWMOE = None
FAILED = []

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int calls;

static int listed(const char* var, int n) {
  const char* s = getenv(var);
  char all[512], key[32];
  if (!s) return 0;
  snprintf(all, sizeof all, ",%s,", s);
  snprintf(key, sizeof key, ",%d,", n);
  return strstr(all, key) != NULL;
}

int rename(const char* from, const char* to) {
  static int (*real)(const char*, const char*);
  if (!real) real = (int (*)(const char*, const char*))dlsym(RTLD_NEXT, "rename");
  const int n = ++calls;
  if (listed("SHIM_FAIL_RENAME", n)) {
    errno = EACCES;
    return -1;
  }
  if (listed("SHIM_DIR_AT_RENAME", n)) {
    char inside[4096];
    unlink(from);
    mkdir(from, 0755);
    snprintf(inside, sizeof inside, "%s/kept", from);
    FILE* f = fopen(inside, "w");
    if (f) fclose(f);
  }
  return real(from, to);
}
"""


def check(cond, what):
    if not cond:
        FAILED.append(what)
        print("FAIL:", what)


def run(args, env=None, timeout=20):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([FLOWMOE] + args, capture_output=True, text=True, errors="replace", timeout=timeout, env=e)


def listing(d):
    return sorted(os.listdir(d))


def snapshot(d):
    out = {}
    for name in os.listdir(d):
        p = os.path.join(d, name)
        out[name] = open(p, "rb").read() if os.path.isfile(p) else "<dir>"
    return out


def build_shim(tmp):
    return preload_shim.build_shim(tmp, SHIM_C, "test_cli_output_set.py")


def test_rollback(tmp, shim):
    d = os.path.join(tmp, "d1")
    os.mkdir(d)
    a, b = os.path.join(tmp, "a.npy"), os.path.join(tmp, "b.npy")
    np.save(a, np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32))
    np.save(b, np.random.default_rng(2).standard_normal((64, 256)).astype(np.float32))
    prefix = os.path.join(d, "p")
    r = run(["quantize", "--layout", "row", a, prefix])
    check(r.returncode == 0, f"D1: the first set is written ({r.stderr.strip()})")
    old = snapshot(d)
    # renames of the second commit: 1 codes aside, 2 new codes in, 3 scales aside, 4 new scales in;
    # the rollback's: 5 old scales back, 6 old codes back
    r = run(["quantize", "--layout", "row", b, prefix], {"LD_PRELOAD": shim, "SHIM_FAIL_RENAME": "4"})
    check(r.returncode == 1 and "nothing was written" in r.stderr, f"D1: failed commit reported ({r.stderr.strip()})")
    check(snapshot(d) == old, "D1: the old set is back, byte for byte, with no hidden files")
    r = run(["quantize", "--layout", "row", b, prefix], {"LD_PRELOAD": shim, "SHIM_FAIL_RENAME": "4,6"})
    check(r.returncode == 1, "D1: a failed rollback still fails the command")
    check("rollback failed" in r.stderr and "nothing was written" not in r.stderr,
          f"D1: a failed rollback says so ({r.stderr.strip()})")


def test_concurrent_writers(tmp, rounds=120):
    d = os.path.join(tmp, "d2")
    os.mkdir(d)
    ins, wants = [], []
    for i in range(2):
        p = os.path.join(tmp, f"in{i}.npy")
        np.save(p, np.random.default_rng(10 + i).standard_normal((256, 512)).astype(np.float32))
        ins.append(p)
        ref = os.path.join(tmp, f"ref{i}")
        check(run(["quantize", "--layout", "both", p, ref]).returncode == 0, "D2: reference set")
        wants.append({s: open(ref + s, "rb").read() for s in
                      (".row.codes.npy", ".row.scales.npy", ".col.codes.npy", ".col.scales.npy")})
    prefix = os.path.join(d, "p")
    bad = 0
    for _ in range(rounds):
        procs = [subprocess.Popen([FLOWMOE, "quantize", "--layout", "both", p, prefix], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE) for p in ins]
        codes = [p.wait(timeout=30) for p in procs]
        got = {s: open(prefix + s, "rb").read() if os.path.exists(prefix + s) else None for s in wants[0]}
        whole = got == wants[0] or got == wants[1]
        hidden = [n for n in os.listdir(d) if n.startswith(".")]
        if codes != [0, 0] or not whole or hidden:
            bad += 1
    check(bad == 0, f"D2: {bad} of {rounds} rounds of two writers left a mixed or partial set, hidden files or "
                    "a failure")


def test_directory_at_an_output_name(tmp, shim):
    d = os.path.join(tmp, "d3")
    os.mkdir(d)
    a = os.path.join(tmp, "a3.npy")
    np.save(a, np.ones((64, 256), np.float32))
    prefix = os.path.join(d, "p")
    check(run(["quantize", "--layout", "row", a, prefix]).returncode == 0, "D3: the first set")
    # rename 1 moves p.codes.npy aside: the shim first replaces it by a directory holding a file
    r = run(["quantize", "--layout", "row", a, prefix], {"LD_PRELOAD": shim, "SHIM_DIR_AT_RENAME": "1"})
    check(r.returncode == 1 and "not a regular file" in r.stderr, f"D3: refused ({r.stderr.strip()})")
    check(os.path.isdir(prefix + ".codes.npy") and os.path.exists(prefix + ".codes.npy/kept"),
          "D3: the directory is left in place with its contents")
    check(not [n for n in os.listdir(d) if n.startswith(".")], f"D3: no hidden files left ({listing(d)})")


def test_fifo_input(tmp):
    fifo = os.path.join(tmp, "in.fifo")
    os.mkfifo(fifo)
    r = run(["quantize", "--layout", "row", fifo, os.path.join(tmp, "f")], timeout=10)
    check(r.returncode == 1 and "FIFO" in r.stderr, f"D4: a FIFO input is refused at once ({r.stderr.strip()})")


def test_prefix_and_dequantize_count(tmp):
    a = os.path.join(tmp, "a5.npy")
    np.save(a, np.ones((64, 256), np.float32))
    d = os.path.join(tmp, "d5")
    os.mkdir(d)
    for prefix in ("", d + "/"):
        r = run(["quantize", "--layout", "row", a, prefix])
        check(r.returncode != 0 and "names no file" in r.stderr, f"prefix {prefix!r} refused ({r.stderr.strip()})")
    check(listing(d) == [], "no hidden files written for a prefix naming no file")
    prefix = os.path.join(d, "q")
    check(run(["quantize", "--layout", "row", a, prefix]).returncode == 0, "a set to decode")
    scales = np.load(prefix + ".scales.npy")
    scales.flat[0] = 0xFF  # a NaN-marked tile
    np.save(prefix + ".scales.npy", scales)
    r = run(["dequantize", "--layout", "row", prefix, os.path.join(tmp, "y.npy")])
    check(r.returncode == 0 and "nonfinite: 128" in r.stdout, f"dequantize counts the NaN tile ({r.stdout.strip()})")


def main():
    global FLOWMOE
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    FLOWMOE = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_shim(tmp)
        test_rollback(tmp, shim)
        test_concurrent_writers(tmp)
        test_directory_at_an_output_name(tmp, shim)
        test_fifo_input(tmp)
        test_prefix_and_dequantize_count(tmp)
    if FAILED:
        print(f"{len(FAILED)} check(s) failed")
        return 1
    print("all output-set checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
