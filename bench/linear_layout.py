"""Time of all of a model's linears over a few rows, in the two layouts a
CPU backend can choose between (see passes/weight_stationary_linear.py):
`x @ W.T` (F.linear, what HF runs) and `W @ x.T` (one row padded to two).

    python bench/linear_layout.py [--model smollm2-135m] [--rows 1,2,4,8,16,64,512]

Prints JSON: milliseconds per pass over every linear weight, each layout's
weight-read rate in GB/s, and the ratio linear / weight-stationary per row
count. The rewrite pays where the ratio is above 1.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import emit
from kvexport.exporter.sources.models import load_model


def linear_rowmajor(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


def weight_stationary(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    if rows == 1:
        x = torch.nn.functional.pad(x, (0, 0, 0, 1))
    return torch.mm(w, x.t()).t()[:rows].contiguous()


def median_ms(fn, weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for w in weights:
            fn(inputs[w.shape[1]], w)
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return 1000 * times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", default="1,2,4,8,16,64,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model = load_model(args.model, "fp32").model
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    result: dict = {"model": args.model, "linear_weights": len(weights), "weight_bytes": nbytes,
                    "torch_threads": torch.get_num_threads(), "rows": {}}
    for rows in map(int, args.rows.split(",")):
        row_major = median_ms(linear_rowmajor, weights, rows, args.repeats)
        stationary = median_ms(weight_stationary, weights, rows, args.repeats)
        result["rows"][rows] = {
            "linear_ms": round(row_major, 2),
            "weight_stationary_ms": round(stationary, 2),
            "linear_gbps": round(nbytes / row_major / 1e6, 1),
            "weight_stationary_gbps": round(nbytes / stationary / 1e6, 1),
            "ratio_linear_over_weight_stationary": round(row_major / stationary, 3),
        }
    emit(result)


if __name__ == "__main__":
    main()
