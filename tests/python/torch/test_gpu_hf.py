"""flowmoe.hf on the GPU (marker `gpu`; run on the device): the four tiny models with every flowmoe
backend against "eager" on CUDA within hf_common.BOUNDS, BF16 parameters, gradient checkpointing,
and fused AdamW steps. CPU versions: test_hf.py."""

import pytest
import torch

import hf_common as hc

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("impl", ["flowmoe-bf16", "flowmoe-blockwise", "flowmoe-fp8-naive", "flowmoe-flow",
                                  "flowmoe-flow-fp4"])
@pytest.mark.parametrize("model", sorted(hc.MODELS))
def test_gpu_backends_against_eager(model, impl):
    import flowmoe.hf

    ids = hc.batch(device=DEV)
    ref = hc.loss_and_grads(hc.build(hc.MODELS[model], "eager", device=DEV), ids)
    got = hc.loss_and_grads(hc.build(hc.MODELS[model], impl, device=DEV), ids)
    hc.compare(ref, got, flowmoe.hf.IMPLEMENTATIONS[impl], model)


@pytest.mark.parametrize("model", sorted(hc.MODELS))
def test_gpu_bf16_parameters(model):
    # against "eager" with the same BF16 parameters: the whole model computes in BF16 then (its
    # loss is 0.1-0.2 from the FP32 model's on these tiny models), so only the experts differ
    ids = hc.batch(device=DEV)
    ref = hc.build(hc.MODELS[model], "eager", dtype=torch.bfloat16, device=DEV)(input_ids=ids, labels=ids)
    m = hc.build(hc.MODELS[model], "flowmoe-flow", dtype=torch.bfloat16, device=DEV)
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    assert abs(float(out.loss.detach()) - float(ref.loss.detach())) < hc.BOUNDS["flow"][1]
    assert all(torch.isfinite(p.grad.float()).all() for p in m.parameters() if p.grad is not None)


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_gpu_gradient_checkpointing(model):
    ids = hc.batch(device=DEV)
    plain = hc.loss_and_grads(hc.build(hc.MODELS[model], "flowmoe-flow", device=DEV), ids)
    ck = hc.build(hc.MODELS[model], "flowmoe-flow", device=DEV)
    ck.gradient_checkpointing_enable()
    ck.train()
    got = hc.loss_and_grads(ck, ids)
    assert abs(float(got[1]) - float(plain[1])) < 1e-5
    for k, v in plain[2].items():
        assert hc.rel(got[2][k], v) < 1e-5, k


@pytest.mark.parametrize("impl,tol", [("flowmoe-bf16", 0.02), ("flowmoe-flow", 0.05)])
@pytest.mark.parametrize("model", ["qwen3_moe", "olmoe", "deepseek_v3"])
def test_gpu_fused_adamw_follows_eager(model, impl, tol):
    eager = hc.train_losses(hc.build(hc.MODELS[model], "eager", device=DEV), device=DEV)
    fm = hc.train_losses(hc.build(hc.MODELS[model], impl, device=DEV), device=DEV)
    assert fm[-1] < fm[0]
    for a, b in zip(fm, eager):
        assert abs(a - b) < tol * abs(b), (fm, eager)
