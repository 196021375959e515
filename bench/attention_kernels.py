"""Attention over the cell pools two ways, at decode and prefill shapes
(SmolLM2's heads: 9 query heads, 3 KV heads, head dim 64): sdpa over strided
views of the pools (what exporter/forwards.py runs) against products with a
materialized [H, T, C] score tensor and an explicit mask (what it ran
before, and still runs for soft-capped attention). Prints ms per call and
the largest difference between the two.

    python bench/attention_kernels.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import best_of, cpu_model, emit

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPES = [(1, 64), (1, 1024), (8, 1024), (8, 4096), (128, 640), (512, 512), (512, 1024), (2048, 2048)]


def products(q, k_pool, v_pool, mask):
    heads, tokens, head_dim = q.shape[1:]
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    scores = torch.bmm(q.reshape(kv_heads, group * tokens, head_dim), k_pool.permute(1, 2, 0)) * head_dim**-0.5
    scores = scores.view(kv_heads, group, tokens, -1).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, -1, dtype=torch.float32)
    out = torch.bmm(probs.view(kv_heads, group * tokens, -1), v_pool.permute(1, 0, 2))
    return out.unflatten(1, (group, tokens)).reshape(heads, tokens, head_dim).transpose(0, 1).unsqueeze(0)


def sdpa(q, k_pool, v_pool, mask):
    k, v = k_pool.permute(1, 0, 2).unsqueeze(0), v_pool.permute(1, 0, 2).unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def main() -> None:
    rows = []
    for tokens, cells in SHAPES:
        q = torch.randn(1, HEADS, tokens, HEAD_DIM)
        k_pool, v_pool = torch.randn(cells, KV_HEADS, HEAD_DIM), torch.randn(cells, KV_HEADS, HEAD_DIM)
        mask = torch.arange(cells)[None, :] <= (torch.arange(tokens) + cells - tokens)[:, None]
        diff = float((products(q, k_pool, v_pool, mask) - sdpa(q, k_pool, v_pool, mask)).abs().max())
        ms = {f.__name__: best_of(lambda: f(q, k_pool, v_pool, mask), 5) * 1e3 for f in (products, sdpa)}
        rows.append({"tokens": tokens, "cells": cells, "products_ms": round(ms["products"], 3), "sdpa_ms": round(ms["sdpa"], 3),
                     "products_over_sdpa": round(ms["products"] / ms["sdpa"], 2), "max_abs_diff": diff})
    emit({"cpu": cpu_model(), "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
