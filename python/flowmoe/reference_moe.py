"""A plain PyTorch BF16 MoE FFN with the parameters and semantics of `flowmoe.torch.MoE`.

It is the speed baseline of the whole-model comparison (bench/convergence/speed.py) and lets the
trainer run without the native library (`python -m flowmoe.train --moe torch`). Nothing here is
tuned: eager PyTorch, autograd does the backward, written the way bench/torch_moe_layer.py writes
the layer.

The function (include/flowmoe/moe.h, top comment):
    logits z [T, E] fp32 = x . Wr^T                     (FP32, autocast off)
    ids, p   [T, k]      = top-k over softmax(z) or sigmoid(z) (+ router bias, selection only),
                           optionally renormalised over the k chosen, times routed_scaling
    per routed (t, s) with expert e:
        h  = W1_e . x_t          [2F]  (gate = h[:F], up = h[F:])      BF16 GEMM, FP32 accumulate
        a' = p[t, s] * silu(gate) * up                                   (probability in the SwiGLU)
        o  = W2_e . a'           [H]
    y_t = sum_s o_(t, s)
    aux = coef * E * sum_e f_e * P_e   (Switch Transformer; f_e = routed share of e, a constant;
                                        P_e = mean over tokens of softmax p_e, or s_e / sum s)
The aux loss is not returned: `moe.aux_loss` holds it detached and its gradient (d total / d aux
= 1) is applied inside the layer's backward, as flowmoe's layer does, so callers only call
`loss.backward()` on their own loss.

Parameters are FP32 masters (w1 [E, 2F, H] with gate rows [0, F) and up rows [F, 2F), w2 [E, H, F],
wr [E, H]); the forward casts w1 and w2 to BF16 (as autocast does for nn.Linear). Input of any
other dtype is converted to BF16, except FP32 input, which computes in FP32 (the CPU smoke
configuration: BF16 matmuls are slow on most CPUs).
On CUDA the expert GEMMs use torch._grouped_mm over the ragged expert segments when this PyTorch
has it; elsewhere (CPU, or an older PyTorch) one matmul per expert.
"""

from ._errors import require_torch

require_torch("flowmoe.reference_moe")  # where PyTorch is missing: an error naming pip install '.[torch]'
import torch  # noqa: E402
import torch.nn.functional as F

ROUTERS = ("softmax", "sigmoid")


class _AddAuxGradient(torch.autograd.Function):
    """Returns y unchanged; its backward also sends gradient 1 into `aux` (d total / d aux = 1)."""

    @staticmethod
    def forward(ctx, y, aux):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return dy, torch.ones((), dtype=torch.float32, device=dy.device)


def init_moe_parameters(w1, w2, wr, generator=None, residual_scale=1.0):
    """Normal init of a standard MoE FFN: W1 and Wr std H^-1/2, W2 std F^-1/2 * residual_scale.
    Writes in place under no_grad (the parameters' version counters move, so a layer that caches
    quantized weights sees the change)."""
    E, two_f, H = w1.shape
    f = two_f // 2
    with torch.no_grad():
        for p, std in ((w1, H ** -0.5), (w2, f ** -0.5 * residual_scale), (wr, H ** -0.5)):
            v = torch.randn(p.shape, generator=generator, dtype=torch.float32) * std
            p.copy_(v.to(p.device))


class ReferenceMoE(torch.nn.Module):
    """BF16 MoE FFN in plain PyTorch; the constructor mirrors flowmoe.torch.MoE's (recipe fixed
    to BF16; `align` and `max_tokens` accepted for the same call signature, unused)."""

    def __init__(self, hidden, ffn, experts, topk, *, recipe="bf16", router="softmax", renormalize=False,
                 routed_scaling=1.0, aux_loss_coef=0.0, align=1, router_bias=False, max_tokens=None,
                 seed=None, device=None, gemm="auto", param_dtype=torch.float32, pad_groups=1):
        super().__init__()
        if recipe != "bf16":
            raise ValueError(f"ReferenceMoE computes the bf16 recipe only, got recipe={recipe!r}")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        if not 1 <= topk <= experts:
            raise ValueError(f"topk must be in 1..experts ({experts}), got {topk}")
        self.hidden, self.ffn, self.experts, self.topk = hidden, ffn, experts, topk
        self.router, self.renormalize, self.routed_scaling = router, renormalize, routed_scaling
        self.aux_loss_coef = aux_loss_coef
        self.gemm = gemm  # "auto": grouped on CUDA when available, else "loop"
        # the layer benchmark (bench/torch_moe_layer.py) keeps w1, w2 in BF16 (no cast per forward)
        # and may pad each expert's rows to a multiple of pad_groups (torch._grouped_mm alignment)
        self.pad_groups = int(pad_groups)
        device = torch.device(device) if device is not None else None
        self.w1 = torch.nn.Parameter(torch.empty(experts, 2 * ffn, hidden, device=device, dtype=param_dtype))
        self.w2 = torch.nn.Parameter(torch.empty(experts, hidden, ffn, device=device, dtype=param_dtype))
        self.wr = torch.nn.Parameter(torch.empty(experts, hidden, device=device))
        if router_bias:
            self.register_buffer("router_bias", torch.zeros(experts, device=device))
        else:
            self.router_bias = None
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        init_moe_parameters(self.w1, self.w2, self.wr, generator=g)
        self.aux_loss = torch.zeros(())
        self.last_counts = None  # [E] routed rows per expert of the last forward (detached)

    def extra_repr(self):
        return (f"hidden={self.hidden}, ffn={self.ffn}, experts={self.experts}, topk={self.topk}, "
                f"router={self.router}, renormalize={self.renormalize}, aux_loss_coef={self.aux_loss_coef}")

    def _gemm_mode(self, xs):
        if self.gemm != "auto":
            return self.gemm
        grouped = xs.device.type == "cuda" and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
        return "grouped" if grouped else "loop"

    def route(self, x):
        """x [T, H] -> probs [T, k] fp32, ids [T, k] int64, scores [T, E] fp32 (for the aux loss)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.wr.float())                    # [T, E] fp32
            scores = torch.sigmoid(logits) if self.router == "sigmoid" else torch.softmax(logits, dim=-1)
            if self.router_bias is not None:
                _, ids = torch.topk(scores + self.router_bias, self.topk, dim=-1)
                probs = scores.gather(1, ids)
            else:
                probs, ids = torch.topk(scores, self.topk, dim=-1)
            if self.renormalize:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return probs * self.routed_scaling, ids, scores

    def _aux(self, scores, counts, tokens):
        p = scores if self.router == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        f = counts.to(torch.float32) / float(tokens * self.topk)          # constant, no gradient
        return self.aux_loss_coef * self.experts * torch.sum(f * p.mean(dim=0))

    def _experts(self, xs, w, counts):
        """xs [M, H] bf16 rows grouped by expert (counts [E]), w [M, 1] their probabilities."""
        w1 = self.w1.to(xs.dtype)
        w2 = self.w2.to(xs.dtype)
        if self._gemm_mode(xs) == "grouped":
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)         # [M, 2F]
            gate, up = h.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up * w, w2.transpose(-2, -1), offs=offs)
        outs = []
        sizes = counts.tolist()
        for e, (chunk, we) in enumerate(zip(torch.split(xs, sizes), torch.split(w, sizes))):
            if chunk.shape[0] == 0:
                continue
            gate, up = (chunk @ w1[e].t()).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up * we) @ w2[e].t())
        return torch.cat(outs) if outs else xs.new_zeros(0, self.hidden)

    def _padded_experts(self, xs, w, counts, expert_of_row):
        a = self.pad_groups
        padded = (counts + a - 1) // a * a
        start = torch.cumsum(counts, 0) - counts
        pstart = torch.cumsum(padded, 0) - padded
        rows = pstart[expert_of_row] + torch.arange(xs.shape[0], device=xs.device) - start[expert_of_row]
        mp = int(padded.sum())  # host sync
        xp = xs.new_zeros(mp, self.hidden).index_copy(0, rows, xs)
        wp = w.new_zeros(mp, 1).index_copy(0, rows, w)
        return self._experts(xp, wp, padded).index_select(0, rows)

    def forward(self, x):
        shape = x.shape
        if shape[-1] != self.hidden:
            raise ValueError(f"x has hidden size {shape[-1]}, expected {self.hidden}")
        # BF16 compute (FP32 input computes in FP32: the CPU smoke configuration, where BF16
        # matmuls are slow)
        dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
        x2 = x.reshape(-1, self.hidden).to(dtype)
        t = x2.shape[0]
        probs, ids, scores = self.route(x2)
        flat = ids.reshape(-1)                                   # [T*k] expert of each (token, slot)
        order = torch.argsort(flat, stable=True)                 # rows grouped by expert
        token = order // self.topk
        counts = torch.bincount(flat, minlength=self.experts)
        self.last_counts = counts.detach()
        xs = x2.index_select(0, token)                           # permute [T*k, H]
        w = probs.reshape(-1).index_select(0, order).unsqueeze(1).to(dtype)
        with torch.autocast(device_type=x2.device.type, enabled=False):
            if self.pad_groups > 1:  # every expert's rows padded with zero rows to a multiple
                ys = self._padded_experts(xs, w, counts, flat[order])
            else:
                ys = self._experts(xs, w, counts)
        y = torch.zeros_like(x2).index_add_(0, token, ys)        # combine (unpermute + sum)
        if self.aux_loss_coef > 0.0:
            with torch.autocast(device_type=x2.device.type, enabled=False):
                aux = self._aux(scores, counts, t)
            self.aux_loss = aux.detach()
            if torch.is_grad_enabled() and y.requires_grad:
                y = _AddAuxGradient.apply(y, aux)
        else:
            self.aux_loss = torch.zeros((), device=x2.device)
        return y.reshape(shape).to(x.dtype)

    # The same introspection calls as flowmoe.torch.MoE, with what a plain layer can say.
    def status(self):
        return {"nonfinite": 0, "underflow": 0, "aux_loss": float(self.aux_loss)}

    def cast_report(self):
        return None


def expert_flops_per_token(hidden, ffn, topk):
    """Forward + backward FLOPs of the expert GEMMs per token (six GEMMs over the routed rows)."""
    return 18.0 * topk * hidden * ffn


__all__ = ["ReferenceMoE", "init_moe_parameters", "expert_flops_per_token"]
