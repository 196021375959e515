"""The int8 kernel's cost of each activation rounding, on a real model's own
activations: every linear of one decode step with the codes of `--qlinear`
(4w: 4-bit; a head tied to the 8w embedding is left out), each weight read
from memory (the set is larger than the caches), its input captured from
the eagerly quantized model over a text, timed with each `--qact` in turn
on each build of the kernel this CPU runs (AVX2 with maddubs, AVX2 and
AVX-512 with VNNI where the CPU has it).

    python bench/qact_kernels.py [--model smollm2-135m] [--qlinear 4w] [--qact int8,int8-peak] [--rows 1,8]

Random activations (bench/packed_kernel.py, bench/ab_kernels.py) put a
row's peak block anywhere, so over 8 rows most blocks are some row's peak;
a model's outliers sit in the same channels token after token, which is
what int8-peak's second products cost depends on. The rows are consecutive
tokens of the text (`--rows 8`: 8 of them, as 8 sessions are 8 rows). Each
round times every rounding once, the order turning round by round; the
report gives each one's median step and the median of the per-round
ratios to the first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import cpu_model, emit
from kvexport.exporter.quantization.quantize import Int8Linear, quantize_model
from kvexport.exporter.sources.models import load_model
from kvexport.partitioners.aoti.kernels import build
from kvexport.contract.schemes import QACT
from quant import TEXT


def captured_inputs(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple]:
    """(x [T, K], data, scale, offset, bits) of every Int8Linear, x its input over ids."""
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    inputs: dict[torch.nn.Module, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.__setitem__(mod, args[0][0].detach().clone()))
             for m in linears]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    return [(inputs[m], m.data.contiguous(), m.scale.contiguous(), m.offset.contiguous(), m.bits) for m in linears]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--qlinear", default="4w", choices=("4w", "8w"))
    parser.add_argument("--qact", default="int8,int8-peak", help="comma-separated roundings, the first the reference")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    roundings = args.qact.split(",")
    if any(q not in QACT[1:] for q in roundings):
        parser.error(f"--qact takes {', '.join(QACT[1:])}")
    loaded = load_model(args.model)
    if loaded.tokenizer is None:
        parser.error(f"{args.model} has no tokenizer: its activations would not be a text's")
    quantize_model(loaded.model, args.qlinear, 0, "8w", qact="int8")
    ids = loaded.tokenizer(TEXT)["input_ids"]
    rows = [int(r) for r in args.rows.split(",")]
    if max(rows) > len(ids) // 2:
        parser.error(f"--rows up to {len(ids) // 2}: the text has {len(ids)} tokens")
    bits = int(args.qlinear[0])
    operands = [op for op in captured_inputs(loaded.model, torch.tensor([ids])) if op[4] == bits]
    first = len(ids) // 2  # rows from the middle of the text, past its first tokens
    builds = [("avx2", "maddubs")]
    builds += [(isa, "vnni") for isa in build.ISAS if build.has_vnni(isa)]
    result = {"cpu": cpu_model(), "model": args.model, "qlinear": args.qlinear, "linears": len(operands),
              "codes_mb": round(sum(op[1].numel() for op in operands) / 1e6, 1), "runs": []}
    for isa, products in builds:
        for n in rows:
            def step(qact: str) -> float:
                start = time.perf_counter()
                for x, data, scale, offset, bits in operands:
                    build.int8_linear(x[first:first + n].contiguous(), data, scale, offset, bits, QACT.index(qact),
                                      isa=isa, products=products)
                return time.perf_counter() - start

            for qact in roundings:  # builds the kernel, warms the caches
                step(qact)
            times: dict[str, list[float]] = {q: [] for q in roundings}
            for r in range(args.rounds):
                for qact in (roundings if r % 2 == 0 else roundings[::-1]):
                    times[qact].append(step(qact))
            run = {"isa": isa, "products": products, "rows": n,
                   "median_ms": {q: round(1e3 * statistics.median(t), 2) for q, t in times.items()}}
            base = times[roundings[0]]
            run["median_ratio_to_first"] = {q: round(statistics.median(a / b for a, b in zip(t, base)), 3)
                                            for q, t in times.items() if q != roundings[0]}
            result["runs"].append(run)
    emit(result)


if __name__ == "__main__":
    main()
