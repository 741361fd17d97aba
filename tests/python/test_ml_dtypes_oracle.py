#!/usr/bin/env python3
"""Checks the flowmoe codecs bit for bit against an independent oracle: ml_dtypes.

usage: test_ml_dtypes_oracle.py PATH/TO/flowmoe

Runs `flowmoe cast` and `flowmoe decode` (element-wise, no scaling) on .npy files and compares
with ml_dtypes:
  * e4m3 cast of all 65,536 bf16 bit patterns and of 1e6 random float32 values of many
    magnitudes: saturating RNE == np.clip(x, -448, 448).astype(float8_e4m3fn) for non-NaN x
    (clipping first turns ml_dtypes' overflow-to-NaN into saturation); NaN -> code & 0x7F == 0x7F
  * e2m1 cast, the same with float4_e2m1fn and +-6; one code per byte in the low nibble (ml_dtypes
    stores a float4 in the low nibble of a byte, too). E2M1 has no NaN: flowmoe saturates NaN to
    +-6 with the input's sign (documented behaviour, checked here; ml_dtypes is not consulted)
  * decode of all 256 e4m3 codes, 16 e2m1 codes and 256 ue8m0 codes (float8_e8m0fnu) to float32
  * bf16 cast of random float32 values vs astype(ml_dtypes.bfloat16); decode of all bf16 patterns
Prints '<N> passed, <M> failed' and exits non-zero on any failure.
"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import ml_dtypes
except ImportError as e:  # CI installs them (requirements-test.txt)
    print(f"test_ml_dtypes_oracle: cannot import numpy/ml_dtypes ({e}); "
          "install them with: python3 -m pip install -r requirements-test.txt")
    sys.exit(1)


class Runner:
    def __init__(self, cli, tmp):
        self.cli = cli
        self.tmp = tmp
        self.passed = 0
        self.failed = 0
        self.n = 0

    def _flowmoe(self, cmd, fmt, arr):
        self.n += 1
        src = os.path.join(self.tmp, f"in{self.n}.npy")
        dst = os.path.join(self.tmp, f"out{self.n}.npy")
        np.save(src, arr)
        r = subprocess.run([self.cli, cmd, "--format", fmt, src, dst], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"flowmoe {cmd} --format {fmt} failed with exit {r.returncode}:\n"
                               f"{r.stdout}{r.stderr}")
        out = np.load(dst)
        if out.shape != arr.shape:
            raise RuntimeError(f"flowmoe {cmd}: output shape {out.shape} != input shape {arr.shape}")
        return out

    def cast(self, fmt, arr):
        return self._flowmoe("cast", fmt, arr)

    def decode(self, fmt, arr):
        return self._flowmoe("decode", fmt, arr)

    def check(self, name, ok, inputs=None, got=None, want=None):
        """ok: boolean array (one per element) or bool."""
        ok = np.asarray(ok)
        bad = np.flatnonzero(~ok)
        if bad.size == 0:
            self.passed += 1
            print(f"ok    {name} ({ok.size} values)")
            return
        self.failed += 1
        print(f"FAIL  {name}: {bad.size} of {ok.size} values differ")
        for i in bad[:8]:
            parts = []
            for label, a in (("input", inputs), ("got", got), ("want", want)):
                if a is not None:
                    parts.append(f"{label} {_show(a.reshape(-1)[i])}")
            print("        at", i, ", ".join(parts))

    def run_checked(self, name, fn):
        try:
            fn()
        except Exception as e:  # a CLI failure counts as a failed check, the others still run
            self.failed += 1
            print(f"FAIL  {name}: {e}")


def _show(v):
    if isinstance(v, np.floating):
        bits = np.array(v, dtype=np.float32).view(np.uint32)
        return f"{float(v)!r} (bits 0x{int(bits):08x})"
    if isinstance(v, np.integer):
        return f"0x{int(v):02x}"
    return repr(v)


def f32_bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def same_f32(got, want):
    """Element-wise: both NaN, or identical bits (so -0 != +0)."""
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    return (np.isnan(got) & np.isnan(want)) | (f32_bits(got) == f32_bits(want))


def all_bf16_patterns():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    values = (bits.astype(np.uint32) << 16).view(np.float32)
    return bits, values


def many_magnitudes(n, seed):
    """Random float32: sign * 2^U(-30, 12), plus a quarter of arbitrary bit patterns."""
    rng = np.random.default_rng(seed)
    x = (rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(-30.0, 12.0, n))).astype(np.float32)
    k = n // 4
    x[:k] = rng.integers(0, 2**32, k, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return x


# ---- the oracle --------------------------------------------------------------------------------
def oracle_cast(x, fmt):
    """Saturating RNE cast of non-NaN float32 x: clip to the format's max, then ml_dtypes' RNE."""
    dtype, fmax = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e2m1": (ml_dtypes.float4_e2m1fn, 6.0)}[fmt]
    with np.errstate(invalid="ignore"):
        codes = np.clip(x, -fmax, fmax).astype(dtype).view(np.uint8)
    return codes & 0x0F if fmt == "e2m1" else codes


def run_cast_checks(r, fmt, inputs, x, label):
    """inputs: what is sent to the CLI (float32 or uint16 bf16 bits); x: their float32 values."""
    got = r.cast(fmt, inputs)
    r.check(f"cast {fmt} {label}: dtype uint8", got.dtype == np.uint8)
    nan = np.isnan(x)
    want = oracle_cast(np.where(nan, 0, x).astype(np.float32), fmt)
    sign = np.signbit(x)
    if fmt == "e4m3":
        ok = np.where(nan, (got & 0x7F) == 0x7F, got == want)
    else:
        # one code per byte, low nibble; NaN saturates to +-6 keeping the sign (E2M1 has no NaN)
        nan_code = np.where(sign, 0xF, 0x7).astype(np.uint8)
        ok = (got >> 4 == 0) & np.where(nan, got == nan_code, got == want)
    r.check(f"cast {fmt} {label} vs ml_dtypes (clip, then astype)", ok, x, got, np.where(nan, 0x7F, want))


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    cli = sys.argv[1]
    if not os.path.exists(cli):
        print(f"test_ml_dtypes_oracle: flowmoe CLI not found at {cli}")
        return 1
    print(f"numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}, cli {cli}")

    with tempfile.TemporaryDirectory(prefix="flowmoe_oracle_") as tmp:
        r = Runner(cli, tmp)
        bits, values = all_bf16_patterns()
        rand = many_magnitudes(1_000_000, 20250101)

        # ---- casts to e4m3 / e2m1 ----
        for fmt in ("e4m3", "e2m1"):
            r.run_checked(f"cast {fmt} all bf16",
                          lambda fmt=fmt: run_cast_checks(r, fmt, bits, values, "all 65536 bf16 patterns"))
            r.run_checked(f"cast {fmt} random float32",
                          lambda fmt=fmt: run_cast_checks(r, fmt, rand, rand, "1e6 random float32"))

        # special values named one by one
        def specials():
            x = np.array([0.0, -0.0, np.inf, -np.inf, 448.0, -448.0, 464.0, 480.0, 1e30, 2.0**-10,
                          3 * 2.0**-10, 2.0**-9, -(2.0**-11), 6.0, 7.0, 0.25, 0.75, 2.5, 5.0], dtype=np.float32)
            run_cast_checks(r, "e4m3", x, x, "special values")
            run_cast_checks(r, "e2m1", x, x, "special values")
            got = r.cast("e4m3", np.array([np.nan, -np.nan], dtype=np.float32))
            r.check("cast e4m3 NaN -> 0x7F, -NaN -> 0xFF", got == np.array([0x7F, 0xFF], dtype=np.uint8))
        r.run_checked("special values", specials)

        # ---- decode ----
        def decodes():
            c8 = np.arange(256, dtype=np.uint16).astype(np.uint8)
            got = r.decode("e4m3", c8)
            want = c8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
            r.check("decode e4m3: all 256 codes vs float8_e4m3fn", same_f32(got, want), c8, got, want)
            r.check("decode e4m3: NaN exactly at 0x7F and 0xFF",
                    np.isnan(got) == np.isin(c8, [0x7F, 0xFF]))

            c4 = np.arange(16, dtype=np.uint8)
            got = r.decode("e2m1", c4)
            want = c4.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
            r.check("decode e2m1: all 16 codes vs float4_e2m1fn", same_f32(got, want), c4, got, want)

            got = r.decode("ue8m0", c8)
            want = c8.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
            r.check("decode ue8m0: all 256 codes vs float8_e8m0fnu", same_f32(got, want), c8, got, want)
            r.check("decode ue8m0: NaN only at 0xFF", np.isnan(got) == (c8 == 0xFF))

            got = r.decode("bf16", bits)
            want = bits.view(ml_dtypes.bfloat16).astype(np.float32)
            r.check("decode bf16: all 65536 patterns vs ml_dtypes.bfloat16", same_f32(got, want), bits, got, want)
            r.check("decode bf16: exact bit widening", f32_bits(got) == (bits.astype(np.uint32) << 16))
        r.run_checked("decode", decodes)

        # ---- bf16 cast ----
        def bf16_cast():
            rng = np.random.default_rng(7)
            x = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
            # ties and near-ties in the dropped half-word
            hi = rng.integers(0, 2**16, 50_000, dtype=np.uint64).astype(np.uint32) << 16
            x = np.concatenate([x, hi | 0x8000, hi | 0x7FFF, hi | 0x8001,
                                np.array([0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000, 0x00008000, 0x00018000],
                                         dtype=np.uint32)]).view(np.float32)
            x = np.concatenate([x, rand])
            got = r.cast("bf16", x)
            r.check("cast bf16: dtype uint16", got.dtype == np.uint16)
            with np.errstate(invalid="ignore"):
                want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
            nan = np.isnan(x)
            got_nan = ((got & 0x7F80) == 0x7F80) & ((got & 0x7F) != 0)
            ok = np.where(nan, got_nan & ((got >> 15) == (f32_bits(x) >> 31)), got == want)
            r.check("cast bf16: random float32 vs astype(ml_dtypes.bfloat16) (NaN stays NaN)", ok, x, got, want)
        r.run_checked("bf16 cast", bf16_cast)

        print(f"{r.passed} passed, {r.failed} failed")
        return 0 if r.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
