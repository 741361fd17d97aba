"""Expert parallelism of flowmoe.torch.MoE on the CPU backend: two processes over gloo, each holding
half of the experts, give the bits of one process holding all experts on both ranks' tokens
(y, dx, the local experts' dW1 and dW2); dWr is each rank's contribution (they sum to one rank's)."""

import os
import subprocess
import sys

import pytest
import torch

import flowmoe._native as native

from ep_common import EP_RECIPES, E, TOKENS, ep_inputs, ep_module

HERE = os.path.dirname(os.path.abspath(__file__))


def run_ranks(tmp_path, case, world=2):
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "ep_worker.py"), str(r), str(world),
                               str(store), str(tmp_path), native.library_path(), case],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("an expert-parallel rank did not finish within 240 s")
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{o}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_ep_two_processes_equal_one_process(tmp_path):
    ranks = run_ranks(tmp_path, "values")
    xs, dys = zip(*[ep_inputs(r) for r in range(2)])
    El = E // 2
    for recipe in EP_RECIPES:
        m = ep_module(recipe)
        x = torch.cat(xs).requires_grad_()
        y = m(x)
        y.backward(torch.cat(dys))
        lo = 0
        dwr_sum = torch.zeros_like(m.wr)
        for r, res in enumerate(ranks):
            got = res[recipe]
            hi = lo + TOKENS[r]
            assert torch.equal(got["y"], y.detach()[lo:hi]), f"{recipe}: y of rank {r}"
            assert torch.equal(got["dx"], x.grad[lo:hi]), f"{recipe}: dx of rank {r}"
            assert torch.equal(got["dw1"], m.w1.grad[r * El:(r + 1) * El]), f"{recipe}: dw1 of rank {r}"
            assert torch.equal(got["dw2"], m.w2.grad[r * El:(r + 1) * El]), f"{recipe}: dw2 of rank {r}"
            assert got["wire"], f"{recipe}: rank {r} reports no wire transfers"
            dwr_sum += got["dwr"]
            lo = hi
        torch.testing.assert_close(dwr_sum, m.wr.grad, rtol=1e-5, atol=1e-5)


def test_ep_mismatched_configuration_fails_every_rank(tmp_path):
    ranks = run_ranks(tmp_path, "mismatch")
    for r, res in enumerate(ranks):
        assert res["error"] is not None, f"rank {r} built a layer with a mismatched configuration"
        name, msg = res["error"]
        assert name == "CommError" and "recipe" in msg, (name, msg)
