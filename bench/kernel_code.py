"""The C++ inductor writes for a fused product over packed codes, for the
instruction set it targets here (set ATEN_CPU_CAPABILITY=avx2 to see AVX2
code on an AVX-512 machine): prints the vector loads of the kernel and
whether any of them reads fewer bytes than a full vector.

    python bench/kernel_code.py [--bits 4] [--group 32] [--rows 1]

A load of a byte-wide type (`Vectorized<int8_t>::loadu(p, 8)`) fills a
vector element by element on AVX2; packed int32 words load whole.
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from kvexport.exporter.quantization.quantize import PackedLinear, packed, quantize_weight
from kvexport.passes.base import run_passes
from kvexport.passes.decompose_custom_ops import DecomposeCustomOpsPass
from kvexport.passes.packed_weights import FusedPackedLinearPass

LOAD = re.compile(r"VectorizedN?<([\w:]+)(?:,\s*\d+)?>::loadu\(([^;]*)\)")


def kernel_loads(bits: int, group: int, rows: int, out: int = 256, width: int = 576) -> dict:
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.utils import run_and_get_code

    weight = torch.randn(out, width)
    words, scale, offset, lane_bits = packed(quantize_weight(weight, bits, group))
    module = PackedLinear(words, scale, offset, lane_bits, out).eval()
    x = torch.randn(rows, width)
    program = torch.export.export(module, (x,))
    run_passes(program.graph_module, [FusedPackedLinearPass(), DecomposeCustomOpsPass()], "product")
    compiled = torch.compile(program.module(), fullgraph=True)
    _, code = run_and_get_code(compiled, x)
    loads = sorted({f"{dtype}: {args.split(',')[-1].strip().removeprefix('static_cast<int64_t>(').rstrip(')L')}" for dtype, args in LOAD.findall("\n".join(code))})
    narrow = [line for line in loads if line.split(":")[0] in ("int8_t", "uint8_t", "int16_t")]
    return {"isa": str(pick_vec_isa()), "bits": bits, "group": group, "rows": rows, "loads": loads, "byte_loads": narrow}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(kernel_loads(args.bits, args.group, args.rows), indent=1))


if __name__ == "__main__":
    main()
