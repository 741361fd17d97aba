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
    F = w2.shape[2]
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
    y = torch.zeros(T, H, dtype=torch.float64)
    for s in range(topk):
        for e in range(E):
            rows = (ids[:, s] == e).nonzero().flatten()
            if rows.numel() == 0:
                continue
            h = x[rows] @ w1[e].t()
            gate, up = h[:, :F], h[:, F:]
            a = probs[rows, s:s + 1] * torch.nn.functional.silu(gate) * up
            y = y.index_add(0, rows, a @ w2[e].t())
    aux = torch.zeros((), dtype=torch.float64)
    if aux_loss_coef:
        f = torch.bincount(ids.flatten(), minlength=E).double() / (T * topk)
        P = p if router == "softmax" else p / p.sum(dim=1, keepdim=True)
        aux = aux_loss_coef * E * (f * P.mean(dim=0)).sum()
    return y, aux, ids
