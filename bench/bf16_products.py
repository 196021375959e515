"""bf16 products over many rows (a prefill slice's) and a few (a decode
step's): torch's own bf16 GEMM against kvexport's row kernel
(kernels/rows_linear.cpp) and its shim as compiled code calls it (from 128
rows, the operands widened for torch's fp32 GEMM: shims.cpp), with torch's
fp32 GEMM beside them, on SmolLM2's linear shapes, in GFLOPS (best of three
interleaved medians).

On a CPU without AVX-512, torch has no fast bf16 GEMM (oneDNN's needs
AVX-512; ATen's own generic one serves), and an aoti bf16 package's prefill
products take the row kernel instead (kernels/build.py: fast_bf16_gemm). To
see that machine's figures on an AVX-512 one, hold every library to AVX2:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python bench/bf16_products.py

(oneDNN still takes torch's bf16 GEMMs there, held to AVX2; with it off,
ATen's generic one ran the same rate, as on an AVX2 CPU.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from common import cpu_model, emit
from kvexport.partitioners.aoti.kernels import build

SHAPES = {"gate/up": (1536, 576), "down": (576, 1536), "head": (49152, 576)}  # SmolLM2-135M, (out, in)


def gflops(fn, flops: float, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(flops / statistics.median(times) / 1e9, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="8,512", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    shims = build.Shims()  # as compiled code calls it: the BLAS in fp32 from 128 rows (shims.cpp)
    result = {"cpu": cpu_model(), "env": {k: os.environ.get(k) for k in
                                         ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")},
              "fast_bf16_gemm": build.fast_bf16_gemm(), "gflops": {}}
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k).bfloat16()
        wide = weight.float()
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            out = torch.empty(rows, n)
            forms = {"torch bf16": lambda: torch.mm(x, weight.t()),
                     "row kernel bf16": lambda: build.rows_linear(x, weight, out),
                     "shim bf16": lambda: shims.call("rows_linear", x, weight),
                     "torch fp32": lambda: torch.mm(x.float(), wide.t())}
            rates = {form: [] for form in forms}
            for _ in range(3):  # interleaved: a VM's speed drifts
                for form, fn in forms.items():
                    rates[form].append(gflops(fn, 2 * rows * n * k, args.repeats))
            result["gflops"][f"{name} {n}x{k}, {rows} rows"] = {form: max(r) for form, r in rates.items()}
    emit(result)


if __name__ == "__main__":
    main()
