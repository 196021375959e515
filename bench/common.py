"""Helpers shared by the bench scripts."""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from pathlib import Path

import torch


def weight_read_gbps(megabytes: int = 512, width: int = 576, repeats: int = 5) -> dict[str, float]:
    """Best-of bytes/s at which this machine's BLAS reads a weight-sized fp32
    matrix: as a matrix-vector product (torch.mv, what F.linear does for one
    row) and as a product with two columns (`W @ x.T`, the weight-stationary
    layout, the fastest read found here)."""
    w = torch.randn(megabytes * (1 << 20) // 4 // width, width)
    x = torch.randn(width)
    x2 = torch.randn(2, width)
    rates = {}
    for name, fn in (("gemv", lambda: torch.mv(w, x)), ("mm_2_columns", lambda: torch.mm(w, x2.t()))):
        rates[name] = w.numel() * 4 / best_of(fn, repeats) / 1e9
    return rates


def best_of(fn, repeats: int) -> float:
    """Best-of seconds of `fn()` after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def emit(result: dict) -> None:
    print(json.dumps(result, indent=1, sort_keys=True))


def cpu_model() -> str:
    """The CPU's model name and its widest vector extension (lscpu's facts)."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    widest = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse/other"
    return f"{name} ({widest})"


@functools.cache
def code_digest() -> str:
    """A short digest of the kvexport code that makes a package (contract,
    exporter, passes, partitioners and their kernels): the benches key the
    packages they export once by it, so a change to that code exports them
    again instead of measuring a package an older kvexport made."""
    import kvexport.contract
    import kvexport.exporter
    import kvexport.partitioners
    import kvexport.passes
    from kvexport.partitioners.aoti.compile_cache import source_digest

    return source_digest(kvexport.contract, kvexport.exporter, kvexport.partitioners, kvexport.passes)[:10]


def drop_older(out: Path) -> None:
    """Removes the packages a bench exported before `out` under the same
    name with another code digest (`<name>-<digest>`)."""
    stem = out.name.rsplit("-", 1)[0]
    for old in out.parent.glob(f"{stem}-*"):
        if old != out and old.is_dir() and len(old.name) == len(out.name) and (old / "manifest.json").exists():
            shutil.rmtree(old, ignore_errors=True)
