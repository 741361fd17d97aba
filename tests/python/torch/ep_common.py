"""Shared inputs of the expert-parallel CPU test and its worker."""

import torch

from flowmoe.torch import MoE

H, F, E, K = 128, 128, 4, 2
EP_RECIPES = ("bf16", "fp8-naive", "flow", "flow-fp4")
TOKENS = (24, 17)  # tokens of rank 0 and rank 1 (T may differ between ranks)


def ep_module(recipe, ep_group=None):
    return MoE(H, F, E, K, recipe=recipe, seed=5, max_tokens=sum(TOKENS), ep_group=ep_group,
               align=16, router="sigmoid", renormalize=True)


def ep_inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS[rank], H, generator=g).bfloat16()
    dy = torch.randn(TOKENS[rank], H, generator=g).bfloat16()
    return x, dy
