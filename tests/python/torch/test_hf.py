"""flowmoe.hf, the transformers experts backend (issue 31), on the CPU with tiny models (hf_common.py):
Qwen3-MoE, DeepSeek-V3 (sigmoid routing with groups, bias and scaling: routing stays HF's), Mixtral
and OLMoE with experts_implementation="flowmoe-bf16" against "eager" (logits, loss and every
gradient within BF16 tolerance, the router's included), the FP8 recipes within the stated bounds
(hf_common.BOUNDS), gradient checkpointing, fused AdamW steps that follow eager's losses, and the
refusals; and a smoke run of bench/hf_experts.py (docs/HF.md's figures). GPU versions: test_gpu_hf.py."""

import json
import math
import os
import runpy

import pytest
import torch

import hf_common as hc

transformers = hc.transformers
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture(scope="module", autouse=True)
def _register():
    import flowmoe.hf  # noqa: F401


def test_registered_names():
    import flowmoe.hf
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for name in ("flowmoe", "flowmoe-bf16", "flowmoe-blockwise", "flowmoe-fp8-naive", "flowmoe-flow",
                 "flowmoe-flow-fp4"):
        assert name in ALL_EXPERTS_FUNCTIONS.valid_keys()
        assert flowmoe.hf.IMPLEMENTATIONS[name] in ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4")


@pytest.mark.parametrize("model", sorted(hc.MODELS))
def test_bf16_recipe_matches_eager(model):
    ids = hc.batch()
    ref = hc.loss_and_grads(hc.build(hc.MODELS[model], "eager"), ids)
    fm = hc.build(hc.MODELS[model], "flowmoe-bf16")
    got = hc.loss_and_grads(fm, ids)
    hc.compare(ref, got, "bf16")
    routers = [k for k in got[2] if k.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert routers and all(float(got[2][k].abs().sum()) > 0 for k in routers), "the router trains"
    assert any(getattr(m, "_flowmoe_options", None) is not None for m in fm.modules()), "flowmoe ran the experts"


@pytest.mark.parametrize("impl", ["flowmoe-blockwise", "flowmoe-fp8-naive", "flowmoe-flow", "flowmoe-flow-fp4",
                                  "flowmoe"])
@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_fp8_recipes_within_bounds(model, impl):
    if model == "gpt_oss" and impl == "flowmoe-fp8-naive":
        pytest.skip("expert biases with fp8-naive are refused (test_gpt_oss_refusals)")
    import flowmoe.hf

    ids = hc.batch()
    ref = hc.loss_and_grads(hc.build(hc.MODELS[model], "eager"), ids)
    got = hc.loss_and_grads(hc.build(hc.MODELS[model], impl), ids)
    hc.compare(ref, got, flowmoe.hf.IMPLEMENTATIONS[impl], model)


@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_gradient_checkpointing(model):
    ids = hc.batch()
    plain = hc.loss_and_grads(hc.build(hc.MODELS[model], "flowmoe-flow"), ids)
    ck = hc.build(hc.MODELS[model], "flowmoe-flow")
    ck.gradient_checkpointing_enable()
    ck.train()
    got = hc.loss_and_grads(ck, ids)
    assert torch.equal(got[1], plain[1])
    for k, v in plain[2].items():  # the recomputed forward is the same computation: the same bits
        assert torch.equal(got[2][k], v), k


@pytest.mark.parametrize("model", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_fused_adamw_follows_eager(model):
    eager = hc.train_losses(hc.build(hc.MODELS[model], "eager"))
    fm = hc.train_losses(hc.build(hc.MODELS[model], "flowmoe-bf16"))
    assert fm[-1] < fm[0], f"flowmoe's loss does not go down: {fm}"
    # BF16 rounding, 4 steps apart; gpt-oss's loss falls 3x in these 4 steps and the differences
    # grow with it (measured 3.3% at the 4th step)
    tol = 0.05 if model == "gpt_oss" else 0.02
    for a, b in zip(fm, eager):
        assert abs(a - b) < tol * abs(b), (fm, eager)


def _qwen(**kw):
    cfg = hc.qwen3_moe()
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("sizes", [dict(hidden_size=64, head_dim=32), dict(moe_intermediate_size=96)])
def test_sizes_not_multiples_of_128_run_padded(sizes):
    """H or F not a multiple of 128: zero-padded to the next multiple, the same computation. Compared
    at the experts module (values and every gradient): through the whole tiny model a BF16 difference
    can flip a later router's top-k for a token, which says nothing about the padding."""
    mods = [[m for m in hc.build(lambda: _qwen(**sizes), impl).modules() if hasattr(m, "gate_up_proj")][0]
            for impl in ("eager", "flowmoe-bf16")]
    g = torch.Generator().manual_seed(3)
    H = mods[0].gate_up_proj.shape[-1]
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(hc.E, generator=g)[:hc.K] for _ in range(40)])
    w = torch.rand(40, hc.K, generator=g)
    outs = []
    for m in mods:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = m(xi, ids, wi)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), xi.grad, wi.grad, m.gate_up_proj.grad, m.down_proj.grad))
    assert mods[1]._flowmoe_options is not None
    for name, a, b in zip(("y", "dx", "dw", "dgate_up", "ddown"), outs[1], outs[0]):
        assert hc.rel(a, b) < 0.02, f"{name}: {hc.rel(a, b):.4f}"


def test_gpt_oss_refusals(monkeypatch):
    ids = hc.batch()
    m = hc.build(hc.gpt_oss, "flowmoe-fp8-naive")
    with pytest.raises(NotImplementedError,
                       match=r"gpt_oss.*GEMM1 \(expert\) biases with the fp8-naive recipe are not supported") as info:
        m(input_ids=ids)
    # the library's words (C ABI flowmoe_config_check), not a restatement in flowmoe.hf: the text the
    # library gives for the layer flowmoe.torch.experts would build (gpt_oss: H 200, F 72, padded)
    from flowmoe.experts import refusal

    reason = refusal(hc.E, 200, 72, hc.K, "fp8-naive", gemm1_bias=True)
    assert reason and reason in str(info.value), (reason, str(info.value))
    assert refusal(hc.E, 200, 72, hc.K, "flow", gemm1_bias=True) is None
    m = hc.build(hc.gpt_oss, "flowmoe-flow")
    experts = m.model.layers[0].mlp.experts
    monkeypatch.setattr(type(experts), "_apply_gate",
                        lambda self, gu: torch.nn.functional.gelu(gu[..., ::2]) * gu[..., 1::2])
    with pytest.raises(NotImplementedError, match=r"gpt_oss.*custom gating function"):
        m(input_ids=ids)


def test_refusals_name_the_model_and_what_is_missing():
    ids = hc.batch()
    m = hc.build(lambda: _qwen(hidden_act="gelu"), "flowmoe-bf16")
    with pytest.raises(NotImplementedError, match=r"qwen3_moe.*activation gelu"):
        m(input_ids=ids)
    m = hc.build(hc.qwen3_moe, "flowmoe-bf16")
    experts = [mod for mod in m.modules() if hasattr(mod, "gate_up_proj")]
    experts[0].has_bias = True
    with pytest.raises(NotImplementedError, match=r"qwen3_moe.*expert biases"):
        m(input_ids=ids)
    experts[0].has_bias, experts[0]._is_expert_parallel = False, True
    with pytest.raises(NotImplementedError, match=r"expert parallelism"):
        m(input_ids=ids)


def test_bf16_parameters_run_and_train():
    """BF16 parameters: converted to FP32 masters at every forward; their gradients come back BF16."""
    ids = hc.batch()
    ref = hc.loss_and_grads(hc.build(hc.qwen3_moe, "eager"), ids)
    m = hc.build(hc.qwen3_moe, "flowmoe-bf16", dtype=torch.bfloat16)
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    assert m.model.layers[0].mlp.experts.gate_up_proj.grad.dtype == torch.bfloat16
    assert abs(float(out.loss) - float(ref[1])) < 0.05


def test_bench_hf_experts_tiny(tmp_path, capsys):
    """bench/hf_experts.py --device cpu --tiny: a table row per implementation and parameter mode with a
    finite tokens/s, and finite convergence losses per implementation (the repository's docs as text)."""
    bench = runpy.run_path(os.path.join(ROOT, "bench", "hf_experts.py"))
    out = tmp_path / "hf_experts.json"
    argv = ["--device", "cpu", "--tiny", "--data", os.path.join(ROOT, "docs"), "--json", str(out)]
    assert bench["main"](argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    impls = result["args"]["impls"]
    assert [(r["impl"], r["params"]) for r in result["speed"]] == [(i, p) for p in ("bf16", "fp32-autocast")
                                                                   for i in impls]
    for r in result["speed"]:
        assert "error" not in r, r
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
        assert all(math.isfinite(x) for x in r["losses"]), r
        assert f"| `{r['impl']}` |" in table
    summary = result["convergence"]["summary"]
    for impl in impls:
        assert all(math.isfinite(v) for v in summary[impl]["train_loss"] + summary[impl]["val_loss"]), impl
