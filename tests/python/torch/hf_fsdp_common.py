"""Shared model, data and optimizer of the FSDP2 CPU test (test_hf_fsdp.py) and its worker."""

import torch

import hf_common as hc

WORLD = 2
B = 2  # sequences per rank per step (the reference takes the WORLD ranks' sequences at once)
LR = 1e-3


def model(impl):
    return hc.build(hc.qwen3_moe, impl, seed=1)


def optimizer(m):
    # (plain AdamW: the same algorithm on DTensors and on plain tensors)
    return torch.optim.AdamW(m.parameters(), lr=LR, foreach=False)


def rank_batch(step, rank):
    return hc.batch(seed=1000 + 10 * step + rank, b=B)


def full_batch(step):
    return torch.cat([rank_batch(step, r) for r in range(WORLD)])


def eval_batch():
    return hc.batch(seed=7, b=2)
