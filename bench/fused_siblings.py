"""What stacking sibling linears (attention's q, k and v; an MLP's gate and
up) saves on kvexport's int8 kernel: one decode step's products of a model,
each linear alone against each group stacked into one product, at 1 and 8
rows, in one run (the order alternates between the two forms each round).

    python bench/fused_siblings.py [--shape smollm2-135m] [--bits 4] [--rows 1,8] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from common import cpu_model, emit
from packed_kernel import SHAPES, blocks, int8_call, step_seconds
from kvexport.partitioners.aoti.kernels import build

# a layer's linears in SHAPES' order (q, k, v, o, gate, up, down) and the groups that share an input
SIBLINGS = ((0, 1, 2), (3,), (4, 5), (6,))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    layer, layers, _ = SHAPES[args.shape]
    if len(layer) != 7:
        raise SystemExit(f"{args.shape}: expected q, k, v, o, gate, up, down linears")
    g = torch.Generator().manual_seed(0)
    group = 32 if args.bits == 4 else 0
    products = "vnni" if build.has_vnni() else "maddubs"
    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "shape": args.shape, "bits": args.bits,
              "products": products, "rows": {}}
    for rows in map(int, args.rows.split(",")):
        alone, stacked = [], []
        for _ in range(layers):  # every layer's own weights: the set is larger than the caches
            for members in SIBLINGS:
                k = layer[members[0]][1]
                x = torch.randn(rows, k, generator=g)
                ws = [blocks(layer[i][0], k, args.bits, group or k, g) for i in members]
                alone += [int8_call(x, *w, products) for w in ws]
                stack = [torch.cat([w[i] for w in ws]) for i in range(3)] + [args.bits]
                stacked.append(int8_call(x, *stack, products))
        times = {"alone": [], "stacked": []}
        for r in range(args.rounds):
            order = [("alone", alone), ("stacked", stacked)]
            for name, calls in order if r % 2 == 0 else order[::-1]:
                times[name].append(step_seconds(calls, 3))
        result["rows"][rows] = {name: {"best_ms": round(min(t) * 1e3, 3), "median_ms": round(statistics.median(t) * 1e3, 3),
                                       "calls": len(alone if name == "alone" else stacked)} for name, t in times.items()}
        print(rows, result["rows"][rows], flush=True)
    emit(result)


if __name__ == "__main__":
    main()
