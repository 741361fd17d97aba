"""A decoder-only MoE language model for the training entry point and the experiments.

    tokens -> embedding -> L x [x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x))] -> RMSNorm -> tied head

- RMSNorm in FP32 with a learned scale; rotary position embedding on queries and keys; causal
  attention through F.scaled_dot_product_attention; no biases; the output head is the embedding
  matrix (tied).
- The FFN of every block is an MoE: `flowmoe.torch.MoE` with a recipe (`moe="flowmoe"`), or the
  plain PyTorch BF16 layer of flowmoe.reference_moe (`moe="torch"`). Both take [B, S, H] BF16 and
  return BF16; their aux loss is applied inside their backward (`moe.aux_loss` reports it).
- Precision: FP32 parameters (the optimizer's masters) and BF16 autocast for everything outside
  the MoE layers (the caller enters torch.autocast; train.py does on a GPU). The MoE layers run
  with autocast off on BF16 input: they keep FP32 masters and make their own BF16/FP8/MXFP4
  copies. Without autocast (train.py's CPU default, `--precision fp32`) the model runs in FP32,
  the reference MoE too; flowmoe's layer still takes BF16.
- Initialisation from one generator (`seed`), independent of the MoE implementation and recipe:
  N(0, 0.02) for the embedding and attention projections, output projections (attention out,
  expert W2) scaled by 1/sqrt(2L); expert W1 and the router N(0, H^-1/2), W2 N(0, F^-1/2/sqrt(2L)).
  So every recipe starts from the same weights.
"""

import dataclasses
import math

from ._errors import require_torch

require_torch("flowmoe.lm")  # where PyTorch is missing: an error naming pip install '.[torch]'
import torch  # noqa: E402
import torch.nn.functional as F

from .reference_moe import ReferenceMoE, init_moe_parameters

MOE_IMPLS = ("flowmoe", "torch")


@dataclasses.dataclass
class LMConfig:
    vocab: int = 256
    layers: int = 8
    hidden: int = 768
    heads: int = 6
    ffn: int = 512            # per expert
    experts: int = 16
    topk: int = 2
    seq_len: int = 512
    router: str = "softmax"
    renormalize: bool = False
    aux_loss_coef: float = 0.01
    align: int = 128
    # flowmoe's flow / flow-fp4: the exponent rule of the column-wise copies (row-max: SPEC §4;
    # column-amax: each column block's own amax, docs/NUMERICS.md §6)
    transpose_exponent: str = "row-max"

    def validate(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"head dimension {self.hidden // self.heads} must be even (rotary)")

    def params(self):
        """(total, active per token) parameter counts, embedding included once."""
        h, f, e, k, L = self.hidden, self.ffn, self.experts, self.topk, self.layers
        attn = 4 * h * h
        norms = 2 * h
        total = self.vocab * h + h + L * (attn + norms + e * 3 * h * f + e * h)
        active = self.vocab * h + h + L * (attn + norms + k * 3 * h * f + e * h)
        return total, active

    def train_flops_per_token(self):
        """6 x active matmul parameters + causal attention (forward + backward), per token."""
        h, f, k, L, s = self.hidden, self.ffn, self.topk, self.layers, self.seq_len
        dense = L * (4 * h * h + k * 3 * h * f + self.experts * h) + self.vocab * h
        return 6.0 * dense + L * 6.0 * s * h  # attention: 2 matmuls of S/2 (causal) x H, x3


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y


def rotary_tables(seq_len, head_dim, base=10000.0, device=None):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv)  # [S, D/2]
    return torch.cos(ang), torch.sin(ang)


def apply_rotary(x, cos, sin):
    """x [B, heads, S, D]; rotates the pairs (x[..., :D/2], x[..., D/2:]) in FP32."""
    d = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :d], xf[..., d:]
    c, s = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


class Attention(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = torch.nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.out = torch.nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, h))


def _autocast_enabled(device_type):
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # PyTorch < 2.4: no device argument
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


class MoEFFN(torch.nn.Module):
    """Runs an MoE layer with autocast off on BF16 input (flowmoe's layer always; the reference
    under autocast) or FP32 input (the reference without autocast: the CPU configuration)."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        bf16 = not isinstance(self.moe, ReferenceMoE) or _autocast_enabled(x.device.type)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.moe(x.to(torch.bfloat16 if bf16 else torch.float32))


class Block(torch.nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.hidden)
        self.ffn = MoEFFN(moe)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.ffn(self.norm2(x))


def make_moe(cfg, impl, recipe, max_tokens, device, seed):
    """One MoE FFN layer: flowmoe.torch.MoE(recipe) or the PyTorch BF16 reference."""
    kw = dict(router=cfg.router, renormalize=cfg.renormalize, aux_loss_coef=cfg.aux_loss_coef,
              align=cfg.align, max_tokens=max_tokens, seed=seed, device=device)
    if impl == "torch":
        if recipe != "bf16":
            raise ValueError(f"--moe torch is the plain PyTorch BF16 layer; it has no recipe {recipe!r} "
                             f"(use --moe flowmoe for the FP8/MXFP4 recipes)")
        return ReferenceMoE(cfg.hidden, cfg.ffn, cfg.experts, cfg.topk, recipe="bf16", **kw)
    if impl == "flowmoe":
        try:
            import flowmoe
            from flowmoe.torch import MoE
        except ImportError as err:
            raise ImportError(f"flowmoe.torch is not importable ({err}); build and install the package "
                              f"(`pip install .`), or train with --moe torch") from err
        if hasattr(flowmoe, "native_available") and not flowmoe.native_available():
            raise ImportError("flowmoe's native library is not built or not found; install the package "
                              "with `pip install .`, or train with --moe torch")
        return MoE(cfg.hidden, cfg.ffn, cfg.experts, cfg.topk, recipe=recipe,
                   transpose_exponent=cfg.transpose_exponent, **kw)
    raise ValueError(f"unknown MoE implementation {impl!r}; expected one of {MOE_IMPLS}")


class MoELM(torch.nn.Module):
    def __init__(self, cfg, moe="torch", recipe="bf16", max_tokens=None, device=None, seed=0):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.moe_impl, self.recipe = moe, recipe
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.hidden, device=device)
        self.blocks = torch.nn.ModuleList()
        # what each MoE layer was built from: fresh_moe(i) builds another from the same arguments
        self._moe_args = [(cfg, moe, recipe, max_tokens, device, seed * 1000 + i) for i in range(cfg.layers)]
        for i in range(cfg.layers):
            layer = make_moe(*self._moe_args[i])
            with torch.device(device):
                self.blocks.append(Block(cfg, layer))
        self.norm = RMSNorm(cfg.hidden).to(device)
        cos, sin = rotary_tables(cfg.seq_len, cfg.hidden // cfg.heads, device=device)
        self.register_buffer("rot_cos", cos, persistent=False)
        self.register_buffer("rot_sin", sin, persistent=False)
        self.reset_parameters(seed)

    def moe_layers(self):
        return [b.ffn.moe for b in self.blocks]

    def fresh_moe(self, i):
        """A new MoE layer built with the constructor arguments of layer i (its own initial
        weights: load_state_dict the trained layer's state into it)."""
        return make_moe(*self._moe_args[i])

    def freeze_experts(self):
        """Experts and router not trained (the frozen-experts control): w1, w2, wr of every MoE
        layer stop requiring gradients, so the optimizer (built afterwards) leaves them out."""
        for m in self.moe_layers():
            for p in (m.w1, m.w2, m.wr):
                p.requires_grad_(False)

    def reset_parameters(self, seed):
        g = torch.Generator().manual_seed(seed)
        out_scale = 1.0 / math.sqrt(2 * self.cfg.layers)

        def normal_(p, std):
            with torch.no_grad():
                p.copy_((torch.randn(p.shape, generator=g) * std).to(p.device, p.dtype))

        normal_(self.embed.weight, 0.02)
        for b in self.blocks:
            normal_(b.attn.qkv.weight, 0.02)
            normal_(b.attn.out.weight, 0.02 * out_scale)
            m = b.ffn.moe
            init_moe_parameters(m.w1, m.w2, m.wr, generator=g, residual_scale=out_scale)
            for n in (b.norm1, b.norm2):
                with torch.no_grad():
                    n.weight.fill_(1.0)
        with torch.no_grad():
            self.norm.weight.fill_(1.0)

    def forward(self, tokens, targets=None):
        """tokens [B, S] int64 -> logits [B, S, V] (FP32), or the mean cross-entropy with targets."""
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, self.rot_cos, self.rot_sin)
        logits = F.linear(self.norm(x), self.embed.weight).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
