"""Attention over the cell pools, at decode and prefill shapes (SmolLM2's
heads: 9 query heads, 3 KV heads, head dim 64): sdpa over strided views of
the pools (what exporter/forwards.py runs on the CPU) against products with
a materialized [H, T, C] score tensor and an explicit mask (what it runs on
CUDA and for soft-capped attention), and, for up to 16 rows,
kvexport's masked attention kernel (partitioners/aoti/kernels/masked_attention.cpp, what
aoti's forward_<N> methods run on x86). Prints ms per call and the largest
difference from sdpa.

One session's rows see every cell before them (a causal mask over the last
rows); "sessions": S rows, one per session, each seeing only its own
cells/S cells, as a batched decode step does.

One session's slice of a prompt ("slice": T rows over H earlier cells and
its own T) also goes through the masked attention shim as compiled methods
call it (for 256+ rows: dense sdpa over the earlier cells, causal over the
own, merged) beside sdpa through the mask; and one session's few rows over
30 layers' pools in turn, the kernel against sdpa (which the shim picks for
4+ fp32 rows that see most cells).

A decode step's rows (one a session) over 30 layers' pools evicted from the
caches before each step, as a package's decode step meets them: the kernel
beside a plain read of the same pools' bytes.

Several sessions' slices in one step (a server's prefill of several
prompts; one-row slices: decode rows past a static method's 16) go through
the shim, which takes them apart by session when its route says so, beside
sdpa through the mask: the figures that set the route's rule (shims.cpp).

    python bench/attention_kernels.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from common import best_of, cpu_model, emit

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPES = [(1, 64), (1, 1024), (8, 1024), (8, 4096), (128, 640), (512, 512), (512, 1024), (2048, 2048)]
SESSION_SHAPES = [(8, 8 * 96), (8, 8 * 256), (8, 8 * 1024)]  # (sessions, cells)


def products(q, k_pool, v_pool, mask):
    from kvexport.exporter.forwards import _attend_products

    return _attend_products(q, k_pool, v_pool, mask, None, None)


def sdpa(q, k_pool, v_pool, mask):
    k, v = k_pool.permute(1, 0, 2).unsqueeze(0), v_pool.permute(1, 0, 2).unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def masked_kernel(q, k_pool, v_pool, mask):
    from kvexport.partitioners.aoti.kernels.build import masked_attention

    k, v = k_pool.permute(1, 0, 2).unsqueeze(0), v_pool.permute(1, 0, 2).unsqueeze(0)
    return masked_attention(q, k, v, mask, q.shape[-1] ** -0.5).transpose(1, 2)


def measure(tokens: int, cells: int, mask: torch.Tensor) -> dict:
    from kvexport.partitioners.aoti.kernels.build import supported

    q = torch.randn(1, HEADS, tokens, HEAD_DIM)
    k_pool, v_pool = torch.randn(cells, KV_HEADS, HEAD_DIM), torch.randn(cells, KV_HEADS, HEAD_DIM)
    ways = [products, sdpa] + ([masked_kernel] if tokens <= 16 and supported() else [])
    want = sdpa(q, k_pool, v_pool, mask)
    diff = max(float((f(q, k_pool, v_pool, mask) - want).abs().max()) for f in ways)
    row = {"tokens": tokens, "cells": cells, "max_abs_diff_from_sdpa": diff}
    for f in ways:
        row[f"{f.__name__}_ms"] = round(best_of(lambda: f(q, k_pool, v_pool, mask), 5) * 1e3, 3)
    return row


SLICE_SHAPES = [(8, 64), (8, 1024), (128, 128), (128, 1536), (256, 1024), (512, 0), (512, 1536)]  # (rows, earlier cells)


def measure_slice(tokens: int, history: int) -> dict:
    """One session's slice through the shim (what forward_others calls) and through sdpa with the mask."""
    cells = history + tokens
    q = torch.randn(1, HEADS, tokens, HEAD_DIM)
    k_pool, v_pool = torch.randn(cells, KV_HEADS, HEAD_DIM), torch.randn(cells, KV_HEADS, HEAD_DIM)
    mask = torch.arange(cells)[None, :] <= (torch.arange(tokens) + history)[:, None]
    k, v = k_pool.permute(1, 0, 2).unsqueeze(0), v_pool.permute(1, 0, 2).unsqueeze(0)
    return {"slice_rows": tokens, "earlier_cells": history} | shim_against_mask(q, k, v, mask, 5)


def shim_against_mask(q, k, v, mask, repeats: int) -> dict:
    """The masked attention shim (as compiled methods call it) against sdpa
    through the mask: the shim's route, their largest difference, ms each."""
    from kvexport.partitioners.aoti.kernels.build import Shims

    shims, scale = Shims(), HEAD_DIM ** -0.5

    def shim():
        return shims.call("masked_attention", q, k, v, mask, scale)

    def through_mask():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    row = {"route": shims.attention_route(mask)[0], "max_abs_diff_from_sdpa": float((shim() - through_mask()).abs().max())}
    for f in (shim, through_mask):
        row[f"{f.__name__}_ms"] = round(best_of(f, repeats) * 1e3, 3)
    return row


# several sessions' slices in one step (a prefill of several prompts, decode rows past a static method's):
# (sessions, each one's earlier cells, each one's rows)
SESSIONS_SLICES = [(20, 30, 1), (20, 100, 1), (20, 300, 1), (40, 300, 1), (12, 50, 2), (10, 200, 4), (16, 0, 220)]


def measure_sessions_slices(sessions: int, history: int, tokens: int) -> dict:
    """A step of `sessions` sessions' slices, each session's cells in a block:
    the shim (the way its route takes) against sdpa through the mask."""
    own = history + tokens
    cells, rows = sessions * own, sessions * tokens
    position = torch.arange(cells) % own
    mask = ((torch.arange(cells) // own)[None, :] == (torch.arange(rows) // tokens)[:, None]) & (
        position[None, :] <= (torch.arange(rows) % tokens + history)[:, None])
    q = torch.randn(1, HEADS, rows, HEAD_DIM)
    k_pool, v_pool = torch.randn(cells, KV_HEADS, HEAD_DIM), torch.randn(cells, KV_HEADS, HEAD_DIM)
    k, v = k_pool.permute(1, 0, 2).unsqueeze(0), v_pool.permute(1, 0, 2).unsqueeze(0)
    return {"sessions": sessions, "earlier_cells": history, "rows_each": tokens} | shim_against_mask(q, k, v, mask, 9)


LAYER_SHAPES = [(4, 300), (8, 100), (8, 1024), (16, 1024)]  # one session's (rows, earlier cells), 30 layers' pools


def measure_layers(tokens: int, history: int, layers: int = 30) -> dict:
    """One session's rows (row t sees the history and the step's first t + 1)
    over `layers` layers' pools in turn, as a step reads them (the pools
    leave L2 between calls; whether they leave L3 is the machine's): the
    kernel against sdpa through the mask, ms for all layers."""
    from kvexport.partitioners.aoti.kernels.build import masked_attention

    cells = history + tokens
    mask = torch.arange(cells)[None, :] <= (torch.arange(tokens) + history)[:, None]
    operands = []
    for _ in range(layers):
        k_pool, v_pool = torch.randn(cells, KV_HEADS, HEAD_DIM), torch.randn(cells, KV_HEADS, HEAD_DIM)
        operands.append((torch.randn(1, HEADS, tokens, HEAD_DIM), k_pool.permute(1, 0, 2).unsqueeze(0),
                         v_pool.permute(1, 0, 2).unsqueeze(0)))
    scale = HEAD_DIM ** -0.5

    def kernel():
        for q, k, v in operands:
            masked_attention(q, k, v, mask, scale)

    def through_mask():
        for q, k, v in operands:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    row = {"layers": layers, "session_rows": tokens, "earlier_cells": history}
    for f in (kernel, through_mask):
        row[f"{f.__name__}_ms"] = round(best_of(f, 7) * 1e3, 2)
    return row


DECODE_SHAPES = [(1, 64), (1, 1024), (8, 1024)]  # (sessions, cells each): a decode step's rows, 30 layers' pools


def measure_decode_from_memory(sessions: int, cells_each: int, layers: int = 30, repeats: int = 15) -> dict:
    """A decode step's attention as a package's step meets it: one row a
    session, each seeing its own cells (runs of 64 cells a session, in turn),
    over `layers` layers' [C, Hkv, D] pools, with the pools evicted from the
    caches before each step (a read of 256 MB, as the weights' stream evicts
    them). The kernel's ms a step (median) beside the ms to read the same
    pools' bytes after the same eviction (torch's sum over each key and value
    view: the floor), and their ratio. Each call's Python overhead is in
    both."""
    from kvexport.partitioners.aoti.kernels.build import masked_attention

    cells = sessions * cells_each
    owner = torch.arange(cells) // 64 % sessions
    mask = owner[None, :] == torch.arange(sessions)[:, None]
    q = torch.randn(1, HEADS, sessions, HEAD_DIM)
    out = torch.empty_like(q)
    pools = [(torch.randn(cells, KV_HEADS, HEAD_DIM), torch.randn(cells, KV_HEADS, HEAD_DIM)) for _ in range(layers)]
    views = [(k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)) for k, v in pools]
    evict = torch.ones(64 << 20)
    scale = HEAD_DIM ** -0.5

    def kernel():
        for k, v in views:
            masked_attention(q, k, v, mask, scale, out)

    def read():
        for k, v in pools:
            k.sum(), v.sum()

    row = {"layers": layers, "sessions": sessions, "cells_each": cells_each}
    for f in (kernel, read):
        f()
        times = []
        for _ in range(repeats):
            evict.sum()
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        row[f"{f.__name__}_ms"] = round(sorted(times)[repeats // 2] * 1e3, 2)
    row["kernel_over_read"] = round(row["kernel_ms"] / row["read_ms"], 2)
    return row


def main() -> None:
    from kvexport.partitioners.aoti.kernels.build import supported

    rows = []
    for tokens, cells in SHAPES:
        rows.append(measure(tokens, cells, torch.arange(cells)[None, :] <= (torch.arange(tokens) + cells - tokens)[:, None]))
    for sessions, cells in SESSION_SHAPES:
        owner = torch.arange(cells) // (cells // sessions)
        rows.append({"sessions": sessions} | measure(sessions, cells, owner[None, :] == torch.arange(sessions)[:, None]))
    if supported():
        rows += [measure_slice(tokens, history) for tokens, history in SLICE_SHAPES]
        rows += [measure_layers(tokens, history) for tokens, history in LAYER_SHAPES]
        rows += [measure_sessions_slices(*shape) for shape in SESSIONS_SLICES]
        rows += [measure_decode_from_memory(*shape) for shape in DECODE_SHAPES]
    emit({"cpu": cpu_model(), "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
