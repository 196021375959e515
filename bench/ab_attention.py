"""The masked attention kernel (kernels/masked_attention.cpp) as another
revision built it against the working tree's, alternated in one process:
a decode step's rows (one a session, each seeing its own cells, dealt out
in runs of 64) over 30 layers' [C, Hkv, D] fp32 pools, the pools evicted
from the caches before each step, as a package's step meets them.

    python bench/ab_attention.py --base HEAD~1 [--heads 9,3,64] [--shapes 1x1024,8x1024,1x160,8x160] [--rounds 12]

`--heads` is H, Hkv, D (SmolLM2's 9, 3, 64 by default; the 1B shape's
32, 8, 64); a shape is sessions x cells each. Reports each build's median
ms a step, the median of the per-round ratios (working tree over base:
below 1 is faster) and whether both builds give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ab_kernels import build_revision, typed
from common import cpu_model, emit
from kvexport.partitioners.aoti.kernels import build
from kvexport.partitioners.aoti.kernels.signatures import MASKED_ATTENTION

LAYERS = 30


def step(function, q, mask, pools, out, heads: int, kv_heads: int, dim: int) -> None:
    rows, cells = q.shape[1], pools[0][0].shape[0]
    for k, v in pools:
        function(q.data_ptr(), rows * dim, dim, k.data_ptr(), dim, kv_heads * dim, v.data_ptr(), dim, kv_heads * dim,
                 mask.data_ptr(), cells, 1, out.data_ptr(), heads, kv_heads, rows, cells, dim, dim ** -0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to build the other kernel from")
    parser.add_argument("--heads", default="9,3,64", help="H,Hkv,D")
    parser.add_argument("--shapes", default="1x1024,8x1024,1x160,8x160", help="sessions x cells each, comma-separated")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    heads, kv_heads, dim = (int(v) for v in args.heads.split(","))
    with tempfile.TemporaryDirectory() as scratch:
        builds = {"base": typed(build_revision(args.base, None, Path(scratch)), MASKED_ATTENTION),
                  "tree": typed(build._build("shared") / f"lib{build.LIBRARY}.so", MASKED_ATTENTION)}
        evict = torch.ones(64 << 20)  # 256 MB read before each step, as the weights' stream evicts the pools
        results = []
        for shape in args.shapes.split(","):
            sessions, each = (int(v) for v in shape.split("x"))
            cells = sessions * each
            owner = torch.arange(cells) // 64 % sessions
            mask = (owner[None, :] == torch.arange(sessions)[:, None]).contiguous()
            q = torch.randn(heads, sessions, dim)
            pools = [(torch.randn(cells, kv_heads, dim), torch.randn(cells, kv_heads, dim)) for _ in range(LAYERS)]
            outs = {name: torch.empty(heads, sessions, dim) for name in builds}
            times, ratios = {name: [] for name in builds}, []
            for r in range(args.rounds):
                took = {}
                for name in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                    evict.sum()
                    start = time.perf_counter()
                    step(builds[name], q, mask, pools, outs[name], heads, kv_heads, dim)
                    took[name] = time.perf_counter() - start
                    times[name].append(took[name])
                ratios.append(took["tree"] / took["base"])
            results.append({"sessions": sessions, "cells_each": each,
                            "base_ms": round(statistics.median(times["base"]) * 1e3, 2),
                            "tree_ms": round(statistics.median(times["tree"]) * 1e3, 2),
                            "tree_over_base": round(statistics.median(ratios), 3),
                            "same_bits": torch.equal(outs["base"], outs["tree"])})
            print(results[-1], flush=True)
    emit({"cpu": cpu_model(), "base": args.base, "heads": [heads, kv_heads, dim], "layers": LAYERS,
          "rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
