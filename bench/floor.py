"""This machine's floors, and how close each way of computing a decode
product comes to them, in one run:

- the streaming-read rate: a `sum` over a 1 GiB fp32 tensor (best and
  median of several runs; it varies from run to run on shared machines),
  on 4 KB pages and on transparent huge pages (`read_huge_pages`: how a
  runtime loaded with `--weights private` holds its weights);
- the fp32 GEMM rate of the BLAS at 1 to 512 rows, on a weight that stays
  in cache (GFLOP/s);
- the rate at which products with 1 to 8 rows read 48 layer-sized fp32
  weights (GB/s): the BLAS as `x @ W.T` (`F.linear`) and as `W @ x.T` (the
  weight-stationary layout the CPU backends use), against kvexport's row
  kernel (partitioners/aoti/kernels/rows_linear.cpp, what aoti packages run on x86);
- the row kernel's own rate at 1 to 16 rows on a weight in cache (GFLOP/s);
- the rate at which its bf16 products (bf16 rows by a bf16 weight, as
  compiled code calls them) read 96 such weights in bf16 (GB/s);
- with `--package` (an fp32 one), the floors of its decode step: weight bytes
  at the best read rate (batch 1) and 2 x parameters x 8 FLOP at the BLAS's
  and at the row kernel's 8-row rate (8 sessions).

    python bench/floor.py [--package PKG]

Set ATEN_CPU_CAPABILITY=avx2 to see the row kernel's AVX2 build on an
AVX-512 machine, and MKL_ENABLE_INSTRUCTIONS=AVX2 to see the BLAS's AVX2
path.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import best_of, cpu_model, emit
from kvexport.contract.confined_io import advise_huge_pages


def read_rate(gib: float = 1.0, runs: int = 7, huge: bool = False) -> dict[str, float]:
    if huge:  # anonymous memory advised onto huge pages, as runtime.load(weights="private") copies weights into
        memory = mmap.mmap(-1, int(gib * (1 << 30)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advise_huge_pages(memory)
        t = torch.frombuffer(memory, dtype=torch.float32).fill_(1.0)
    else:
        t = torch.ones(int(gib * (1 << 30)) // 4)
    seconds = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        t.sum()
        seconds.append(time.perf_counter() - start)
    rates = [t.numel() * 4 / s / 1e9 for s in seconds[1:]]
    return {"best_gbps": round(max(rates), 1), "median_gbps": round(statistics.median(rates), 1)}


def gemm_rates(out_features: int = 1536, in_features: int = 576) -> dict[int, float]:
    w = torch.randn(out_features, in_features)
    rates = {}
    for rows in (1, 2, 4, 8, 16, 64, 256, 512):
        x = torch.randn(rows, in_features)
        seconds = best_of(lambda: F.linear(x, w), 50 if rows <= 16 else 10)
        rates[rows] = round(2 * rows * out_features * in_features / seconds / 1e9, 1)
    return rates


def _linear(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [F.linear(x, w) for w in weights]


def _weight_stationary(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """W @ x.T, one row padded to two (passes/weight_stationary_linear.py)."""
    xt = (F.pad(x, (0, 0, 0, 1)) if x.shape[0] == 1 else x).t()
    return [torch.mm(w, xt).t()[: x.shape[0]] for w in weights]


def _row_kernel(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    from kvexport.partitioners.aoti.kernels.build import rows_linear

    return [rows_linear(x, w) for w in weights]


def row_kernel_rates(out_features: int = 1536, in_features: int = 576) -> dict[int, float]:
    w = torch.randn(out_features, in_features)
    rates = {}
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, in_features)
        seconds = best_of(lambda: _row_kernel(x, [w]), 50)
        rates[rows] = round(2 * rows * out_features * in_features / seconds / 1e9, 1)
    return rates


def weight_read_rates(layers: int = 48, shape: tuple[int, int] = (1536, 576)) -> dict[str, dict[int, float]]:
    """GB/s of products over `layers` distinct weights of a decoder layer's
    size (170 MB in all, more than the caches hold, each one fits in L2/L3
    as a real layer's does)."""
    weights = [torch.randn(shape) for _ in range(layers)]
    ways = {"blas_x_wt": _linear, "blas_weight_stationary": _weight_stationary, "row_kernel": _row_kernel}
    rates: dict[str, dict[int, float]] = {name: {} for name in ways}
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, shape[1])
        expected = _linear(x, weights)
        for name, fn in ways.items():
            torch.testing.assert_close(fn(x, weights), expected, rtol=1e-3, atol=1e-3)
            seconds = best_of(lambda: fn(x, weights), 5)
            rates[name][rows] = round(layers * weights[0].numel() * 4 / seconds / 1e9, 1)
    return rates


def bf16_read_rates(layers: int = 96, shape: tuple[int, int] = (1536, 576)) -> dict[int, float]:
    """GB/s of the row kernel's bf16 products (what compiled code calls)
    over `layers` distinct bf16 weights, the same 170 MB as above."""
    weights = [torch.randn(shape).bfloat16() for _ in range(layers)]
    rates = {}
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, shape[1]).bfloat16()
        expected = [F.linear(x.float(), w.float()) for w in weights[:4]]
        torch.testing.assert_close(_row_kernel(x, weights[:4]), expected, rtol=1e-4, atol=1e-4)
        seconds = best_of(lambda: _row_kernel(x, weights), 5)
        rates[rows] = round(layers * weights[0].numel() * 2 / seconds / 1e9, 1)
    return rates


def package_floors(package: Path, read_gbps: float, gemm_8_rows: float, kernel_8_rows: float) -> dict[str, float]:
    from safetensors import safe_open

    weights = package / "weights.safetensors"
    with safe_open(weights, "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    size = weights.stat().st_size
    return {
        "weight_bytes": size,
        "batch1_floor_ms": round(size / (read_gbps * 1e9) * 1e3, 2),
        "batch1_floor_tokens_per_s": round(read_gbps * 1e9 / size, 1),
        "stored_values": params,
        "sessions8_compute_floor_ms": round(2 * 8 * params / (gemm_8_rows * 1e9) * 1e3, 2),
        "sessions8_compute_floor_tokens_per_s": round(8 / (2 * 8 * params / (gemm_8_rows * 1e9)), 1),
        "sessions8_row_kernel_compute_floor_ms": round(2 * 8 * params / (kernel_8_rows * 1e9) * 1e3, 2),
    }


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, help="a package whose decode floors to print")
    args = parser.parse_args()
    read = read_rate()
    gemm = gemm_rates()
    kernel = row_kernel_rates()
    result = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "read": read,
        "read_huge_pages": read_rate(huge=True),
        "blas_gemm_gflops_by_rows": gemm,
        "row_kernel_gflops_by_rows": kernel,
        "weight_read_gbps_by_rows": weight_read_rates(),
        "row_kernel_bf16_read_gbps_by_rows": bf16_read_rates(),
    }
    if args.package:
        result["package"] = package_floors(args.package, read["best_gbps"], gemm[8], kernel[8])
    emit(result)


if __name__ == "__main__":
    main()
