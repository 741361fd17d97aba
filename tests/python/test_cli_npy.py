#!/usr/bin/env python3
"""End-to-end tests of the `flowmoe` command-line tool through .npy files.

usage: test_cli_npy.py PATH/TO/flowmoe

Every quantized file the tool writes is decoded here again with numpy alone (E4M3, E2M1 and
UE8M0 decoders written below from the format definitions), and compared with the tool's own
`dequantize` output, bit for bit. Needs numpy only.
"""
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

FLOWMOE = None
PASSED = 0
FAILED = 0


# ---- independent numpy codecs ---------------------------------------------------------------

def decode_e4m3(c):
    """E4M3 (OCP fn): s.eeee.mmm, bias 7, subnormals m * 2^-9, 0x7F/0xFF NaN."""
    c = np.asarray(c, dtype=np.uint8).astype(np.int64)
    e = (c >> 3) & 0xF
    m = c & 0x7
    mag = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    val = np.where(c & 0x80, -mag, mag)
    val = np.where((c & 0x7F) == 0x7F, np.nan, val)
    return val.astype(np.float32)


E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def decode_e2m1(c):
    """E2M1: s.ee.m, one 4-bit code per element."""
    c = np.asarray(c, dtype=np.uint8).astype(np.int64)
    mag = E2M1_MAG[c & 7]
    return np.where(c & 8, -mag, mag).astype(np.float32)


def decode_ue8m0(c):
    """UE8M0: 2^(c - 127), 0xFF NaN."""
    c = np.asarray(c, dtype=np.uint8).astype(np.float64)
    return np.where(c == 255, np.nan, np.exp2(c - 127.0)).astype(np.float32)


def bf16_to_f32(h):
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round to nearest even; NaN stays NaN."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def rne_encode(x, mags, nan_code):
    """Nearest of the sorted non-negative magnitudes (code = index), ties to the even code,
    saturating; the sign goes to bit 7 (e4m3) or bit 3 (e2m1) as chosen by len(mags)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    idx = np.clip(np.searchsorted(mags, a), 1, len(mags) - 1)
    lo, hi = idx - 1, idx
    dlo, dhi = a - mags[lo], mags[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= mags[-1], len(mags) - 1, code)  # saturate (Inf too)
    sign_bit = 0x80 if len(mags) > 8 else 0x8
    if nan_code is not None:
        code = np.where(np.isnan(x), nan_code, code)
    else:
        code = np.where(np.isnan(x), len(mags) - 1, code)
    return (code + np.where(np.signbit(x), sign_bit, 0)).astype(np.uint8)


E4M3_MAG = decode_e4m3(np.arange(0x7F)).astype(np.float64)  # codes 0..0x7E, increasing


# ---- helpers ----------------------------------------------------------------------------------

def run(*args):
    p = subprocess.run([FLOWMOE] + [str(a) for a in args], capture_output=True, text=True, errors="replace")
    return p.returncode, p.stdout, p.stderr


def run_ok(*args):
    rc, out, err = run(*args)
    if rc != 0:
        raise AssertionError("flowmoe %s failed (rc=%d):\n%s%s" % (" ".join(map(str, args)), rc, out, err))
    return out


def underflow_of(stdout):
    m = re.findall(r"^underflow: (\d+)$", stdout, re.M)
    assert m, "no 'underflow:' line in:\n" + stdout
    return int(m[-1])


def check(name, cond, detail=""):
    global PASSED, FAILED
    if cond:
        PASSED += 1
        print("ok    " + name)
    else:
        FAILED += 1
        print("FAIL  " + name + ("\n      " + detail if detail else ""))


def same(a, b):
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def ndiff(a, b):
    return int(np.sum(~((a == b) | (np.isnan(a) & np.isnan(b)))))


def rand_activation(rng, m, k, outliers=True):
    x = rng.standard_normal((m, k)).astype(np.float32)
    if outliers:
        mask = rng.random((m, k)) < 0.002
        x[mask] *= rng.uniform(100, 1000, size=int(mask.sum())).astype(np.float32)
    x[rng.random((m, k)) < 0.01] = 0.0
    if m > 3:
        x[3, :] = 0.0  # an all-zero row: tiles with the smallest scale
    return x


def seg_blocks(offsets):
    """[(block start, block end)] of 128-token blocks following the segments."""
    blocks = []
    for s, e in zip(offsets[:-1], offsets[1:]):
        for b in range(s, e, 128):
            blocks.append((b, min(b + 128, e)))
    return blocks


# numpy decoders of the stored layouts (docs/NPY_FILES.md) -> logical [M, K] float32
def np_dequant_row(p):
    codes, scales = np.load(p + ".codes.npy"), np.load(p + ".scales.npy")
    return decode_e4m3(codes) * np.repeat(decode_ue8m0(scales).T, 128, axis=1)


def np_dequant_col(p):
    codes, scales = np.load(p + ".codes.npy"), np.load(p + ".scales.npy")
    offsets = np.load(p + ".segments.npy")
    k, m = codes.shape
    s = np.empty((k, m), np.float32)
    blocks = seg_blocks(list(offsets))
    assert len(blocks) == scales.shape[0], (len(blocks), scales.shape)
    for j, (b, e) in enumerate(blocks):
        s[:, b:e] = decode_ue8m0(scales[j])[:, None]
    return (decode_e4m3(codes) * s).T


def np_dequant_weight(p):
    codes, scales = np.load(p + ".codes.npy"), np.load(p + ".scales.npy")
    s = np.repeat(np.repeat(decode_ue8m0(scales), 128, axis=0), 128, axis=1)
    return decode_e4m3(codes) * s


def np_dequant_mxfp4(p):
    codes, scales = np.load(p + ".codes.npy"), np.load(p + ".scales.npy")
    m, half = codes.shape
    nib = np.empty((m, 2 * half), np.uint8)
    nib[:, 0::2] = codes & 0xF  # element 2i in the low nibble
    nib[:, 1::2] = codes >> 4
    return decode_e2m1(nib) * np.repeat(decode_ue8m0(scales), 32, axis=1)


def scale_exps(amax, fmax):
    """Expected UE8M0 codes: 2^ceil(log2(amax / fmax)), all-zero -> code 0."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax.astype(np.float64) / fmax))
    e = np.where(amax == 0, -127, np.clip(e, -127, 127))
    return (e + 127).astype(np.uint8)


# ---- tests --------------------------------------------------------------------------------------

def test_row(tmp, rng):
    m, k = 200, 384
    x = rand_activation(rng, m, k)
    np.save(tmp + "/x.npy", x)
    out = run_ok("quantize", "--layout", "row", tmp + "/x.npy", tmp + "/r")
    codes, scales = np.load(tmp + "/r.codes.npy"), np.load(tmp + "/r.scales.npy")
    check("row: codes uint8 [M, K]", codes.dtype == np.uint8 and codes.shape == (m, k), str(codes.shape))
    check("row: scales uint8 [K/128, M]", scales.dtype == np.uint8 and scales.shape == (k // 128, m))
    amax = np.abs(x).reshape(m, k // 128, 128).max(axis=2).T
    check("row: scales are 2^ceil(log2(amax/448))", same(scales, scale_exps(amax, 448.0)))
    check("row: nonfinite 0 reported", re.search(r"^nonfinite: 0$", out, re.M) is not None, out)

    run_ok("dequantize", "--layout", "row", "--shape", "%d,%d" % (m, k), tmp + "/r", tmp + "/r.deq.npy")
    deq = np.load(tmp + "/r.deq.npy")
    ref = np_dequant_row(tmp + "/r")
    check("row: dequantize == numpy codes*scale", deq.dtype == np.float32 and same(deq, ref),
          "%d differ" % ndiff(deq, ref))
    s = np.repeat(decode_ue8m0(scales).T, 128, axis=1).astype(np.float64)
    err = np.abs(deq.astype(np.float64) - x)
    bound = np.maximum(np.abs(x) * 2.0 ** -4, s * 2.0 ** -10)
    check("row: |q - x| within half an E4M3 ulp", bool(np.all(err <= bound)))
    # codes are the RNE of x / s, checked with the independent encoder
    want = rne_encode(x / s, E4M3_MAG, 0x7F)
    check("row: codes == RNE_E4M3(x / s)", same(codes, want), "%d differ" % int(np.sum(codes != want)))

    run_ok("dequantize", "--layout", "row", "--bf16", tmp + "/r", tmp + "/r.deqbf.npy")
    deqbf = np.load(tmp + "/r.deqbf.npy")
    check("row: dequantize --bf16 == RNE bf16 of float32 result",
          deqbf.dtype == np.uint16 and same(deqbf, f32_to_bf16(deq)))
    return x


def test_bf16_col_segments(tmp, rng):
    m, k = 300, 256
    xf = rand_activation(rng, m, k)
    xb = f32_to_bf16(xf)
    np.save(tmp + "/xb.npy", xb)
    counts = [100, 0, 200]
    run_ok("quantize", "--layout", "col", "--segments", ",".join(map(str, counts)), tmp + "/xb.npy", tmp + "/c")
    codes, scales = np.load(tmp + "/c.codes.npy"), np.load(tmp + "/c.scales.npy")
    offsets = np.load(tmp + "/c.segments.npy")
    check("col: codes [K, M]", codes.shape == (k, m))
    check("col: scales [NB, K], NB = 1 + 0 + 2", scales.shape == (3, k), str(scales.shape))
    check("col: segments int32 [0,100,100,300]",
          offsets.dtype == np.int32 and list(offsets) == [0, 100, 100, 300], str(offsets))
    x = bf16_to_f32(xb)
    blocks = seg_blocks(list(offsets))
    amax = np.stack([np.abs(x[b:e]).max(axis=0) for b, e in blocks])
    check("col: scales from per-(block, feature) amax", same(scales, scale_exps(amax, 448.0)))
    run_ok("dequantize", "--layout", "col", tmp + "/c", tmp + "/c.deq.npy")
    deq = np.load(tmp + "/c.deq.npy")
    check("col: dequantize == numpy codes*scale ([M, K])", same(deq, np_dequant_col(tmp + "/c")))

    run_ok("quantize", "--layout", "both", "--segments", "100,0,200", tmp + "/xb.npy", tmp + "/b")
    check("both: col copy identical to --layout col",
          same(np.load(tmp + "/b.col.codes.npy"), codes) and same(np.load(tmp + "/b.col.scales.npy"), scales))
    check("both: row copy written", np.load(tmp + "/b.row.codes.npy").shape == (m, k))


def test_transpose(tmp, rng):
    m, k = 260, 256
    x = rand_activation(rng, m, k)
    # rows with very different magnitudes force exponent shifts into the subnormals
    x[::7] *= 2.0 ** 12
    np.save(tmp + "/t.npy", x)
    run_ok("quantize", "--layout", "row", tmp + "/t.npy", tmp + "/tr")
    row_vals = np_dequant_row(tmp + "/tr")
    for method in ("aware", "naive"):
        out = run_ok("transpose", "--method", method, "--shape", "%d,%d" % (m, k), "--segments", "60,200",
                     tmp + "/tr", tmp + "/tc_" + method)
        col_vals = np_dequant_col(tmp + "/tc_" + method)
        run_ok("dequantize", "--layout", "col", tmp + "/tc_" + method, tmp + "/tc.deq.npy")
        check("transpose %s: dequantize == numpy decode" % method,
              same(np.load(tmp + "/tc.deq.npy"), col_vals))
        check("transpose %s: segments file [0,60,260]" % method,
              list(np.load(tmp + "/tc_%s.segments.npy" % method)) == [0, 60, 260])
        if method == "aware":
            u = underflow_of(out)
            d = ndiff(col_vals, row_vals)
            check("transpose aware: col values == row values except <= underflow (%d differ, %d reported)"
                  % (d, u), d <= u)
            check("transpose aware: this input does underflow", u > 0, "underflow %d" % u)


def test_mxfp4(tmp, rng):
    m, k = 70, 256
    x = rand_activation(rng, m, k)
    x[5, :32] *= 2.0 ** -16  # a block far below its neighbours
    np.save(tmp + "/f.npy", x)
    run_ok("quantize", "--layout", "mxfp4", tmp + "/f.npy", tmp + "/f")
    codes, scales = np.load(tmp + "/f.codes.npy"), np.load(tmp + "/f.scales.npy")
    check("mxfp4: codes [M, K/2], scales [M, K/32]", codes.shape == (m, k // 2) and scales.shape == (m, k // 32))
    amax = np.abs(x).reshape(m, k // 32, 32).max(axis=2)
    check("mxfp4: scales are 2^ceil(log2(amax/6))", same(scales, scale_exps(amax, 6.0)))
    fp4_vals = np_dequant_mxfp4(tmp + "/f")
    run_ok("dequantize", "--layout", "mxfp4", tmp + "/f", tmp + "/f.deq.npy")
    check("mxfp4: dequantize == numpy decode", same(np.load(tmp + "/f.deq.npy"), fp4_vals))
    s = np.repeat(decode_ue8m0(scales), 32, axis=1).astype(np.float64)
    nib = rne_encode(x / s, E2M1_MAG, None)
    check("mxfp4: codes == RNE_E2M1(x / X), packed low nibble first",
          same(codes, (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)))

    for to, dec in (("row", np_dequant_row), ("col", np_dequant_col), ("col-stepwise", np_dequant_col)):
        args = ["fp4-to-fp8", "--to", to, "--shape", "%d,%d" % (m, k)]
        if to != "row":
            args += ["--segments", "30,40"]
        out = run_ok(*(args + [tmp + "/f", tmp + "/g_" + to]))
        vals = dec(tmp + "/g_" + to)
        layout = "row" if to == "row" else "col"
        run_ok("dequantize", "--layout", layout, tmp + "/g_" + to, tmp + "/g.deq.npy")
        check("fp4-to-fp8 %s: dequantize == numpy decode" % to, same(np.load(tmp + "/g.deq.npy"), vals))
        if to != "col-stepwise":
            d, u = ndiff(vals, fp4_vals), underflow_of(out)
            check("fp4-to-fp8 %s: exact except <= underflow (%d differ, %d reported)" % (to, d, u), d <= u)


def test_exponent(tmp, rng):
    """--exponent column-amax: the aware transpose equals the naive path's files, FP4RowToFP8Col
    the stepwise path's, each changing only what it counts as underflow."""
    m, k = 300, 256
    x = rand_activation(rng, m, k)
    x[5::128] *= 2.0 ** 20  # one outlier token per 128-token block
    np.save(tmp + "/e.npy", x)
    run_ok("quantize", "--layout", "row", tmp + "/e.npy", tmp + "/er")
    run_ok("quantize", "--layout", "mxfp4", tmp + "/e.npy", tmp + "/ef")
    same_files = lambda a, b: all(same(np.load("%s.%s.npy" % (a, f)), np.load("%s.%s.npy" % (b, f)))
                                  for f in ("codes", "scales"))
    seg = ["--segments", "100,0,1,199"]
    u_ca = underflow_of(run_ok("transpose", "--method", "aware", "--exponent", "column-amax", *(seg + [tmp + "/er", tmp + "/eca"])))
    u_rm = underflow_of(run_ok("transpose", "--method", "aware", "--exponent", "row-max", *(seg + [tmp + "/er", tmp + "/erm"])))
    run_ok("transpose", "--method", "naive", *(seg + [tmp + "/er", tmp + "/en"]))
    check("transpose --exponent column-amax == --method naive", same_files(tmp + "/eca", tmp + "/en"))
    d = ndiff(np_dequant_col(tmp + "/eca"), np_dequant_row(tmp + "/er"))
    check("transpose column-amax: changed == underflow (%d, %d), <= row-max's %d" % (d, u_ca, u_rm),
          d == u_ca and u_ca <= u_rm)
    u4 = underflow_of(run_ok("fp4-to-fp8", "--to", "col", "--exponent", "column-amax", *(seg + [tmp + "/ef", tmp + "/e4ca"])))
    run_ok("fp4-to-fp8", "--to", "col-stepwise", *(seg + [tmp + "/ef", tmp + "/e4s"]))
    check("fp4-to-fp8 --to col --exponent column-amax == col-stepwise", same_files(tmp + "/e4ca", tmp + "/e4s"))
    d4 = ndiff(np_dequant_col(tmp + "/e4ca"), np_dequant_mxfp4(tmp + "/ef"))
    check("fp4-to-fp8 column-amax: changed == underflow (%d, %d)" % (d4, u4), d4 == u4)
    for args in (["transpose", "--method", "naive", "--exponent", "column-amax", tmp + "/er", tmp + "/z"],
                 ["fp4-to-fp8", "--to", "row", "--exponent", "column-amax", tmp + "/ef", tmp + "/z"],
                 ["transpose", "--method", "aware", "--exponent", "col-amax", tmp + "/er", tmp + "/z"]):
        rc, out, err = run(*args)
        check("usage error: %s" % " ".join(args[:5]), rc == 2 and "--exponent" in err, "rc=%d %s" % (rc, err))


def test_weight(tmp, rng):
    n, k = 256, 384
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    np.save(tmp + "/w.npy", w)
    run_ok("quantize", "--layout", "weight", tmp + "/w.npy", tmp + "/w")
    c, s = np.load(tmp + "/w.codes.npy"), np.load(tmp + "/w.scales.npy")
    ct, st = np.load(tmp + "/w.t.codes.npy"), np.load(tmp + "/w.t.scales.npy")
    check("weight: shapes [N,K], [N/128,K/128]", c.shape == (n, k) and s.shape == (2, 3))
    check("weight: transpose is exact (codes.T, scales.T)", same(ct, c.T) and same(st, s.T))
    run_ok("dequantize", "--layout", "weight", tmp + "/w", tmp + "/w.deq.npy")
    check("weight: dequantize == numpy decode", same(np.load(tmp + "/w.deq.npy"), np_dequant_weight(tmp + "/w")))
    run_ok("dequantize", "--layout", "weight", "--shape", "%d,%d" % (k, n), tmp + "/w.t", tmp + "/wt.deq.npy")
    check("weight: transposed copy decodes to W^T", same(np.load(tmp + "/wt.deq.npy"), np.load(tmp + "/w.deq.npy").T))


def test_cast_decode(tmp, rng):
    specials = np.array([0.0, -0.0, 1.0, -1.0, 448.0, 464.0, 480.0, 1e6, -1e6, np.inf, -np.inf, np.nan,
                         2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.0001, 3 * 2.0 ** -11, 0.25, 5.0, 7.0, 6.5,
                         1.0e-40, 0.75, 1.25, 2.5], np.float32)
    x = np.concatenate([specials, (rng.standard_normal(4000) * np.exp2(rng.integers(-12, 10, 4000))).astype(np.float32)])
    x = x.reshape(4, -1)
    np.save(tmp + "/cx.npy", x)

    run_ok("cast", "--format", "e4m3", tmp + "/cx.npy", tmp + "/c8.npy")
    c8 = np.load(tmp + "/c8.npy")
    check("cast e4m3: uint8, same shape", c8.dtype == np.uint8 and c8.shape == x.shape)
    want = rne_encode(x, E4M3_MAG, 0x7F)
    check("cast e4m3 == numpy RNE (saturating)", same(c8, want), "%d differ" % int(np.sum(c8 != want)))

    run_ok("cast", "--format", "e2m1", tmp + "/cx.npy", tmp + "/c4.npy")
    c4 = np.load(tmp + "/c4.npy")
    want = rne_encode(x, E2M1_MAG, None)
    check("cast e2m1 == numpy RNE, one code per byte", same(c4, want) and int(c4.max()) <= 15)

    xb = f32_to_bf16(x)
    run_ok("cast", "--format", "bf16", tmp + "/cx.npy", tmp + "/cb.npy")
    check("cast bf16 == numpy RNE", same(np.load(tmp + "/cb.npy"), xb))
    np.save(tmp + "/cxb.npy", xb)
    run_ok("cast", "--format", "e4m3", tmp + "/cxb.npy", tmp + "/c8b.npy")
    check("cast e4m3 from bf16 input", same(np.load(tmp + "/c8b.npy"), rne_encode(bf16_to_f32(xb), E4M3_MAG, 0x7F)))

    allc = np.arange(256, dtype=np.uint8).reshape(16, 16)
    np.save(tmp + "/all.npy", allc)
    for fmt, dec in (("e4m3", decode_e4m3), ("ue8m0", decode_ue8m0)):
        run_ok("decode", "--format", fmt, tmp + "/all.npy", tmp + "/d.npy")
        d = np.load(tmp + "/d.npy")
        check("decode %s: all 256 codes" % fmt, d.dtype == np.float32 and same(d, dec(allc)))
    np.save(tmp + "/c16.npy", np.arange(16, dtype=np.uint8))
    run_ok("decode", "--format", "e2m1", tmp + "/c16.npy", tmp + "/d.npy")
    check("decode e2m1: all 16 codes", same(np.load(tmp + "/d.npy"), decode_e2m1(np.arange(16))))
    rc, _, err = run("decode", "--format", "e2m1", tmp + "/all.npy", tmp + "/d.npy")
    check("decode e2m1: byte > 15 is an error", rc == 1 and "e2m1" in err, err)
    hb = rng.integers(0, 65536, 1000).astype(np.uint16)
    np.save(tmp + "/hb.npy", hb)
    run_ok("decode", "--format", "bf16", tmp + "/hb.npy", tmp + "/d.npy")
    check("decode bf16", same(np.load(tmp + "/d.npy"), bf16_to_f32(hb)))


def test_errors(tmp, rng):
    x = rand_activation(rng, 8, 256)
    x[2, 5] = np.nan
    x[6, 200] = np.inf
    x[7, 0] = -np.inf
    np.save(tmp + "/nf.npy", x)
    rc, out, err = run("quantize", "--layout", "row", tmp + "/nf.npy", tmp + "/nf")
    check("non-finite input: exit 1, message says non-finite and the count",
          rc == 1 and "non-finite" in err and "3" in err and "nf.npy" in err, "rc=%d %s" % (rc, err))
    check("non-finite input: nothing written", not os.path.exists(tmp + "/nf.codes.npy"))
    rc, out, err = run("quantize", "--layout", "row", "--allow-nonfinite", tmp + "/nf.npy", tmp + "/nf")
    check("--allow-nonfinite: exit 0, count reported", rc == 0 and re.search(r"^nonfinite: 3$", out, re.M), out + err)
    if rc == 0:
        run_ok("dequantize", "--layout", "row", tmp + "/nf", tmp + "/nf.deq.npy")
        d = np.load(tmp + "/nf.deq.npy")
        bad = np.zeros_like(d, dtype=bool)
        bad[2, 0:128] = bad[6, 128:256] = bad[7, 0:128] = True
        check("--allow-nonfinite: exactly the affected tiles decode to NaN",
              bool(np.all(np.isnan(d[bad])) and np.all(np.isfinite(d[~bad]))))

    np.save(tmp + "/k100.npy", rng.standard_normal((8, 100)).astype(np.float32))
    rc, _, err = run("quantize", "--layout", "row", tmp + "/k100.npy", tmp + "/k100")
    check("K=100 row: non-zero exit, says multiple of 128", rc != 0 and "multiple of 128" in err, err)
    run_ok("quantize", "--layout", "row", tmp + "/x.npy", tmp + "/r2")
    rc, _, err = run("dequantize", "--layout", "row", "--shape", "8,100", tmp + "/r2", tmp + "/o.npy")
    check("dequantize --shape 8,100: non-zero exit, says multiple of 128", rc != 0 and "multiple of 128" in err, err)
    rc, _, err = run("dequantize", "--layout", "row", "--shape", "100,384", tmp + "/r2", tmp + "/o.npy")
    check("dequantize wrong --shape: exit 1, says expected shape", rc == 1 and "expected" in err, err)
    rc, _, err = run("quantize", "--layout", "mxfp4", tmp + "/k100.npy", tmp + "/k100")
    check("K=100 mxfp4: says multiple of 32", rc != 0 and "multiple of 32" in err, err)

    np.save(tmp + "/f64.npy", np.zeros((4, 128)))
    rc, _, err = run("quantize", "--layout", "row", tmp + "/f64.npy", tmp + "/o")
    check("float64 input: exit 1, names the dtype", rc == 1 and "<f8" in err, err)
    np.save(tmp + "/fo.npy", np.asfortranarray(np.ones((4, 128), np.float32)))
    rc, _, err = run("quantize", "--layout", "row", tmp + "/fo.npy", tmp + "/o")
    check("fortran_order input: exit 1, says C order", rc == 1 and "fortran" in err.lower(), err)
    with open(tmp + "/x.npy", "rb") as f:
        blob = f.read()
    with open(tmp + "/trunc.npy", "wb") as f:
        f.write(blob[:-10])
    rc, _, err = run("quantize", "--layout", "row", tmp + "/trunc.npy", tmp + "/o")
    check("truncated file: exit 1, says truncated", rc == 1 and "truncated" in err, err)
    with open(tmp + "/junk.npy", "wb") as f:
        f.write(b"not an npy file at all")
    rc, _, err = run("decode", "--format", "e4m3", tmp + "/junk.npy", tmp + "/o.npy")
    check("bad magic: exit 1", rc == 1 and "magic" in err, err)
    rc, _, err = run("decode", "--format", "e4m3", tmp + "/missing.npy", tmp + "/o.npy")
    check("missing file: exit 1, names it", rc == 1 and "missing.npy" in err, err)
    rc, _, err = run("quantize", "--layout", "diagonal", tmp + "/x.npy", tmp + "/o")
    check("bad --layout: exit 2 with usage", rc == 2 and "usage:" in err, err)
    rc, _, err = run("quantize", "--layout", "col", "--segments", "1,2", tmp + "/x.npy", tmp + "/o")
    check("--segments not summing to M: exit 2", rc == 2 and "sum" in err, err)
    rc, _, _ = run("frobnicate")
    check("unknown command: exit 2", rc == 2)
    for cmd in ("numerics", "quantize", "dequantize", "transpose", "fp4-to-fp8", "cast", "decode"):
        rc, out, _ = run(cmd, "--help")
        check("%s --help" % cmd, rc == 0 and out.startswith("usage: flowmoe " + cmd), out[:80])

    # format version 2.0 is read too
    with open(tmp + "/v2.npy", "wb") as f:
        np.lib.format.write_array(f, np.arange(16, dtype=np.uint8), version=(2, 0))
    run_ok("decode", "--format", "e2m1", tmp + "/v2.npy", tmp + "/d.npy")
    check("reads .npy format 2.0", same(np.load(tmp + "/d.npy"), decode_e2m1(np.arange(16))))


def raw_npy(path, header, data=b""):
    """A .npy file with the given header dict text (padded as numpy pads it)."""
    import struct
    h = header.encode("latin1")
    total = (10 + len(h) + 1 + 63) // 64 * 64
    h = h + b" " * (total - 10 - len(h) - 1) + b"\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + data)


def test_robustness(tmp, rng):
    """Issue 20: hostile shapes, all-or-nothing output sets, finite stays finite, counters."""
    d = os.path.join(tmp, "rob")
    os.makedirs(d)
    # 1. a header-only quantized set of shape [2^40, 0] is refused at once, naming file, shape, limit
    for suf in ("codes", "scales"):
        raw_npy(d + "/p.%s.npy" % suf, "{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627776, 0), }")
    for args in (["fp4-to-fp8", "--to", "row"], ["dequantize", "--layout", "row"], ["transpose", "--method", "aware"]):
        t0 = time.time()
        rc, _, err = run(*(args + [d + "/p", d + "/out" + (".npy" if args[0] == "dequantize" else "")]))
        check("%s of a [2^40, 0] set: exit 1 at once, names file, shape and limit" % args[0],
              rc == 1 and time.time() - t0 < 5 and "p.codes.npy" in err and "[1099511627776, 0]" in err
              and "2147483647" in err, err)
    check("[2^40, 0]: nothing written", not [f for f in os.listdir(d) if f.startswith("out")], os.listdir(d))

    # 2./3. output sets appear whole or not at all; an existing set and the input stay intact
    x = rand_activation(rng, 130, 256)
    np.save(d + "/x.npy", x)
    long_prefix = d + "/" + "a" * 245
    for lay in ("row", "col", "both", "weight", "mxfp4"):
        if lay == "weight":
            np.save(d + "/w.npy", rand_activation(rng, 256, 256))
        src = d + ("/w.npy" if lay == "weight" else "/x.npy")
        before = sorted(os.listdir(d))
        rc, _, err = run("quantize", "--layout", lay, src, long_prefix)
        check("quantize %s to a 245-character prefix: exit 1, no file left" % lay,
              rc == 1 and sorted(os.listdir(d)) == before and "too long" in err, err)
    run_ok("quantize", "--layout", "row", d + "/x.npy", d + "/old")
    with open(d + "/old.codes.npy", "rb") as f:
        old_codes = f.read()
    os.makedirs(d + "/old.segments.npy")  # the third file of the col set cannot be written
    rc, _, err = run("transpose", "--method", "aware", d + "/old", d + "/old")
    with open(d + "/old.codes.npy", "rb") as f:
        kept = f.read() == old_codes
    check("in-place transpose whose third file fails: exit 1, input set untouched, no temporaries",
          rc == 1 and kept and not [f for f in os.listdir(d) if f.startswith(".flowmoe")], err)
    os.rmdir(d + "/old.segments.npy")
    out = run_ok("transpose", "--method", "aware", d + "/old", d + "/old")
    check("in-place transpose: the row set is replaced by a col set that reads back",
          "wrote" in out and run("dequantize", "--layout", "col", d + "/old", d + "/old.npy")[0] == 0)

    # 4. finite input at the top of the float32 range never decodes to Inf, in any layout
    big = np.full((128, 256), 1.0, np.float32)
    big[0, :] = np.float32(3.4028235e38)
    big[1, :] = np.float32(-3.3e38)
    big[2, :64] = np.float32(2.99e38)
    np.save(d + "/big.npy", big)
    for lay, dec in (("row", np_dequant_row), ("col", np_dequant_col), ("weight", np_dequant_weight),
                     ("mxfp4", np_dequant_mxfp4)):
        out = run_ok("quantize", "--layout", lay, d + "/big.npy", d + "/big_" + lay)
        vals = dec(d + "/big_" + lay)
        check("quantize %s of values up to FLT_MAX: every value finite, nonfinite 0" % lay,
              bool(np.all(np.isfinite(vals))) and re.search(r"^nonfinite: 0$", out, re.M) is not None)
    check("row: FLT_MAX decodes to 1.875 * 2^127", np_dequant_row(d + "/big_row")[0, 0] == np.float32(2.0 ** 127 * 1.875))
    check("mxfp4: FLT_MAX decodes to 1.5 * 2^127", np_dequant_mxfp4(d + "/big_mxfp4")[0, 0] == np.float32(2.0 ** 127 * 1.5))

    # 5. counters: quantize counts flushed elements; the naive path names its BF16 overflow
    y = np.ones((1, 128), np.float32)
    y[0, 0] = 448.0
    y[0, 1:4] = 1e-4  # below 2^-10: zero codes
    np.save(d + "/y.npy", y)
    out = run_ok("quantize", "--layout", "row", d + "/y.npy", d + "/y")
    check("quantize: 'flushed: 3' for three non-zero inputs that became zero codes",
          re.search(r"^flushed: 3$", out, re.M) is not None and "underflow" not in out, out)
    codes = np.full((1, 128), 0x38, np.uint8)
    codes[0, 0] = 0x7E
    np.save(d + "/h.codes.npy", codes)
    np.save(d + "/h.scales.npy", np.full((1, 1), 254, np.uint8))
    rc, _, err = run("transpose", "--method", "naive", d + "/h", d + "/hn")
    check("naive transpose of 448 * 2^127: exit 1, reports overflow in the BF16 intermediate, not NaN input",
          rc == 1 and "overflowed" in err and "NaN scale" not in err, err)
    out = run_ok("transpose", "--method", "naive", "--allow-nonfinite", d + "/h", d + "/hn")
    check("naive transpose --allow-nonfinite: 'overflow: 1'", re.search(r"^overflow: 1$", out, re.M) is not None, out)

    # minor: strict integers, .npy header tail, long headers cut in messages
    for bad in ("+130,256", " 130,256", "130, 256"):
        rc, _, err = run("dequantize", "--layout", "row", "--shape", bad, d + "/old", d + "/o.npy")
        check("--shape '%s': usage error" % bad, rc == 2 and "not an integer" in err, err)
    rc, _, err = run("quantize", "--layout", "col", "--segments", "+130", d + "/x.npy", d + "/o")
    check("--segments '+130': usage error", rc == 2 and "not an integer" in err, err)
    raw_npy(d + "/tail.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 128), }x",
            np.ones(128, np.float32).tobytes())
    rc, _, err = run("decode", "--format", "bf16", d + "/tail.npy", d + "/o.npy")
    check(".npy header with bytes after '}': exit 1", rc == 1 and "after the closing" in err, err)
    raw_npy(d + "/long.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 128), 'x': '%s'}" % ("y" * 10000))
    rc, _, err = run("decode", "--format", "bf16", d + "/long.npy", d + "/o.npy")
    check("a 10 KB header: exit 1, message cut", rc == 1 and len(err) < 1000, "%d bytes" % len(err))


def test_numerics():
    out = run_ok("numerics", "--m", "256", "--k", "256", "--experts", "4", "--seed", "7")
    check("numerics: prints all nine paths",
          all(s in out for s in ("row-wise FP8 (reference)", "naive DQ->T->Q col", "scaling-aware transpose col",
                                 "row-wise FP8, FP32 scales", "naive DQ->T->Q, FP32 scales",
                                 "FP4 row (MXFP4)", "FP4->FP8 stepwise col", "FP4->FP8 direct col",
                                 "FP4->FP8 direct row")), out)
    # "<letter>) <name>  <vs>  <changed> (<pct>)  <max rel>  <mean rel>  <underflow or ->"
    rows = {mm.group(1): (int(mm.group(2)), mm.group(3))
            for mm in re.finditer(r"^([a-i])\) .+?\s+[a-z]\s+(\d+) \([^)]*\)\s+\S+\s+\S+\s+(\d+|-)\s", out, re.M)}
    check("numerics: table has rows a-i", sorted(rows) == list("abcdefghi"), out)
    if sorted(rows) == list("abcdefghi"):
        check("numerics: aware transpose changed == underflow", str(rows["c"][0]) == rows["c"][1], out)
        check("numerics: pow2 naive copy changes no more than the aware transpose", rows["b"][0] <= rows["c"][0], out)
        check("numerics: FP32-scale naive copy re-rounds (double quantization)",
              rows["e"][0] > 0 and rows["d"][1] == "-" and rows["e"][1] == "-", out)
        check("numerics: direct FP4->FP8 conversions change nothing here", rows["h"][0] == rows["i"][0] == 0, out)
        # the last line is the one-line verdict, and it quotes e)'s count (not d)'s)
        last = out.strip().splitlines()[-1]
        check("numerics: ends with an OK verdict", last.startswith("verdict: OK:"), out)
        check("numerics: the verdict quotes the FP32-scale copy's re-rounded count",
              f"re-rounded {rows['e'][0]} values" in last, out)
    check("numerics: the prose only with --explain", "Double quantization happens" not in out, out)
    out = run_ok("numerics", "--m", "256", "--k", "256", "--experts", "4", "--seed", "7", "--explain")
    check("numerics --explain: the prose, then the verdict",
          "Double quantization happens" in out and out.strip().splitlines()[-1].startswith("verdict: OK:"), out)


def main():
    global FLOWMOE
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    FLOWMOE = os.path.abspath(sys.argv[1])
    rng = np.random.default_rng(1234)
    tests = [test_row, test_bf16_col_segments, test_transpose, test_mxfp4, test_weight, test_cast_decode,
             test_errors, test_robustness, test_exponent]
    with tempfile.TemporaryDirectory() as tmp:
        for t in tests:
            try:
                t(tmp, rng)
            except Exception:
                check(t.__name__ + " ran to the end", False, traceback.format_exc())
    try:
        test_numerics()
    except Exception:
        check("test_numerics ran to the end", False, traceback.format_exc())
    print("%d passed, %d failed" % (PASSED, FAILED))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
