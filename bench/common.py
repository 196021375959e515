"""Helpers shared by the bench scripts."""

from __future__ import annotations

import json
import time

import torch


def gemv_gbps(megabytes: int = 512, width: int = 576, repeats: int = 5) -> float:
    """Best-of bytes/s of fp32 matrix-vector products over a weight-sized
    matrix: what this machine's BLAS reaches on a decode step's main work."""
    w = torch.randn(megabytes * (1 << 20) // 4 // width, width)
    x = torch.randn(width)
    torch.mv(w, x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(w, x)
        best = min(best, time.perf_counter() - start)
    return w.numel() * 4 / best / 1e9


def emit(result: dict) -> None:
    print(json.dumps(result, indent=1, sort_keys=True))
