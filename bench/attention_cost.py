"""Attention cost follows the cells in use: a decode step with about 200 live
cells, in a runtime whose pool may hold 1024 cells versus 65536.

    python bench/attention_cost.py --package PKG     # exported with --max-cells 65536

Both runtimes load the same package (the smaller one with max_cells=1024);
prints ms per step and their ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import emit
from kvexport.runtime import OffgraphKVManager, StepEntry, load


def ms_per_step(runtime: OffgraphKVManager, live: int, steps: int) -> float:
    session = runtime.new_session()
    runtime.step([StepEntry(session, [5] * live)])
    for _ in range(3):
        runtime.step([StepEntry(session, [7])])
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            runtime.step([StepEntry(session, [7])])
        best = min(best, (time.perf_counter() - start) / steps)
        runtime.rewind(session, live + 3)
    runtime.release(session)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--package", required=True, type=Path)
    parser.add_argument("--live-cells", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    large = load(args.package)
    small = OffgraphKVManager(large.package, max_cells=1024)
    small_ms = ms_per_step(small, args.live_cells, args.steps)
    large_ms = ms_per_step(large, args.live_cells, args.steps)
    emit({
        "package": str(args.package),
        "backend": large.package.backend["id"],
        "live_cells": args.live_cells,
        "max_cells_large": large.cache.max_cells,
        "ms_per_step_max_cells_1024": round(small_ms, 2),
        f"ms_per_step_max_cells_{large.cache.max_cells}": round(large_ms, 2),
        "ratio_large_over_small": round(large_ms / small_ms, 3),
    })


if __name__ == "__main__":
    main()
