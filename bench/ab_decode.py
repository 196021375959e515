"""Two packages' decode steps, interleaved in one process: which is faster,
on a machine whose memory rate drifts from one minute to the next.

    python bench/ab_decode.py PKG_A PKG_B [--rounds 40] [--steps 16] [--sessions 1] [--context 32]
    python bench/ab_decode.py PKG PKG --weights mapped,private

Each round runs `--steps` decode steps of `--sessions` sessions on A, then
on B (the order alternates by round), after a `--context`-token prompt per
session (so attention reads as many cells as a conversation that long);
a round's time is its steps' total. Prints the median ms per step of each
and the median of the per-round ratios B/A (a drift between rounds cancels
out of a ratio taken within one round). `--weights` says how each runtime
holds its weights (runtime.load's `weights`): the same package mapped from
its file against copied into huge pages, say.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import cpu_model, emit
from kvexport.contract.package import WEIGHTS_MEMORY
from kvexport.runtime import StepEntry, load


def steps_ms(runtime, sessions: int, steps: int, context: int) -> float:
    live = [runtime.new_session() for _ in range(sessions)]
    logits = runtime.step([StepEntry(s, [3 + i % 256 for i in range(context)]) for s in live])
    tokens = [int(row.argmax()) for row in logits]
    start = time.perf_counter()
    for _ in range(steps):
        logits = runtime.step([StepEntry(s, [t]) for s, t in zip(live, tokens)])
        tokens = [int(row.argmax()) for row in logits]
    took = time.perf_counter() - start
    for s in live:
        runtime.release(s)
    return took * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--context", type=int, default=32, help="prompt tokens per session before the steps")
    parser.add_argument("--weights", default="mapped,mapped", help="A's and B's: mapped or private")
    args = parser.parse_args()
    given = args.weights.split(",")
    weights = dict(zip("ab", given))
    if len(given) != 2 or not set(given) <= set(WEIGHTS_MEMORY):
        parser.error("--weights takes two of mapped and private: A's,B's")
    runtimes = {k: load(str(getattr(args, k)), trust_native_code=True, weights=weights[k]) for k in "ab"}
    for runtime in runtimes.values():
        steps_ms(runtime, args.sessions, 4, args.context)  # warm: methods loaded, pools grown
    times = {"a": [], "b": []}
    ratios = []
    for i in range(args.rounds):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        took = {name: steps_ms(runtimes[name], args.sessions, args.steps, args.context) for name in order}
        for name in took:
            times[name].append(took[name])
        ratios.append(took["b"] / took["a"])
    emit({
        "cpu": cpu_model(), "a": str(args.a), "b": str(args.b), "weights": weights, "sessions": args.sessions,
        "context": args.context,
        "median_ms_per_step": {k: round(statistics.median(v), 2) for k, v in times.items()},
        "median_ratio_b_over_a": round(statistics.median(ratios), 3),
        "ratio_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
    })


if __name__ == "__main__":
    main()
