"""Decode of a package and of llama.cpp on a GGUF of the same model, at
batch 1 or aggregated over several sessions, in short alternating turns,
with the machine's read rate taken beside each turn: a comparison of two
bandwidth-bound figures that a VM's memory speed cannot decide on its own.

    python bench/paired_decode.py --package PKG --gguf FILE [--isa avx2] [--rounds 10] [--sessions 8]

Why: on the 2-core AMD EPYC VM of the README's tables, two threads read
memory at one of two rates, about 33 GB/s (what one thread reads alone) or
about 60, switching within one process every few to few tens of
seconds (the `read_gbps` of the rounds below shows both). A batch-1 step reads
every weight once, so a figure taken in one long run measures mostly which
rate the run drew. Here each round runs `llama-bench -p 0 -n TOKENS -r 2`
(its faster repeat; with `--sessions N`, `llama-batched-bench -npp 32
-ntg TOKENS -npl N`, its generation rate), then TOKENS tokens of the
package for as many sessions of 32-token prompts (bench/decode.py's best
long run less its best one-token run, two of each), in turns whose order
flips every round, and probes the read rate (a sum over 1 GiB, best of 3
after a warm-up) before them. The medians and the median of the rounds' ratios are
the comparison; the rounds show which rate each drew.

`--isa avx2` runs llama.cpp's AVX2-only build and holds torch, oneDNN and
MKL to AVX2 (bench/llamacpp.py builds both, once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from common import best_of, cpu_model, emit
from decode import decode_seconds
from llamacpp import ISA_ENV, VERSION, batched_generation, build, run
from kvexport.contract.package import WEIGHTS_MEMORY
from kvexport.exporter.sources.models import cache_dir

PROMPT = 32  # tokens, ids from 5 up: every vocabulary holds them


def read_gbps(buffer: torch.Tensor) -> float:
    return buffer.numel() * buffer.element_size() / best_of(buffer.sum, 3) / 1e9


def llama_turn(binaries: Path, gguf: Path, tokens: int, threads: int, sessions: int) -> float:
    """llama.cpp's decode tokens/s: batch 1 from llama-bench, several
    sequences aggregated from llama-batched-bench."""
    if sessions == 1:
        out = run([str(binaries / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens),
                   "-r", "2", "-o", "json"], stderr=subprocess.DEVNULL)
        return max(json.loads(out)[0]["samples_ts"])
    return batched_generation(binaries, gguf, threads, PROMPT, tokens, sessions, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", required=True, type=Path)
    parser.add_argument("--gguf", required=True, type=Path, help="the same model for llama.cpp, at the same precision")
    parser.add_argument("--isa", default="native", choices=sorted(ISA_ENV))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=1, help="sessions decoded together (tokens/s aggregated)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--weights", choices=WEIGHTS_MEMORY, default="mapped",
                        help="how the runtime holds the weights (runtime.load's `weights`)")
    args = parser.parse_args()
    if args.isa != "native":
        # before torch picks its kernels: re-run this script with the ISA's environment
        missing = {k: v for k, v in ISA_ENV[args.isa].items() if os.environ.get(k) != v}
        if missing:
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **missing})
    from kvexport.runtime import generate, load

    binaries = build(cache_dir() / f"llama.cpp-{VERSION}", args.isa)
    runtime = load(args.package, weights=args.weights)
    prompts = [list(range(5 + s, 5 + s + PROMPT)) for s in range(args.sessions)]

    def ours(n: int) -> None:
        generate(runtime, prompts, n, stop_at_eos=False)

    ours(3)  # builds the methods these steps take
    probe = torch.ones(1 << 28)  # 1 GiB of fp32
    rounds = []
    for r in range(args.rounds):
        row = {"read_gbps": round(read_gbps(probe), 1)}
        turns = [("llama.cpp", lambda: llama_turn(binaries, args.gguf, args.tokens, args.threads, args.sessions)),
                 ("kvexport", lambda: args.sessions * (args.tokens - 1) / decode_seconds(ours, args.tokens, 2))]
        for name, turn in turns if r % 2 == 0 else turns[::-1]:
            row[name] = round(turn(), 2)
        row["ratio"] = round(row["kvexport"] / row["llama.cpp"], 3)
        rounds.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    median = {k: round(statistics.median(r[k] for r in rounds), 3) for k in ("llama.cpp", "kvexport", "ratio")}
    emit({"cpu": cpu_model(), "isa": args.isa, "package": str(args.package), "gguf": str(args.gguf),
          "tokens": args.tokens, "sessions": args.sessions, "threads": args.threads, "torch_threads": torch.get_num_threads(),
          "median_tokens_per_s": {"llama.cpp": median["llama.cpp"], "kvexport": median["kvexport"]},
          "median_ratio_of_rounds": median["ratio"],
          "ratio_of_medians": round(median["kvexport"] / median["llama.cpp"], 3), "rounds": rounds})


if __name__ == "__main__":
    main()
