"""Which kernel runs an fp32 product over a few rows faster on this machine:
the BLAS (as `W @ x.T`, passes/weight_stationary_linear.py) or kvexport's
row kernel (kernels/rows_linear.cpp, passes/rows_linear.py).

Measured once per machine (CPU model, instruction set, threads, torch, the
kernel's source) and kept in kvexport's cache directory, so every export on
a machine makes the same choice and two exports of the same inputs stay
identical. Each row count 1..MAX_ROWS is timed over a set of weights larger
than the caches, the two kernels interleaved, and the row kernel takes the
counts where its median beats the BLAS's by MARGIN.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import statistics
import time
from pathlib import Path

from kvexport.contract.errors import ExportError

log = logging.getLogger(__name__)

MAX_ROWS = 16
MARGIN = 1.05  # medians of interleaved runs: the row kernel must win clearly
SHAPE = (2048, 1024)  # one weight: 8 MiB in fp32, a layer's size
LAYERS = 24  # 192 MiB in all: more than the caches hold
REPEATS = 7
VERSION = 2
MODES = ("auto", "on", "off")
_UNBUILT: set[Path] = set()  # probes whose kernels failed to build in this process: not retried until the next


def packed_rows(device: str, mode: str = "on") -> tuple[int, ...]:
    """The static row counts whose products by packed 4- and 8-bit weights
    run on the packed kernel: all of 1..MAX_ROWS wherever the kernels build
    (inductor's code for them unpacks every code again for every row)."""
    from kvexport.partitioners.aoti.kernels import build

    if device != "cpu" or mode == "off" or not build.supported():
        return ()
    return tuple(range(1, MAX_ROWS + 1))


def kernel_rows(device: str, mode: str = "auto") -> tuple[int, ...]:
    """The static row counts whose fp32 products run on the row kernel."""
    from kvexport.partitioners.aoti.kernels import build as row_kernel

    if device != "cpu" or mode == "off" or not row_kernel.supported():
        return ()
    if mode == "on":
        return tuple(range(1, MAX_ROWS + 1))
    path = _cache_path()
    try:
        rows = json.loads(path.read_text())["kernel_rows"]
        if isinstance(rows, list) and all(isinstance(r, int) and 1 <= r <= MAX_ROWS for r in rows):
            return tuple(rows)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if path in _UNBUILT:
        return ()
    log.info("measuring this CPU's fp32 product kernels (once per machine; about 10 s)")
    try:
        rates = measure()
    except ExportError as e:  # auto never fails an export: the BLAS serves, and the next export tries again
        log.warning("the row kernel is not available, fp32 products stay on the BLAS: %s", e)
        _UNBUILT.add(path)
        return ()
    rows = choose_rows(rates)
    _write(path, {"version": VERSION, "kernel_rows": list(rows), "gbps": rates, "machine": _machine()})
    log.info("fp32 products on the row kernel at rows %s, on the BLAS otherwise (weight-read GB/s by rows: %s)",
             ",".join(map(str, rows)) or "none", rates)
    return rows


def choose_rows(rates: dict[str, dict[int, float]]) -> tuple[int, ...]:
    """Every row count at which the row kernel read the weights MARGIN x
    faster than the BLAS."""
    return tuple(r for r in sorted(rates["kernel"]) if rates["kernel"][r] >= MARGIN * rates["blas"][r])


def measure() -> dict[str, dict[int, float]]:
    """Weight-read GB/s (median of REPEATS) of each kernel at 1..MAX_ROWS rows."""
    import torch

    from kvexport.partitioners.aoti.kernels.build import rows_linear
    from kvexport.passes.weight_stationary_linear import WeightStationaryLinearPass

    weights = [torch.randn(SHAPE) for _ in range(LAYERS)]
    stationary = WeightStationaryLinearPass().max_rows

    def blas(x):  # as the BLAS runs without the kernel: weight-stationary up to its row limit
        if x.shape[0] > stationary:
            return [torch.nn.functional.linear(x, w) for w in weights]
        xt = (torch.nn.functional.pad(x, (0, 0, 0, 1)) if x.shape[0] == 1 else x).t()
        return [torch.mm(w, xt).t() for w in weights]

    def rows(x):
        return [rows_linear(x, w) for w in weights]

    rates: dict[str, dict[int, float]] = {"blas": {}, "kernel": {}}
    gigabytes = LAYERS * weights[0].numel() * 4 / 1e9
    for count in range(1, MAX_ROWS + 1):
        x = torch.randn(count, SHAPE[1])
        if not torch.allclose(rows(x)[0], blas(x)[0][:count], rtol=1e-4, atol=1e-4):  # a wrong kernel never wins
            rates["blas"][count], rates["kernel"][count] = 1.0, 0.0
            continue
        times: dict[str, list[float]] = {"blas": [], "kernel": []}
        for _ in range(REPEATS):
            for name, fn in (("blas", blas), ("kernel", rows)):
                start = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - start)
        for name, seconds in times.items():
            rates[name][count] = round(gigabytes / statistics.median(seconds), 1)
    return rates


def _machine() -> dict:
    import torch
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from kvexport.partitioners.aoti.kernels.build import FILES

    model = "unknown"
    with contextlib.suppress(OSError):
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), model)
    return {"cpu": model, "isa": str(pick_vec_isa()), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": platform.machine(),
            "kernel": hashlib.sha256(b"".join(f.read_bytes() for f in FILES)).hexdigest()[:16]}


def _cache_path() -> Path:
    from kvexport.contract.package import cache_dir

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
