"""The row kernel (kernels/rows_linear.cpp) or the int8 kernel
(int8_linear.cpp) as another revision built it against the working tree's,
alternated in one process over a model shape's linears from memory: each
revision's kernels are built from that revision's sources with today's
flags, and each round times both on the same operands, the order flipped
every round.

    python bench/ab_kernels.py --base HEAD~1 [--isa avx2] [--shape llama3.2-1b] [--rows 1,4,8] [--dtype fp32,bf16]
    python bench/ab_kernels.py --base HEAD~1 --shim --rows 512 --dtype bf16 --layers 2 --rounds 6
    python bench/ab_kernels.py --base HEAD~1 --dtype 4w,8w [--rows 1,4,8] [--layers 2] [--in-cache] [--qact int16]

`--dtype 4w` and `8w` time the int8 kernel's entry (int8 activations, or
`--qact`'s: the VNNI build where the CPU has it) on 4-bit codes in groups
of 32 and 8-bit codes with a scale per row, as 4w and 8w packages store
them (fp16 tables); `--in-cache` multiplies by one weight that stays in
the caches instead, 200 times a round (SmolLM2's gate, 1536 x 576: 442 KB
at 4 bits, half on each of two cores' L2; 1.8 MB in bf16): the kernel's
arithmetic alone.

`--shim` calls each build's C shim on tensors, as compiled code calls it,
instead of the kernel's entry: from 128 rows its bf16 products widen their
operands for torch's fp32 GEMM (shims.cpp), which is where a prefill
slice's bf16 products run on a CPU without AVX-512.

Reports, per row count and dtype, each build's median time over the
layers, the rate it reads the weights at, the median of the per-round
ratios (working tree over base: below 1 is faster) and whether both builds
give the same bits. `--isa avx2` builds AVX2 code on an AVX-512 machine;
the bf16 products are the build's own (vdpbf16ps where the CPU and the
build have it, the shift otherwise).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from big_model import SHAPES
from common import cpu_model, emit
from packed_kernel import HOT, blocks
from kvexport.contract.schemes import QACT
from kvexport.partitioners.aoti.kernels import build
from kvexport.partitioners.aoti.kernels.signatures import INT8_LINEAR, ROWS_LINEAR, ROWS_LINEAR_BF16

REPO = Path(__file__).resolve().parent.parent
KERNELS = build.HERE.relative_to(REPO)


def linear_shapes(shape: str) -> list[tuple[int, int]]:
    """A decoder layer's products, (out, in): q/k/v and gate/up fused as the
    aoti backend fuses them, then o and down."""
    spec = SHAPES[shape]
    hidden, heads, kv_heads = spec["hidden_size"], spec["num_attention_heads"], spec["num_key_value_heads"]
    head_dim = spec.get("head_dim", hidden // heads)
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * spec["intermediate_size"], hidden),
            (hidden, spec["intermediate_size"])]


def build_revision(revision: str, isa: str | None, out: Path, kind: str = "shared") -> Path:
    """The shared library of the kernels (`kind` "shared") or of kernels and
    shims ("shims") as `revision` wrote them, compiled with the working
    tree's commands (its header: the C signatures must not have changed
    between the two)."""
    sources = out / "kernels"
    sources.mkdir(parents=True)
    for file in build.FILES:
        path = (KERNELS / file.name).as_posix()
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{path}"], capture_output=True, text=True,
                              check=True).stdout
        (sources / file.name).write_text(text)
    (out / "kernels.h").write_text(build.header())

    def moved(command: list[str]) -> list[str]:
        return [part.replace(str(build.HERE), str(sources)) for part in command]

    for step, objects in (("objects", None), (kind, out)):
        for command in build._commands(step, isa, out, objects):
            subprocess.run(moved(command), check=True, capture_output=True)
    return out / (f"lib{build.LIBRARY}.so" if kind == "shared" else f"lib{build.LIBRARY}_shims.so")


CODES = {"4w": (4, 32), "8w": (8, None)}  # the int8 kernel's weights: bits, and the group (None: one a row)


def typed(library: Path, kernel):
    """`kernel`'s entry (a signatures.Kernel) in `library`, typed by its declared signature."""
    function = getattr(ctypes.CDLL(str(library)), kernel.symbol)
    function.argtypes, function.restype = kernel.argtypes(), None
    return function


def entry(library: Path, dtype: str):
    """The row kernel's fp32 or bf16 entry, or the int8 kernel's, in `library`."""
    return typed(library, INT8_LINEAR if dtype in CODES else ROWS_LINEAR if dtype == "fp32" else ROWS_LINEAR_BF16)


def shim(library: Path):
    """rows_linear's shim in `library`, called on tensors."""
    shims = build.Shims(library=library)
    return lambda x, weight: shims.call("rows_linear", x, weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the git revision to compare the working tree's kernels with")
    parser.add_argument("--isa", choices=build.ISAS, default=None, help="instruction set (default: inductor's here)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3.2-1b")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--dtype", default="fp32,bf16")
    parser.add_argument("--layers", type=int, default=8, help="layers' weights walked a round (more than the caches hold)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--shim", action="store_true", help="call the C shim on tensors, as compiled code does")
    parser.add_argument("--in-cache", action="store_true", help="a 1536 x 576 weight, 200 times a round")
    parser.add_argument("--qact", choices=[q for q in QACT if q != "none"], default="int8",
                        help="the activations' rounding of --dtype 4w and 8w")
    args = parser.parse_args()
    if args.shim and any(d in CODES for d in args.dtype.split(",")):
        parser.error("--shim times the row kernel's shim only (--dtype fp32,bf16)")

    with tempfile.TemporaryDirectory() as scratch:
        if args.shim:
            libraries = {"base": build_revision(args.base, args.isa, Path(scratch), "shims"),
                         "tree": build.shims_library(args.isa)}
        else:
            libraries = {"base": build_revision(args.base, args.isa, Path(scratch)),
                         "tree": build._build("shared", args.isa) / f"lib{build.LIBRARY}.so"}
        shapes = [HOT] if args.in_cache else linear_shapes(args.shape)
        results = []
        for dtype in args.dtype.split(","):
            torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype, torch.float32)
            calls = {name: shim(library) if args.shim else entry(library, dtype) for name, library in libraries.items()}
            layers, repeat = (1, 200) if args.in_cache else (args.layers, 1)
            if dtype in CODES:  # (out, in) of each weight beside its operands
                (bits, group), g = CODES[dtype], torch.Generator().manual_seed(0)
                weights = [((n, k), blocks(n, k, bits, group or k, g)) for _ in range(layers) for n, k in shapes] * repeat
                weight_bytes = sum(t.numel() * t.element_size() for _, w in weights for t in w[:3])
            else:
                weights = [torch.randn(shape).to(torch_dtype) for _ in range(layers) for shape in shapes] * repeat
                weight_bytes = sum(w.numel() * w.element_size() for w in weights)
            width = max(k for _, k in shapes)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, width).to(torch_dtype)
                outs = {name: [torch.empty(rows, w[0][0] if dtype in CODES else w.shape[0]) for w in weights]
                        for name in calls}

                def run(name: str) -> float:
                    start = time.perf_counter()
                    if args.shim:  # each result is a new tensor (bf16 ones rounded), as compiled code gets it
                        outs[name] = [calls[name](x[:, :w.shape[1]], w) for w in weights]
                    elif dtype in CODES:
                        for ((n, k), (data, scale, offset, bits)), out in zip(weights, outs[name]):
                            calls[name](x.data_ptr(), width, data.data_ptr(), scale.data_ptr(), offset.data_ptr(),
                                        out.data_ptr(), rows, n, k, scale.shape[1] // 8, bits,
                                        scale.element_size() * 8, QACT.index(args.qact))
                    else:
                        for w, out in zip(weights, outs[name]):
                            calls[name](x.data_ptr(), width, w.data_ptr(), out.data_ptr(), rows, w.shape[0], w.shape[1])
                    return time.perf_counter() - start

                times = {name: [] for name in calls}
                for name in calls:
                    run(name)
                for round_ in range(args.rounds):
                    for name in (list(calls) if round_ % 2 == 0 else list(reversed(list(calls)))):
                        times[name].append(run(name))
                medians = {name: statistics.median(t) for name, t in times.items()}
                results.append({
                    "dtype": dtype, "rows": rows,
                    **{f"{name}_ms": round(m * 1e3, 2) for name, m in medians.items()},
                    **{f"{name}_gbps": round(weight_bytes / m / 1e9, 1) for name, m in medians.items()},
                    "tree_over_base": round(statistics.median(t / b for t, b in zip(times["tree"], times["base"])), 3),
                    "same_bits": all(torch.equal(a, b) for a, b in zip(outs["base"], outs["tree"])),
                })
                print(results[-1], flush=True)
            del weights
    emit({"cpu": cpu_model(), "isa": args.isa or build._isa(), "shape": args.shape, "base": args.base,
          "entry": "shim" if args.shim else "kernel", "in_cache": args.in_cache, "qact": args.qact, "layers": args.layers, "rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
