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

gpt-oss (issue 46): expert biases (gate_up_proj_bias: added by the layer before the activation;
down_proj_bias: sum_k p_k b2[e_k], added by flowmoe.torch.experts), the clamped SwiGLU
(_apply_gate, recognised by evaluating it on a probe), transposed weights and interleaved gate/up
columns (relaid into the layer's layout at every forward by differentiable copies, which the
autograd node keeps until the backward; the gradients come back in the parameters' layout), and
hidden / intermediate sizes that are not multiples of 128 (zero-padded to the next multiple).

Refused, with the model and what is missing named (never run wrong): experts without a gate
(gate_up_proj), with an activation other than SiLU or the clamped SwiGLU, another custom gating
function, a post-expert norm, expert parallelism, and any configuration the layer itself refuses
(more experts or a larger top-k than it supports, biases with fp8-naive...): those are asked of the
library (flowmoe.torch.experts' ``refusal``: the C ABI's flowmoe_config_check) and named in its words.
"""

from __future__ import annotations

from ._errors import require_torch

require_torch("flowmoe.hf")  # where PyTorch is missing: an error naming pip install '.[torch]'
import torch  # noqa: E402
from torch import nn

from ._recipes import RECIPES
from .experts import refusal
from .torch import experts

try:
    from transformers.integrations import moe as _hf_moe
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("flowmoe.hf needs transformers >= 5 (transformers.integrations.moe.ExpertsInterface): "
                      f"pip install 'transformers>=5' ({e})") from e

__all__ = ["IMPLEMENTATIONS", "SYNC_FREE", "register", "check_experts_module", "experts_options"]

# CUDA: the experts layer without host synchronisation (read at each call; see the module docstring)
SYNC_FREE = True

# experts_implementation name -> flowmoe recipe: "flowmoe" (the flow recipe) and "flowmoe-<recipe>"
# for every recipe of the table
IMPLEMENTATIONS = {"flowmoe": "flow", **{f"flowmoe-{r}": r for r in RECIPES}}


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


def _clamped_gate_params(module):
    """(alpha, limit) when module._apply_gate is gpt-oss's clamped SwiGLU on interleaved gate/up
    columns (checked by evaluating it on a probe, not by its name), else None."""
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)) or not limit > 0:
        return None
    g = torch.linspace(-3 * limit, 3 * limit, 64, dtype=torch.float32)
    probe = torch.stack([g, g.flip(0) * 0.7], dim=-1).reshape(1, -1)  # gate, up interleaved
    try:
        with torch.no_grad():
            got = type(module)._apply_gate(module, probe)
    except Exception:  # noqa: BLE001 - a gate we cannot probe is not one we run
        return None
    gate, up = probe[..., 0::2].clamp(max=limit), probe[..., 1::2].clamp(-limit, limit)
    want = (up + 1) * gate * torch.sigmoid(gate * alpha)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        return None
    return float(alpha), float(limit)


def experts_options(module, recipe: str, top_k: int = None) -> dict:
    """The flowmoe.torch.experts options that compute ``module`` (a transformers experts module):
    layout, activation and biases. Raises NotImplementedError naming the model and what flowmoe
    lacks when it is not a computation flowmoe's layer runs."""
    name = _model_name(module)
    missing = []
    opts = {"transposed": bool(getattr(module, "is_transposed", False)),
            "interleaved": not getattr(module, "is_concatenated", True)}
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        missing.append("experts without a gate (up_proj only); flowmoe runs gated experts (gate_up_proj)")
    if getattr(module, "has_bias", False):
        b1, b2 = getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None)
        if b1 is None or b2 is None:
            missing.append("expert biases other than gate_up_proj_bias and down_proj_bias")
        opts["biases"] = True
    if getattr(module, "has_post_expert_norm", False):
        missing.append("a post-expert norm")
    if getattr(module, "_is_expert_parallel", False):
        missing.append("transformers' expert parallelism (sentinel expert ids); use flowmoe.torch.MoE's ep_group")
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate is not _hf_moe._default_apply_gate:
        clamped = _clamped_gate_params(module) if opts["interleaved"] else None
        if clamped is None:
            missing.append(f"a custom gating function ({type(module).__name__}._apply_gate); flowmoe computes "
                           "silu(gate) * up or gpt-oss's clamped SwiGLU on interleaved gate/up")
        else:
            opts.update(activation="clamped-swiglu", swiglu_alpha=clamped[0], swiglu_limit=clamped[1])
    else:
        act = getattr(module, "act_fn", None)
        if act is None or not _is_silu(act):
            hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
            missing.append(f"the activation {hidden_act or type(act).__name__}; flowmoe computes SiLU (SwiGLU) "
                           "or gpt-oss's clamped SwiGLU")
    if not missing and hasattr(module, "gate_up_proj"):
        w1, w2 = module.gate_up_proj, getattr(module, "down_proj", None)
        if w2 is None or w1.dim() != 3 or w2.dim() != 3:
            missing.append("3D gate_up_proj and down_proj parameters")
        else:
            # the layer's own rules (experts, top-k, biases with the recipe...): asked of the library,
            # for the configuration flowmoe.torch.experts would build (H and F zero-padded)
            E, a, b = (int(n) for n in w1.shape)
            H, F = (a, b // 2) if opts["transposed"] else (b, a // 2)  # w1 [E, H, 2F] or [E, 2F, H]
            act = ("swiglu", 1.702, 7.0)
            if "activation" in opts:
                act = (opts["activation"], opts["swiglu_alpha"], opts["swiglu_limit"])
            reason = refusal(E, H, F, 1 if top_k is None else int(top_k), recipe, activation=act,
                             gemm1_bias=bool(opts.get("biases")))
            if reason:
                missing.append(f"a configuration the layer refuses ({reason})")
    if missing:
        raise NotImplementedError(f"flowmoe.hf: {name} cannot run on flowmoe: " + "; ".join(missing) +
                                  ". Use experts_implementation='grouped_mm' or 'eager' for this model.")
    return opts


def check_experts_module(module, top_k: int = None, recipe: str = "flow") -> None:
    """Raises NotImplementedError naming the model and what flowmoe lacks, when ``module`` (a
    transformers experts module) is not the computation flowmoe's layer runs."""
    experts_options(module, recipe, top_k)


def _experts_function(recipe: str, impl: str):
    def flowmoe_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
        opts = getattr(self, "_flowmoe_options", None)
        if opts is None or opts[0] != recipe:
            opts = (recipe, experts_options(self, recipe, int(top_k_index.shape[-1])))
            self._flowmoe_options = opts
        kw = dict(opts[1])
        if kw.pop("biases", False):
            kw.update(b1=self.gate_up_proj_bias, b2=self.down_proj_bias)
        return experts(hidden_states, top_k_index.reshape(-1, top_k_index.shape[-1]),
                       top_k_weights.reshape(-1, top_k_weights.shape[-1]), self.gate_up_proj, self.down_proj,
                       recipe=recipe, owner=self, sync_free=SYNC_FREE and hidden_states.is_cuda, **kw)

    flowmoe_experts_forward.__name__ = f"flowmoe_experts_forward_{recipe.replace('-', '_')}"
    flowmoe_experts_forward.__doc__ = f"transformers experts_implementation={impl!r}: flowmoe recipe {recipe!r}."
    return flowmoe_experts_forward


def register() -> None:
    """Registers every name of IMPLEMENTATIONS in transformers' ExpertsInterface (done on import)."""
    for impl, recipe in IMPLEMENTATIONS.items():
        _hf_moe.ExpertsInterface.register(impl, _experts_function(recipe, impl))


register()
