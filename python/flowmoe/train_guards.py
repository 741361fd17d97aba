"""Guards of the training entry point (issue 30): a run whose experts never trained, or whose MoE
layers computed with stale weights, fails loudly instead of producing a plausible loss curve.

What MoEGuard records per MoE layer (the JSON's "moe_guard"):

- `weight_updates`: the layer's own count of weight refreshes (flowmoe.torch.MoE's attribute
  `weight_updates`: set_weights calls, i.e. BF16/FP8/MXFP4 re-quantizations of the FP32 masters)
  in this process; None for the PyTorch reference layer, which reads its masters every forward.
- `optimizer_updates`: optimizer steps applied in this process; `stale_steps`: training steps
  whose forward followed an applied update but during which the layer did not refresh (its
  counter did not move): 0 when the layer saw every update.
- `moved`: for w1, w2, wr, how far the weights are from their initial values, the relative
  Frobenius norm ||W - W0|| / ||W0|| (W0: the seed's initial weights, kept on the host);
  `trainable`: whether the three require gradients (False with --freeze-experts).
- `fresh_check`: "identical" when a new layer built with the same constructor arguments, given the
  trained layer's state (load_state_dict), computes bit-identical outputs on the same small batch:
  a check that does not rely on the layer's counters. A layer that kept old quantized weights
  gives different outputs.

The run fails (GuardFailure, exit status 3) when a trainable MoE parameter never changed, when a
frozen one changed, when a layer missed a refresh (stale_steps > 0) or when the fresh-layer check
differs. The JSON is written first, so the failure can be read there.
"""

import torch

PARAMS = ("w1", "w2", "wr")


class GuardFailure(RuntimeError):
    """A guard of the training run failed (the message says which layer and which check)."""


def _refresh_count(m):
    v = getattr(m, "weight_updates", None)
    return int(v) if v is not None else None


class MoEGuard:
    def __init__(self, model, frozen=False):
        self.model = model
        self.frozen = bool(frozen)
        layers = model.moe_layers()
        # The initial weights, on the host (no device memory: peak-memory figures stay the model's).
        # Made before a checkpoint is loaded: the model's initialisation depends on the seed only,
        # so a resumed run compares with the same initial weights.
        self.initial = [{n: getattr(m, n).detach().to("cpu", copy=True) for n in PARAMS} for m in layers]
        self.optimizer_updates = 0  # applied in this process (the layers' counters restart with it)
        self.updates_total = 0      # applied over the whole run, --resume included
        self.stale_steps = [0] * len(layers)
        self.checks = []  # [[step, [result per layer]]] of the fresh-layer checks
        self._at_update = None  # the layers' refresh counts right after the last applied update

    # ---- checkpoints: the counters travel with the run ---------------------------------------------
    def state_dict(self):
        return {"updates_total": self.updates_total, "stale_steps": self.stale_steps,
                "checks": self.checks}

    def load_state_dict(self, st):
        self.updates_total = int(st["updates_total"])
        self.stale_steps = list(st["stale_steps"])
        self.checks = list(st["checks"])

    # ---- per step --------------------------------------------------------------------------------
    def after_step(self, updated):
        """After each training step (forward, backward, and the optimizer step when `updated`).
        The step's forward must have been preceded by a refresh of every trainable layer since the
        last applied update (by this forward or an evaluation's in between)."""
        layers = self.model.moe_layers()
        now = [_refresh_count(m) for m in layers]
        pending = self._at_update or [None] * len(layers)
        for i, m in enumerate(layers):
            if pending[i] is None or now[i] is None or not _trainable(m):
                continue
            if now[i] == pending[i]:  # no refresh since the update: this forward used old weights
                self.stale_steps[i] += 1
            else:
                pending[i] = None
        self._at_update = now if updated else pending
        if updated:
            self.optimizer_updates += 1
            self.updates_total += 1

    # ---- checks ----------------------------------------------------------------------------------
    @torch.no_grad()
    def fresh_check(self, step, tokens=64, seed=1234):
        """Each layer against a new layer of the same construction holding its state: outputs
        bit for bit equal on one batch of `tokens` random BF16 rows. Returns the per-layer results
        ("identical" or what differed) and keeps them for the report."""
        out = []
        for i, m in enumerate(self.model.moe_layers()):
            fresh = self.model.fresh_moe(i).to(m.w1.device)
            fresh.load_state_dict(m.state_dict())
            g = torch.Generator().manual_seed(seed + i)
            x = torch.randn(tokens, m.w1.shape[-1], generator=g).to(m.w1.device, torch.bfloat16)
            with torch.no_grad():
                a, b = m(x), fresh(x)
            if torch.equal(a, b):
                out.append("identical")
            elif not hasattr(m, "weight_updates") and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-3):
                # the plain PyTorch reference (flowmoe.reference_moe) keeps no weight copies that
                # could be stale, and its grouped GEMMs are not bit-deterministic across modules
                out.append("identical")
            else:
                diff = (a.float() - b.float()).abs()
                out.append(f"differs: {int((diff > 0).sum())} of {diff.numel()} outputs, max |diff| "
                           f"{float(diff.max()):.3g}")
            if hasattr(fresh, "release"):
                fresh.release()
            del fresh
        self.checks.append([step, out])
        return out

    def report(self):
        """The JSON's per-layer guard fields and the list of failures (empty: all guards held)."""
        layers, failures = [], []
        for i, m in enumerate(self.model.moe_layers()):
            trainable = _trainable(m)
            moved, changed = {}, {}
            for n in PARAMS:
                w = getattr(m, n).detach().to("cpu", torch.float32)
                w0 = self.initial[i][n].to(torch.float32)
                changed[n] = not torch.equal(w, w0)
                den = float(torch.linalg.vector_norm(w0))
                moved[n] = float(torch.linalg.vector_norm(w - w0)) / den if den else 0.0
            last = self.checks[-1][1][i] if self.checks else None
            entry = {"layer": i, "trainable": trainable, "weight_updates": _refresh_count(m),
                     "optimizer_updates": self.optimizer_updates, "stale_steps": self.stale_steps[i],
                     "moved": moved, "changed": changed, "fresh_check": last,
                     "fresh_checks": [[s, r[i]] for s, r in self.checks]}
            layers.append(entry)
            if trainable and self.updates_total > 0:
                still = [n for n in PARAMS if not changed[n]]
                if still:
                    failures.append(f"MoE layer {i}: trainable {', '.join(still)} never changed from the "
                                    f"initial weights (the optimizer did not update the experts/router)")
            if not trainable and any(changed.values()):
                failures.append(f"MoE layer {i}: frozen (--freeze-experts) but "
                                f"{', '.join(n for n in PARAMS if changed[n])} changed")
            if self.stale_steps[i]:
                failures.append(f"MoE layer {i}: {self.stale_steps[i]} training step(s) ran with stale "
                                f"weights (updated by the optimizer, not refreshed by the layer: its "
                                f"weight_updates counter did not move)")
            for s, r in self.checks:
                if r[i] != "identical":
                    failures.append(f"MoE layer {i}: at step {s} a fresh layer with the same state "
                                    f"computes other outputs ({r[i]}): the layer computed with stale "
                                    f"weights")
        return {"frozen_experts": self.frozen, "layers": layers, "failures": failures,
                "ok": not failures}


def _trainable(m):
    return any(getattr(m, n).requires_grad for n in PARAMS)


def summary_line(rep):
    """One line for the console: refreshes, how far the experts moved, the fresh-layer check."""
    layers = rep["layers"]
    if not layers:
        return "no MoE layers"
    moved = {n: [e["moved"][n] for e in layers] for n in PARAMS}
    def span(v):
        lo, hi = f"{min(v):.1%}", f"{max(v):.1%}"
        return lo if lo == hi else f"{lo}–{hi}"

    rng = ", ".join(f"{n} {span(v)}" for n, v in moved.items())
    wu = [e["weight_updates"] for e in layers]
    parts = []
    if all(v is not None for v in wu):
        parts.append(f"weights refreshed {min(wu)}–{max(wu)} times per layer" if min(wu) != max(wu)
                     else f"weights refreshed {wu[0]} times per layer")
    parts.append(("experts frozen; moved " if rep["frozen_experts"] else "moved from init: ") + rng)
    checks = [e["fresh_check"] for e in layers]
    if all(c == "identical" for c in checks):
        parts.append("a fresh layer with the trained state gives identical outputs")
    return "; ".join(parts)
