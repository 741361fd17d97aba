#!/usr/bin/env python3
"""The `flowmoe` output sets under signals, concurrent readers and planted temporary names (issue 54).

usage: test_cli_set_safety.py PATH/TO/flowmoe

An LD_PRELOAD shim (compiled here with the system C compiler; flowmoe itself reads no environment
variable for this) makes each fault happen at a chosen point:
  SHIM_SIG=s SHIM_SIG_AT_RENAME=n   raise signal s just before the process's n-th rename(2)
  SHIM_SIG=s SHIM_SIG_AT_WRITE=n    raise signal s just before its n-th write(2)
  SHIM_PLANT=symlink|hardlink|fifo SHIM_VICTIM=path
                                    plant that at the name of the first temporary file flowmoe opens,
                                    just before it opens it (an attacker who guessed the random name)
  SHIM_OPEN_LOG=path                log the flags of every open of a '.flowmoe-' name
Checked:
  - SIGINT / SIGTERM / SIGHUP at every rename of a --layout both commit: the process ends by the
    signal, the set on disk is the old one or the new one whole, and no '.flowmoe-' file is left;
  - the same signals while the files are written: the old set is intact, nothing is left;
  - SIGKILL at every rename: readers refuse the set (exit 1, saying what to do); the next writer in the
    directory puts the old set back byte for byte and removes the leftovers; SIGKILL during the write:
    the next writer removes the killed process's temporaries;
  - `ulimit -f` (SIGXFSZ): exit 1 with a clear message without a source location, old set intact;
  - a reader racing a writer for a bounded number of rounds never gets a mixed set with exit 0, and
    a reader started while a writer is stopped (SIGSTOP) after its first rename waits for it;
  - a symlink, hard link or FIFO at the old predictable names and at the real (random) name is never
    written through or waited on; temporaries are opened with O_CREAT|O_EXCL|O_NOFOLLOW;
  - prefixes '', 'dir/', 'dir/.', 'dir/..' are refused for every layout, --layout both included;
  - a writer waiting on the directory lock says so after a second.
Needs numpy and a C compiler (cc / gcc).
"""
import fcntl
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import preload_shim

FLOWMOE = None
FAILED = []
LOCATION = re.compile(r"\[[\w./-]+\.(?:cpp|h|cu|cuh):\d+\]")

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int renames, writes, planted;

static int env_int(const char* var) { const char* s = getenv(var); return s ? atoi(s) : 0; }

int rename(const char* from, const char* to) {
  static int (*real)(const char*, const char*);
  if (!real) real = (int (*)(const char*, const char*))dlsym(RTLD_NEXT, "rename");
  if (++renames == env_int("SHIM_SIG_AT_RENAME")) raise(env_int("SHIM_SIG"));
  return real(from, to);
}

ssize_t write(int fd, const void* buf, size_t n) {
  static ssize_t (*real)(int, const void*, size_t);
  if (!real) real = (ssize_t (*)(int, const void*, size_t))dlsym(RTLD_NEXT, "write");
  if (fd > 2 && ++writes == env_int("SHIM_SIG_AT_WRITE")) raise(env_int("SHIM_SIG"));
  return real(fd, buf, n);
}

static void before_open(const char* path, int flags) {
  if (!strstr(path, "/.flowmoe-")) return;
  const char* log = getenv("SHIM_OPEN_LOG");
  if (log) {
    FILE* f = fopen(log, "a");
    if (f) {
      fprintf(f, "%s creat=%d excl=%d nofollow=%d\n", path, !!(flags & O_CREAT), !!(flags & O_EXCL),
              !!(flags & O_NOFOLLOW));
      fclose(f);
    }
  }
  const char* plant = getenv("SHIM_PLANT");
  const size_t len = strlen(path);
  if (!plant || planted || len < 4 || strcmp(path + len - 4, ".tmp") != 0) return;
  planted = 1;
  const char* victim = getenv("SHIM_VICTIM");
  if (!strcmp(plant, "symlink")) symlink(victim, path);
  else if (!strcmp(plant, "hardlink")) link(victim, path);
  else if (!strcmp(plant, "fifo")) mkfifo(path, 0666);
}

#define OPEN_WRAPPER(name)                                                   \
  int name(const char* path, int flags, ...) {                               \
    static int (*real)(const char*, int, ...);                               \
    if (!real) real = (int (*)(const char*, int, ...))dlsym(RTLD_NEXT, #name); \
    mode_t mode = 0;                                                         \
    if (flags & O_CREAT) {                                                   \
      va_list ap;                                                            \
      va_start(ap, flags);                                                   \
      mode = va_arg(ap, int);                                                \
      va_end(ap);                                                            \
    }                                                                        \
    before_open(path, flags);                                                \
    return real(path, flags, mode);                                          \
  }
OPEN_WRAPPER(open)
OPEN_WRAPPER(open64)
"""


def check(cond, what):
    if not cond:
        FAILED.append(what)
        print("FAIL:", what)


def run(args, env=None, timeout=20, preexec_fn=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([FLOWMOE] + args, capture_output=True, text=True, errors="replace", timeout=timeout,
                          env=e, preexec_fn=preexec_fn)


def snapshot(d):
    """The files of d by name, but flowmoe's own temporaries (leftovers() lists those)."""
    return {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)
            if os.path.isfile(os.path.join(d, n)) and not n.startswith(".flowmoe-")}


def leftovers(d):
    return [n for n in os.listdir(d) if n.startswith(".flowmoe-")]


def build_shim(tmp):
    return preload_shim.build_shim(tmp, SHIM_C, "test_cli_set_safety.py")


def inputs(tmp, shape=(256, 512)):
    a, b = os.path.join(tmp, "A.npy"), os.path.join(tmp, "B.npy")
    np.save(a, np.random.default_rng(1).standard_normal(shape).astype(np.float32))
    np.save(b, np.random.default_rng(2).standard_normal(shape).astype(np.float32) * 3)
    return a, b


def fresh_dir(tmp, name, first_input, layout="both"):
    d = os.path.join(tmp, name)
    os.mkdir(d)
    r = run(["quantize", "--layout", layout, first_input, os.path.join(d, "p")])
    check(r.returncode == 0, f"{name}: the first set ({r.stderr.strip()})")
    return d


def test_handled_signals(tmp, shim, a, b):
    new_dir = fresh_dir(tmp, "ref_new", b)
    new = snapshot(new_dir)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        for n in range(1, 11):  # --layout both: 5 files, up to 10 renames
            d = fresh_dir(tmp, f"sig{int(sig)}_{n}", a)
            old = snapshot(d)
            r = run(["quantize", "--layout", "both", b, os.path.join(d, "p")],
                    {"LD_PRELOAD": shim, "SHIM_SIG": str(int(sig)), "SHIM_SIG_AT_RENAME": str(n)})
            got = snapshot(d)
            check(r.returncode == -sig, f"{sig.name} at rename {n}: ended by the signal (rc {r.returncode})")
            check(got in (old, new), f"{sig.name} at rename {n}: the set is the old or the new one whole")
            check(not leftovers(d), f"{sig.name} at rename {n}: nothing left ({leftovers(d)})")
        for n in (1, 3, 6):  # while the temporaries are written (header and data writes of 5 files)
            d = fresh_dir(tmp, f"sigw{int(sig)}_{n}", a)
            old = snapshot(d)
            r = run(["quantize", "--layout", "both", b, os.path.join(d, "p")],
                    {"LD_PRELOAD": shim, "SHIM_SIG": str(int(sig)), "SHIM_SIG_AT_WRITE": str(n)})
            check(r.returncode == -sig and snapshot(d) == old and not leftovers(d),
                  f"{sig.name} at write {n}: old set intact, nothing left (rc {r.returncode}, {leftovers(d)})")


def test_sigkill(tmp, shim, a, b):
    for n in range(1, 11):
        d = fresh_dir(tmp, f"kill{n}", a)
        old = snapshot(d)
        r = run(["quantize", "--layout", "both", b, os.path.join(d, "p")],
                {"LD_PRELOAD": shim, "SHIM_SIG": str(int(signal.SIGKILL)), "SHIM_SIG_AT_RENAME": str(n)})
        check(r.returncode == -signal.SIGKILL, f"SIGKILL at rename {n}: killed")
        if n > 1:  # from the first rename on the set on disk may be mixed: readers refuse it
            for layout, pre in (("row", "p.row"), ("col", "p.col")):
                r = run(["dequantize", "--layout", layout, os.path.join(d, pre), os.path.join(tmp, "y.npy")])
                check(r.returncode == 1 and "was stopped while replacing" in r.stderr
                      and "run the interrupted command again" in r.stderr,
                      f"SIGKILL at rename {n}: dequantize --layout {layout} refuses the torn set ({r.stderr.strip()})")
                check(not LOCATION.search(r.stderr), "the torn-set error carries no source location")
        # the next writer in the directory (another prefix) puts the old set back and cleans up
        r = run(["quantize", "--layout", "row", a, os.path.join(d, "other")])
        check(r.returncode == 0, f"SIGKILL at rename {n}: the next writer runs ({r.stderr.strip()})")
        got = {k: v for k, v in snapshot(d).items() if not k.startswith("other.")}
        check(got == old, f"SIGKILL at rename {n}: the old set is back byte for byte ({sorted(got)})")
        check(not leftovers(d), f"SIGKILL at rename {n}: no leftovers after the next run ({leftovers(d)})")
        r = run(["dequantize", "--layout", "row", os.path.join(d, "p.row"), os.path.join(tmp, "y.npy")])
        check(r.returncode == 0, f"SIGKILL at rename {n}: the old set reads again")
    d = fresh_dir(tmp, "killw", a)
    old = snapshot(d)
    r = run(["quantize", "--layout", "both", b, os.path.join(d, "p")],
            {"LD_PRELOAD": shim, "SHIM_SIG": str(int(signal.SIGKILL)), "SHIM_SIG_AT_WRITE": "3"})
    check(r.returncode == -signal.SIGKILL and snapshot(d) == old, "SIGKILL while writing: old set intact")
    check(len(leftovers(d)) >= 1, "SIGKILL while writing leaves its temporaries (nothing can remove them then)")
    r = run(["quantize", "--layout", "row", a, os.path.join(d, "other")])
    check(r.returncode == 0 and "removed" in r.stderr and not leftovers(d),
          f"the next writer removes a killed writer's temporaries and says so ({r.stderr.strip()})")


def test_file_size_limit(tmp, a, b):
    d = fresh_dir(tmp, "fsize", a)
    old = snapshot(d)

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    r = run(["quantize", "--layout", "both", b, os.path.join(d, "p")], preexec_fn=limit)
    check(r.returncode == 1 and "ulimit -f" in r.stderr and "nothing" in r.stderr,
          f"ulimit -f: a clear error ({r.stderr.strip()})")
    check(not LOCATION.search(r.stderr), f"ulimit -f: no source location without --debug ({r.stderr.strip()})")
    check(snapshot(d) == old and not leftovers(d), "ulimit -f: the old set is intact, nothing left")
    r = run(["quantize", "--layout", "both", "--debug", b, os.path.join(d, "p")], preexec_fn=limit)
    check(r.returncode == 1 and LOCATION.search(r.stderr), f"--debug adds the location ({r.stderr.strip()})")


def test_reader_races_writer(tmp, a, b, rounds=150):
    d = os.path.join(tmp, "race")
    os.mkdir(d)
    want = []
    for i, src in enumerate((a, b)):
        ref = os.path.join(tmp, f"race_ref{i}")
        run(["quantize", "--layout", "row", src, ref])
        run(["dequantize", "--layout", "row", ref, ref + ".y.npy"])
        want.append(np.load(ref + ".y.npy"))
    prefix = os.path.join(d, "p")
    run(["quantize", "--layout", "row", a, prefix])
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            for src in (a, b):
                subprocess.run([FLOWMOE, "quantize", "--layout", "row", src, prefix], capture_output=True)

    t = threading.Thread(target=writer)
    t.start()
    mixed = failed = 0
    y = os.path.join(tmp, "race_y.npy")
    try:
        for _ in range(rounds):
            r = run(["dequantize", "--layout", "row", prefix, y])
            if r.returncode != 0:
                failed += 1
                continue
            got = np.load(y)
            if not any(np.array_equal(got, w) for w in want):
                mixed += 1
    finally:
        stop.set()
        t.join()
    check(mixed == 0, f"reader vs writer: {mixed} of {rounds} reads returned a mixed set with exit 0")
    check(failed == 0, f"reader vs writer: {failed} of {rounds} reads failed")
    check(not leftovers(d), "reader vs writer: nothing left")


def test_reader_waits_for_a_stopped_writer(tmp, shim, a, b):
    """Deterministic form of the race: the writer is stopped (SIGSTOP) after its first rename, in the
    middle of its commit; a reader must wait for it, not read the half-replaced set."""
    d = fresh_dir(tmp, "stopped", a, layout="row")
    prefix = os.path.join(d, "p")
    ref = os.path.join(tmp, "stopped_ref")
    run(["quantize", "--layout", "row", b, ref])
    run(["dequantize", "--layout", "row", ref, ref + ".y.npy"])
    w = subprocess.Popen([FLOWMOE, "quantize", "--layout", "row", b, prefix], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL,
                         env=dict(os.environ, LD_PRELOAD=shim, SHIM_SIG=str(int(signal.SIGSTOP)), SHIM_SIG_AT_RENAME="2"))
    try:
        for _ in range(500):  # until it is stopped (state T in /proc/PID/stat)
            if open(f"/proc/{w.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T":
                break
            time.sleep(0.01)
        y = os.path.join(tmp, "stopped_y.npy")
        r = subprocess.Popen([FLOWMOE, "dequantize", "--layout", "row", prefix, y], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        time.sleep(1.4)
        check(r.poll() is None, "a reader waits while a writer is stopped in the middle of its commit")
    finally:
        w.send_signal(signal.SIGCONT)
        w.wait(timeout=20)
    err = r.communicate(timeout=20)[1]
    check(r.returncode == 0 and np.array_equal(np.load(y), np.load(ref + ".y.npy")),
          f"the reader then reads the new set whole ({err.strip()})")
    check("waiting for another flowmoe process writing" in err, f"the reader said it was waiting ({err.strip()})")


def test_plants(tmp, shim, a):
    d = os.path.join(tmp, "plant")
    os.mkdir(d)
    victim = os.path.join(tmp, "victim.txt")
    with open(victim, "w") as f:
        f.write("precious\n")
    prefix = os.path.join(d, "p")
    # the old predictable names .flowmoe-PID-N.tmp / .old, planted by the process that then execs flowmoe
    script = ('for i in 0 1 2 3 4 5 6 7 8 9; do ln -s "$VICTIM" "$D/.flowmoe-$$-$i.tmp"; '
              'ln -s "$VICTIM" "$D/.flowmoe-$$-$i.old"; done; exec "$FLOWMOE" quantize --layout both "$A" "$P"')
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=20,
                       env=dict(os.environ, VICTIM=victim, D=d, FLOWMOE=FLOWMOE, A=a, P=prefix))
    check(r.returncode == 0, f"plants at the old names: quantize succeeds ({r.stderr.strip()})")
    check(open(victim).read() == "precious\n", "plants at the old names: the victim is untouched")
    check(os.path.isfile(prefix + ".row.codes.npy") and not os.path.islink(prefix + ".row.codes.npy"),
          "plants at the old names: the output is a regular file")
    for plant in ("symlink", "hardlink", "fifo"):
        log = os.path.join(tmp, f"open_{plant}.log")
        try:
            r = run(["quantize", "--layout", "row", a, prefix],
                    {"LD_PRELOAD": shim, "SHIM_PLANT": plant, "SHIM_VICTIM": victim, "SHIM_OPEN_LOG": log}, timeout=15)
        except subprocess.TimeoutExpired:
            check(False, f"a {plant} at the temporary's own name: quantize hangs")
            continue
        check(r.returncode == 0, f"a {plant} at the temporary's own name: quantize succeeds ({r.stderr.strip()})")
        check(open(victim).read() == "precious\n", f"a {plant} at the temporary's own name: the victim is untouched")
        check(not os.path.islink(prefix + ".codes.npy") and os.stat(prefix + ".codes.npy").st_nlink == 1,
              f"a {plant} at the temporary's own name: the output is a file of its own")
        lines = open(log).read().splitlines() if os.path.exists(log) else []
        tmp_opens = [ln for ln in lines if ".tmp " in ln]
        check(len(tmp_opens) >= 3, f"{plant}: the planted name was refused and another drawn ({lines})")
        check(all("creat=1 excl=1 nofollow=1" in ln for ln in lines),
              f"temporaries are opened with O_CREAT|O_EXCL|O_NOFOLLOW ({lines})")
        names = [os.path.basename(ln.split()[0]) for ln in tmp_opens]
        check(all(re.fullmatch(r"\.flowmoe-\d+-[0-9a-f]{16}\.tmp", n) for n in names),
              f"temporary names carry 16 random hex digits ({names})")
        for n in leftovers(d):  # the planted thing (of a process still named by our pid) is left alone
            os.unlink(os.path.join(d, n))


def test_prefixes(tmp, a):
    d = os.path.join(tmp, "prefixes")
    os.mkdir(d)
    for layout in ("row", "col", "both", "weight", "mxfp4"):
        for prefix in ("", d + "/", d + "/.", d + "/.."):
            r = run(["quantize", "--layout", layout, a, prefix])
            check(r.returncode == 1 and "names no file" in r.stderr and "expected a prefix" in r.stderr,
                  f"--layout {layout} prefix {prefix!r} refused ({r.stderr.strip()})")
            check(not LOCATION.search(r.stderr), "the prefix error carries no source location")
    check(os.listdir(d) == [] and not [n for n in os.listdir(tmp) if n.startswith(".")],
          f"no hidden files written ({os.listdir(d)})")
    src = os.path.join(d, "src")
    run(["quantize", "--layout", "row", a, src])
    r = run(["transpose", "--method", "aware", src, d + "/"])
    check(r.returncode == 1 and "names no file" in r.stderr, f"transpose to 'dir/' refused ({r.stderr.strip()})")
    r = run(["quantize", "--layout", "row", a, os.path.join(d, ".flowmoe-1-x")])
    check(r.returncode == 1 and ".flowmoe-" in r.stderr, "a prefix in flowmoe's own name space is refused")


def test_lock_wait_message(tmp, a):
    d = os.path.join(tmp, "lockwait")
    os.mkdir(d)
    fd = os.open(d, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    p = subprocess.Popen([FLOWMOE, "quantize", "--layout", "row", a, os.path.join(d, "p")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.6)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    out, err = p.communicate(timeout=20)
    check(p.returncode == 0 and "waiting for another flowmoe process" in err,
          f"a writer waiting on the lock says so ({err.strip()})")
    check(err.count("\n") == 1, f"one line ({err!r})")


def main():
    global FLOWMOE
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    FLOWMOE = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_shim(tmp)
        a, b = inputs(tmp)
        test_prefixes(tmp, a)
        test_lock_wait_message(tmp, a)
        test_plants(tmp, shim, a)
        test_file_size_limit(tmp, a, b)
        test_handled_signals(tmp, shim, a, b)
        test_sigkill(tmp, shim, a, b)
        test_reader_waits_for_a_stopped_writer(tmp, shim, a, b)
        test_reader_races_writer(tmp, a, b)
    if FAILED:
        print(f"{len(FAILED)} check(s) failed")
        return 1
    print("all set-safety checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
