"""flowmoe as a Hugging Face transformers experts backend (issue 31; docs/HF.md).

``import flowmoe.hf`` registers, in ``transformers.integrations.moe.ExpertsInterface``:

    "flowmoe"            = "flowmoe-flow"
    "flowmoe-bf16"       BF16 GEMMs (the reference recipe)
    "flowmoe-blockwise"  FP8, quantized from BF16 before each GEMM
    "flowmoe-fp8-naive"  FP8 with FP32 scales
    "flowmoe-flow"       FP8 dataflow, scaling-aware transposes
    "flowmoe-flow-fp4"   MXFP4 dispatch and saved activations, FP8 GEMMs

and a model picks one with ``from_pretrained(..., experts_implementation="flowmoe-flow")`` (or
``from_config``, ``model.set_experts_implementation``). The routing stays the model's (its router,
top-k, normalisation, bias, group limits: HF computes ``top_k_index`` / ``top_k_weights``); flowmoe
runs the experts (``flowmoe.torch.experts``) with gradients for the hidden states, the expert
weights and the routing weights, so the router trains as with "eager".

Weights: FP32 and BF16 parameters are used in place (BF16 parameters are the layer's BF16 copies,
quantized straight from the parameters: the bits of FP32 masters holding the same values). FP16
parameters are converted to FP32 at every forward (an FP32 copy alive during the forward).
Gradients come back in the parameters' dtype (summed in FP32; for BF16 parameters rounded once, by
the wgrad itself). On CUDA the layer runs without host synchronisation (``sync_free``: no wait for
the routing counts or the weights' finite check in a forward, so the host keeps queueing the model's
kernels); ``flowmoe.hf.SYNC_FREE = False`` brings back the synchronising layer, which raises on
non-finite weights at the forward instead of counting them (``status()``).

Refused, with the model and what is missing named (never run wrong): experts with bias, without a
gate (gate_up_proj), with an activation other than SiLU (SwiGLU), a custom gating function, a
post-expert norm, transposed or interleaved weight layouts, expert parallelism, hidden or
intermediate sizes that are not multiples of 128, more experts or a larger top-k than the layer
supports.
"""

from __future__ import annotations

import torch
from torch import nn

from .torch import experts

try:
    from transformers.integrations import moe as _hf_moe
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("flowmoe.hf needs transformers >= 5 (transformers.integrations.moe.ExpertsInterface): "
                      f"pip install 'transformers>=5' ({e})") from e

__all__ = ["IMPLEMENTATIONS", "SYNC_FREE", "register", "check_experts_module"]

# CUDA: the experts layer without host synchronisation (read at each call; see the module docstring)
SYNC_FREE = True

# experts_implementation name -> flowmoe recipe
IMPLEMENTATIONS = {
    "flowmoe": "flow",
    "flowmoe-bf16": "bf16",
    "flowmoe-blockwise": "blockwise",
    "flowmoe-fp8-naive": "fp8-naive",
    "flowmoe-flow": "flow",
    "flowmoe-flow-fp4": "flow-fp4",
}


def _model_name(module) -> str:
    cfg = getattr(module, "config", None)
    mt = getattr(cfg, "model_type", None)
    return f"{mt} ({type(module).__name__})" if mt else type(module).__name__


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # pragma: no cover
        return False
    return type(act) is SiLUActivation


def check_experts_module(module, top_k: int = None) -> None:
    """Raises NotImplementedError naming the model and what flowmoe lacks, when ``module`` (a
    transformers experts module) is not the computation flowmoe's layer runs."""
    name = _model_name(module)
    missing = []
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        missing.append("experts without a gate (up_proj only); flowmoe runs gated SwiGLU experts (gate_up_proj)")
    if getattr(module, "has_bias", False):
        missing.append("expert biases (gate_up_proj_bias / down_proj_bias)")
    if getattr(module, "has_post_expert_norm", False):
        missing.append("a post-expert norm")
    if getattr(module, "is_transposed", False):
        missing.append("transposed expert weights (is_transposed); expected gate_up_proj [E, 2F, H], down_proj [E, H, F]")
    if not getattr(module, "is_concatenated", True):
        missing.append("interleaved gate/up rows (is_concatenated=False); expected the gate rows first, then up")
    if getattr(module, "_is_expert_parallel", False):
        missing.append("transformers' expert parallelism (sentinel expert ids); use flowmoe.torch.MoE's ep_group")
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate is not _hf_moe._default_apply_gate:
        missing.append(f"a custom gating function ({type(module).__name__}._apply_gate); flowmoe computes "
                       "silu(gate) * up")
    act = getattr(module, "act_fn", None)
    if act is None or not _is_silu(act):
        hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
        missing.append(f"the activation {hidden_act or type(act).__name__}; flowmoe computes SiLU (SwiGLU) only")
    if not missing and hasattr(module, "gate_up_proj"):
        w1, w2 = module.gate_up_proj, getattr(module, "down_proj", None)
        if w2 is None or w1.dim() != 3 or w2.dim() != 3:
            missing.append("3D gate_up_proj [E, 2F, H] and down_proj [E, H, F] parameters")
        else:
            E, F2, H = w1.shape
            F = F2 // 2
            if H % 128:
                missing.append(f"hidden size {H}, not a multiple of 128 (flowmoe's 1x128 FP8 tiles; every recipe "
                               "shares them)")
            if F % 128:
                missing.append(f"intermediate size {F} (moe_intermediate_size), not a multiple of 128")
            if E > 1024:
                missing.append(f"{E} experts; flowmoe's layer takes at most 1024")
            if top_k is not None and top_k > 32:
                missing.append(f"top-k {top_k}; flowmoe's layer takes at most 32")
    if missing:
        raise NotImplementedError(f"flowmoe.hf: {name} cannot run on flowmoe: " + "; ".join(missing) +
                                  ". Use experts_implementation='grouped_mm' or 'eager' for this model.")


def _experts_function(recipe: str, impl: str):
    def flowmoe_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "_flowmoe_checked", False):
            check_experts_module(self, int(top_k_index.shape[-1]))
            self._flowmoe_checked = True
        return experts(hidden_states, top_k_index.reshape(-1, top_k_index.shape[-1]),
                       top_k_weights.reshape(-1, top_k_weights.shape[-1]), self.gate_up_proj, self.down_proj,
                       recipe=recipe, owner=self, sync_free=SYNC_FREE and hidden_states.is_cuda)

    flowmoe_experts_forward.__name__ = f"flowmoe_experts_forward_{recipe.replace('-', '_')}"
    flowmoe_experts_forward.__doc__ = f"transformers experts_implementation={impl!r}: flowmoe recipe {recipe!r}."
    return flowmoe_experts_forward


def register() -> None:
    """Registers every name of IMPLEMENTATIONS in transformers' ExpertsInterface (done on import)."""
    for impl, recipe in IMPLEMENTATIONS.items():
        _hf_moe.ExpertsInterface.register(impl, _experts_function(recipe, impl))


register()
