"""A float64 PyTorch reference of the flowmoe MoE function (include/flowmoe/moe.h) for tests.

loss = <y, dy> + aux_loss, differentiated by autograd in float64 on the unrounded FP32 masters:
the library rounds weights and intermediates (bf16 recipe: BF16 weights and activations, FP32
sums), so comparisons use a tolerance relative to the tensor's largest magnitude.
"""

import torch


def moe_reference(x, w1, w2, wr, *, topk, router="softmax", renormalize=False, routed_scaling=1.0,
                  aux_loss_coef=0.0, router_bias=None):
    """x [T, H] (any float dtype), w1 [E, 2F, H], w2 [E, H, F], wr [E, H] -> (y [T, H], aux) float64,
    differentiable with respect to float64 leaves passed in."""
    x = x.double()
    T, H = x.shape
    E = wr.shape[0]
    z = x @ wr.t()
    if router == "softmax":
        p = torch.softmax(z, dim=1)
    else:
        p = torch.sigmoid(z)
    sel = p.detach() + (router_bias.double() if router_bias is not None else 0.0)
    ids = torch.topk(sel, topk, dim=1).indices  # [T, k] in selection order
    probs = torch.gather(p, 1, ids)
    if renormalize:
        probs = probs / probs.sum(dim=1, keepdim=True)
    probs = probs * routed_scaling
    y = experts_reference(x, ids, probs, w1, w2)
    aux = torch.zeros((), dtype=torch.float64)
    if aux_loss_coef:
        f = torch.bincount(ids.flatten(), minlength=E).double() / (T * topk)
        P = p if router == "softmax" else p / p.sum(dim=1, keepdim=True)
        aux = aux_loss_coef * E * (f * P.mean(dim=0)).sum()
    return y, aux, ids


def swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


def experts_reference(x, ids, probs, w1, w2, *, b1=None, b2=None, act=swiglu, h_round=None):
    """The experts' part in float64: y_t = sum_s probs[t, s] * (W2_e act(gate, up) + b2_e),
    [gate; up] = W1_e x_t + b1_e with e = ids[t, s] (-1: slot dropped). w1 [E, 2F, H] (gate rows
    first), w2 [E, H, F], b1 [E, 2F], b2 [E, H]; act(gate, up) the activation; h_round(h) applied to
    GEMM1's output with its bias (e.g. a BF16 rounding with the identity's gradient). Differentiable
    in every float64 leaf passed in."""
    x, probs, w1, w2 = x.double(), probs.double(), w1.double(), w2.double()
    F = w2.shape[2]
    y = torch.zeros_like(x)
    for s in range(ids.shape[1]):
        for e in range(w1.shape[0]):  # per expert (the gathered weights of every token would be large)
            rows = (ids[:, s] == e).nonzero().flatten()
            if rows.numel() == 0:
                continue
            h = x[rows] @ w1[e].t()
            if h_round is not None:
                h = h_round(h)
            if b1 is not None:
                h = h + b1.double()[e]
            if h_round is not None:
                h = h_round(h)
            o = act(h[:, :F], h[:, F:]) @ w2[e].t()
            if b2 is not None:
                o = o + b2.double()[e]
            y = y.index_add(0, rows, probs[rows, s:s + 1] * o)
    return y
