"""Liger kernels with flowmoe experts (issue 53): what ``apply_liger_kernel_to_qwen3_moe`` replaces, and
whether the experts stay with ``experts_implementation``. Liger's kernels are Triton GPU kernels, so on
the CPU only the patch itself is applied and the experts modules are called (they need no Liger
kernel once the experts are left alone); the GPU test trains a Liger-patched model with flowmoe experts
against the unpatched one.

Read from liger-kernel 0.8.5's source (liger_kernel/transformers/monkey_patch.py) with transformers
5.25: the patch replaces RoPE (``apply_rotary_pos_emb``), RMSNorm (the class in the module, and on an
instance the forward of every norm, q_norm and k_norm included), the causal-LM forward (fused linear
cross-entropy) and, with ``swiglu=True`` (its default; transformers >= 5), the experts: the module's
``Qwen3MoeExperts`` becomes ``LigerExperts`` and, on an instance, every ``mlp.experts.forward`` is
``LigerExperts.forward`` (Liger's fused MoE), which bypasses ``experts_implementation``: flowmoe no
longer runs. With ``swiglu=False`` (TrainingArguments(liger_kernel_config={"swiglu": False}) for
Trainer / TRL's use_liger_kernel) the experts stay flowmoe's. The module-level replacements happen even
when a model instance is given, so these tests restore the transformers module afterwards."""

import os
import runpy

import pytest
import torch

import hf_common as hc

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

transformers = hc.transformers


def _liger():
    try:
        import liger_kernel.transformers as lt
    except ImportError as e:  # not installed, or its triton / torch missing
        pytest.skip(f"liger-kernel is not importable ({e}): pip install liger-kernel")
    return lt


@pytest.fixture
def restore_qwen3_moe():
    """Liger patches transformers' qwen3_moe module globally (RoPE, RMSNorm, the experts class, with or
    without a model instance): put it back so that later tests build unpatched models (the stack
    benchmark's restorer, bench/hf_stack.py, which its Liger rows use too)."""
    restored = runpy.run_path(os.path.join(ROOT, "bench", "hf_stack.py"))["restored_qwen3_moe"]
    with restored() as mod:
        yield mod


def _experts_outputs(model, seed=3, tokens=40):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for i, layer in enumerate(model.model.layers):
        x = torch.randn(tokens, hc.H, generator=g)
        with torch.no_grad():
            res = layer.mlp.gate(x)
            weights, index = res[-2], res[-1]
            outs.append(layer.mlp.experts(x, index, weights))
    return outs


def _is_flowmoe(experts):
    return getattr(experts, "_flowmoe_options", None) is not None


def test_liger_default_replaces_the_experts(restore_qwen3_moe):
    """Liger's default (swiglu=True) takes the experts away from experts_implementation."""
    lt = _liger()
    from liger_kernel.transformers.swiglu import LigerExperts

    model = hc.build(hc.qwen3_moe, "flowmoe-flow")
    lt.apply_liger_kernel_to_qwen3_moe(model=model)
    mod = restore_qwen3_moe
    assert mod.Qwen3MoeExperts is LigerExperts, "the module's experts class is Liger's"
    for layer in model.model.layers:
        fwd = layer.mlp.experts.forward
        assert getattr(fwd, "__func__", None) is LigerExperts.forward, \
            "Liger binds its fused MoE forward to each experts module: flowmoe does not run"


def test_liger_without_swiglu_keeps_flowmoe_experts(restore_qwen3_moe):
    """With swiglu=False the experts modules still dispatch through experts_implementation to flowmoe
    (called here on the CPU: no Liger kernel runs in them), giving the unpatched model's outputs; the
    rest is Liger's (norms, the causal-LM forward, RoPE)."""
    lt = _liger()
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    ref = hc.build(hc.qwen3_moe, "flowmoe-flow")
    ref_out = _experts_outputs(ref)
    model = hc.build(hc.qwen3_moe, "flowmoe-flow")
    cls_forward = type(model.model.layers[0].mlp.experts).forward
    lt.apply_liger_kernel_to_qwen3_moe(model=model, swiglu=False)
    mod = restore_qwen3_moe
    assert mod.Qwen3MoeExperts is not None and "Liger" not in mod.Qwen3MoeExperts.__name__
    assert mod.Qwen3MoeRMSNorm is LigerRMSNorm and mod.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
    for layer in model.model.layers:
        assert "forward" not in vars(layer.mlp.experts), "the experts module's forward is left alone"
        assert type(layer.mlp.experts).forward is cls_forward
        assert getattr(layer.input_layernorm.forward, "__func__", None) is LigerRMSNorm.forward
        assert getattr(layer.self_attn.q_norm.forward, "__func__", None) is LigerRMSNorm.forward
    assert model.forward.__func__.__module__.startswith("liger_kernel"), "fused linear cross-entropy forward"
    got = _experts_outputs(model)
    for i, (a, b) in enumerate(zip(got, ref_out)):
        assert _is_flowmoe(model.model.layers[i].mlp.experts), f"layer {i}: the experts ran on flowmoe"
        assert torch.equal(a, b), f"layer {i}: {hc.rel(a, b)}"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["flowmoe-bf16", "flowmoe-flow"])
def test_gpu_liger_patched_model_trains_like_unpatched(restore_qwen3_moe, impl):
    """A couple of steps of the Liger-patched model (swiglu=False: flowmoe keeps the experts) against
    the unpatched model with the same experts implementation: losses within the recipe's loss bound."""
    lt = _liger()
    ref = hc.build(hc.qwen3_moe, impl, device="cuda")
    ref_losses = hc.train_losses(ref, steps=3, device="cuda")
    model = hc.build(hc.qwen3_moe, impl, device="cuda")
    lt.apply_liger_kernel_to_qwen3_moe(model=model, swiglu=False)
    losses = hc.train_losses(model, steps=3, device="cuda")
    assert all(_is_flowmoe(layer.mlp.experts) for layer in model.model.layers)
    bound = hc.BOUNDS[impl.split("-", 1)[1]][1]
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    assert max(diffs) < bound, f"Liger {losses} against unpatched {ref_losses}"
    assert losses[-1] < losses[0]
