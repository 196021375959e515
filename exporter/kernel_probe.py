"""Which kernel reads an fp32 weight faster for a product with a few rows on
this machine: the BLAS (as `W @ x.T`, passes/weight_stationary_linear.py) or
the reduction inductor generates itself (passes/reduction_linear.py).

Measured once per machine (CPU model, instruction set, threads, torch) and
kept in kvexport's cache directory, so every export on a machine makes the
same choice and two exports of the same inputs stay identical. The answer
is the largest row count up to which the reduction read the weights at
least MARGIN x faster than the BLAS at every probed count; 0 keeps every
product on the BLAS.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROBE_ROWS = (1, 2, 4, 8)
MARGIN = 1.15  # timing noise on a shared machine is about 10%
SHAPE = (2048, 1024)  # one weight: 8 MiB in fp32, a layer's size
LAYERS = 24  # 192 MiB in all: more than the caches hold
VERSION = 1


def reduction_rows(device: str) -> int:
    """Row counts 1..N run as generated reductions on this machine."""
    if device != "cpu":
        return 0
    path = _cache_path()
    try:
        rows = json.loads(path.read_text())["reduction_rows"]
        if isinstance(rows, int) and 0 <= rows <= max(PROBE_ROWS):
            return rows
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.info("measuring this CPU's fp32 product kernels (once per machine; about 20 s)")
    rates = measure()
    rows = choose_rows(rates)
    _write(path, {"version": VERSION, "reduction_rows": rows, "gbps": rates, "machine": _machine()})
    chosen = f"generated reductions over 1..{rows} rows" if rows else "the BLAS at every row count"
    log.info("fp32 products: %s (weight-read GB/s by rows: %s)", chosen, rates)
    return rows


def choose_rows(rates: dict[str, dict[int, float]]) -> int:
    """The largest count R such that the reduction beat the BLAS by MARGIN at
    every probed count up to R."""
    best = 0
    for rows in PROBE_ROWS:
        if rates["reduction"][rows] < MARGIN * rates["blas"][rows]:
            break
        best = rows
    return best


def measure() -> dict[str, dict[int, float]]:
    import torch
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    weights = [torch.randn(SHAPE) for _ in range(LAYERS)]

    def blas(x):
        xt = (torch.nn.functional.pad(x, (0, 0, 0, 1)) if x.shape[0] == 1 else x).t()
        return [torch.mm(w, xt) for w in weights]

    def reduction(x):
        return [(x[:, None, :] * w[None]).sum(-1) for w in weights]

    rates: dict[str, dict[int, float]] = {"blas": {}, "reduction": {}}
    # a fresh inductor cache: torch.compile's does not key on the instruction
    # set (ATEN_CPU_CAPABILITY), and code rebuilt from it for AVX2 summed wrong
    with tempfile.TemporaryDirectory(prefix="kvexport-probe-") as fresh, temporary_cache_dir(fresh):
        compiled = torch.compile(reduction, dynamic=False)
        for rows in PROBE_ROWS:
            x = torch.randn(rows, SHAPE[1])
            got, want = compiled(x)[0], blas(x)[0].t()[:rows]
            if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):  # a miscompile never wins
                rates["blas"][rows], rates["reduction"][rows] = 1.0, 0.0
                continue
            for name, fn in (("blas", blas), ("reduction", compiled)):
                rates[name][rows] = round(LAYERS * weights[0].numel() * 4 / _best_seconds(lambda: fn(x)) / 1e9, 1)
    return rates


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _machine() -> dict:
    import torch
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    model = "unknown"
    with contextlib.suppress(OSError):
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), model)
    return {"cpu": model, "isa": str(pick_vec_isa()), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": platform.machine()}


def _cache_path() -> Path:
    from kvexport.exporter.models import cache_dir

    key = hashlib.sha256(json.dumps([VERSION, _machine()], sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "probes" / f"fp32-products-{key}.json"


def _write(path: Path, content: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(content, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:  # a read-only cache costs a probe per export, nothing else
        log.info("could not keep the kernel probe's result in %s: %s", path, e)
