"""Helpers shared by the bench scripts."""

from __future__ import annotations

import json
import time

import torch


def memory_read_gbps(megabytes: int = 1024, repeats: int = 5) -> float:
    """Best-of read bandwidth of this machine: summing a large fp32 tensor."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def emit(result: dict) -> None:
    print(json.dumps(result, indent=1, sort_keys=True))
