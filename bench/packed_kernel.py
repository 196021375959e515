"""kvexport's packed and int8 kernels (partitioners/aoti/kernels/packed_linear.cpp,
int8_linear.cpp) on the linears of one decode step of a model, at 1 to 16
rows, in one run:

- per row count, the time of every linear of a step once (each weight read
  from memory: the set is larger than the caches) and what that is per token,
  for 4- and 8-bit codes (per group of 32, and 8-bit per row as 8w stores it),
  weight-only (packed) and with int8 activations (codes in blocks, as
  --qact int8 stores them; with two int8 terms, --qact int8x2; with int16
  codes, --qact int16), the latter on both builds of the int8 kernel where
  the CPU has VNNI (maddubs, vnni);
- the same products on the row kernel with the fp32 weights, and the BLAS;
  on the row kernel with bf16 rows and weights, both of its builds (widened
  to fp32 in registers: shift; vdpbf16ps where the CPU has AVX512-BF16: dot);
- the streaming-read rate (bench/floor.py's `sum`), and each form's bytes
  over it: the floor a step cannot beat;
- the int8 kernel's arithmetic alone: a 1536 x 576 weight (SmolLM2's gate)
  that stays in the caches, multiplied 200 times, in nanoseconds per block
  of 32 codes of one weight row (wall time, all threads): how far the
  products are from being bound by the reads.

    python bench/packed_kernel.py [--shape smollm2-135m] [--rows 1,2,4,8,16]

Set ATEN_CPU_CAPABILITY=avx2 to time the AVX2 build on an AVX-512 machine.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

from common import cpu_model, emit
from floor import read_rate
from kvexport.contract.schemes import QACT
from kvexport.partitioners.aoti.kernels import build
from kvexport.passes.packed_weights import narrow_tables, pack, pack_blocks, pack_table, pad_rows

# (out, in) of one layer's linears, layers, and the LM head
SHAPES = {
    "smollm2-135m": ([(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)], 30,
                     (49152, 576)),
    "llama3.2-1b": ([(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)], 16,
                    (49152, 2048)),  # bench/llamacpp.py --shape llama3.2-1b (SmolLM2's vocabulary)
}

HOT = (1536, 576)  # the weight the kernel's arithmetic is timed on, in cache


def random_codes(out_features: int, width: int, bits: int, group: int, g: torch.Generator):
    """Random codes [out, width] with a random scale and offset per group."""
    codes = torch.randint(0, 1 << bits, (out_features, width), generator=g, dtype=torch.uint8)
    groups = width // group
    # scales of at least 0.01, as a real weight's are: exports keep them in fp16 (narrow_tables)
    return codes, torch.rand(out_features, groups, generator=g) + 0.01, torch.randn(out_features, groups, generator=g)


def packed(out_features: int, width: int, bits: int, group: int, g: torch.Generator):
    """packed_linear's operands: codes in row lanes."""
    codes, scale, offset = random_codes(out_features, width, bits, group, g)
    return pack(codes, bits), pad_rows(scale, bits), pad_rows(offset, bits), bits, out_features


def blocks(out_features: int, width: int, bits: int, group: int, g: torch.Generator):
    """int8_linear's operands: codes in blocks, scales and offsets in fp16 as
    exports store them (narrow_tables)."""
    codes, scale, offset = random_codes(out_features, width, bits, group, g)
    scale, offset = narrow_tables(scale, offset, exact=False)
    return pack_blocks(codes, bits), pack_table(scale), pack_table(offset), bits


def direct(kernel: str, *operands):
    """The kernel's math called straight through ctypes on operands whose
    addresses are taken once: what a compiled method pays per call. (The
    Python entries in build.py check the operands first, tens of
    microseconds: more than a one-row product of a small linear takes.)"""
    function = build.shared_kernel()[kernel]
    values = [o.data_ptr() if isinstance(o, torch.Tensor) else o for o in operands]
    return lambda held=operands: function(*values)  # held: the tensors live as long as the call


def packed_call(x, words, scale, offset, bits, rows):
    (m, k), out = x.shape, x.new_empty(x.shape[0], rows)
    build.packed_linear(x, words, scale, offset, bits, rows, out=out)  # checks the operands once
    return direct("packed_linear", x, k, words, scale, offset, out, m, rows, k, words.shape[0], scale.shape[1], bits)


def int8_call(x, data, scale, offset, bits, products, qact: int = 1):
    (m, k), n = x.shape, data.shape[0] * 8
    out = x.new_empty(m, n)
    build.int8_linear(x, data, scale, offset, bits, qact, out=out, products=products)
    return direct(f"int8_linear_{products}", x, k, data, scale, offset, out, m, n, k, scale.shape[1] // 8, bits,
                  scale.element_size() * 8, qact)


def rows_call(x, weight, products: str = ""):
    """The row kernel over x and weight, both fp32 or both bf16 (x rounded
    to bf16 for a bf16 weight, as the compiled code's rows are); products:
    the bf16 build, shift or dot."""
    x = x.to(weight.dtype)
    (m, k), n = x.shape, weight.shape[0]
    out = build.rows_linear(x, weight, products=products)
    kernel = "_".join(filter(None, ("rows_linear" if weight.dtype == torch.float32 else "rows_linear_bf16", products)))
    return direct(kernel, x, k, weight, out, m, n, k)


def step_seconds(products, repeats: int) -> float:
    """The best time of running every product once."""
    for p in products:
        p()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for p in products:
            p()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layer, layers, head = SHAPES[args.shape]
    shapes = layer * layers + [head]
    g = torch.Generator().manual_seed(0)
    forms = {"4-bit, groups of 32": (4, 32), "8-bit, groups of 32": (8, 32), "8-bit, per row": (8, 0)}
    weights = {name: [packed(n, k, bits, group or k, g) for n, k in shapes] for name, (bits, group) in forms.items()}
    # (bits, group, the int8 kernel's qact: contract/schemes.py's QACT index)
    int8_forms = {f"{bits}-bit, {'groups of 32' if group else 'per row'}, {QACT[qact]} activations": (bits, group, qact)
                  for qact in (1, 2, 3) for bits, group in ((4, 32), (8, 0))}
    int8_weights = {name: [blocks(n, k, bits, group or k, g) for n, k in shapes] for name, (bits, group, _) in int8_forms.items()}
    int8_products = ["maddubs", "vnni"] if build.has_vnni() else ["maddubs"]  # the int8 kernel's two builds
    fp32 = [torch.randn(n, k, generator=g) for n, k in shapes]
    bf16 = [w.bfloat16() for w in fp32]
    values = sum(n * k for n, k in shapes)
    read = read_rate()
    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "shape": args.shape, "read_rate": read,
              "weights_m": round(values / 1e6, 1), "rows": {}}
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in shapes}}
        row: dict[str, dict] = {}
        for name, ws in weights.items():
            seconds = step_seconds([packed_call(xs[w[0].shape[1]], *w) for w in ws], args.repeats)
            nbytes = sum(w[0].numel() * 4 + w[1].numel() * 8 for w in ws)
            row[name] = {"ms": round(seconds * 1e3, 2), "tokens_per_s": round(rows / seconds, 1),
                         "floor_ms": round(nbytes / (read["best_gbps"] * 1e9) * 1e3, 2)}
        for (name, ws), products in itertools.product(int8_weights.items(), int8_products):
            widths = [w[0].shape[1] // w[3] for w in ws]  # a row of data holds a panel's 8 rows: width * bits bytes
            qact = int8_forms[name][2]
            seconds = step_seconds([int8_call(xs[k], *w, products, qact) for w, k in zip(ws, widths)], args.repeats)
            nbytes = sum(w[0].numel() + (w[1].numel() + w[2].numel()) * w[1].element_size() for w in ws)
            row[f"{name} ({products})"] = {"ms": round(seconds * 1e3, 2), "tokens_per_s": round(rows / seconds, 1),
                                           "floor_ms": round(nbytes / (read["best_gbps"] * 1e9) * 1e3, 2)}
        floats = [("fp32, row kernel", fp32, xs, rows_call), ("fp32, BLAS", fp32, xs, lambda x, w: lambda: F.linear(x, w)),
                  ("bf16, row kernel (shift)", bf16, xs, lambda x, w: rows_call(x, w, "shift"))]
        if build.has_bf16_dot():
            floats.append(("bf16, row kernel (dot)", bf16, xs, lambda x, w: rows_call(x, w, "dot")))
        for name, ws, inputs, call in floats:
            seconds = step_seconds([call(inputs[w.shape[1]], w) for w in ws], args.repeats)
            row[name] = {"ms": round(seconds * 1e3, 2), "tokens_per_s": round(rows / seconds, 1),
                         "floor_ms": round(values * ws[0].element_size() / (read["best_gbps"] * 1e9) * 1e3, 2)}
        x = torch.randn(rows, HOT[1], generator=g)
        for (name, (bits, group, qact)), products in itertools.product(int8_forms.items(), int8_products):
            w = blocks(*HOT, bits, group or HOT[1], g)
            seconds = step_seconds([int8_call(x, *w, products, qact)] * 200, args.repeats)
            row[f"{name} ({products}), in cache"] = {"ns_per_block_row": round(seconds / 200 / (HOT[0] * HOT[1] / 32) * 1e9, 3)}
        result["rows"][rows] = row
        print(f"{rows:>2} rows: " + "; ".join(f"{k} {v['ms']} ms (floor {v['floor_ms']})" if "ms" in v else
                                             f"{k} {v['ns_per_block_row']} ns a block row" for k, v in row.items()),
              flush=True)
    emit(result)


if __name__ == "__main__":
    main()
