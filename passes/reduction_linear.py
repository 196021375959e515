"""ReductionLinearPass: an fp32 linear over a few static rows as a sum of
products (`(x[:, None, :] * W).sum(-1)`), a reduction the compiler writes
itself, for AOTInductor on the CPU.

The BLAS reads a weight for a product with one or two rows at whatever rate
its kernels for that CPU reach: near the machine's streaming-read rate on
some, half of it on others (the mv path on AMD, measured by
`bench/floor.py`). The generated reduction loads whole vectors of the
weight along K with the CPU's own instruction set, one pass per row. Which
is faster is a property of the machine, so the export measures both
(partitioners/aoti.py, `fp32_product_rows`) and this pass takes the row
counts where the reduction won; the rest stay on the BLAS.

The rows are pinned to memory first, so the compiler cannot fold what
produced them (a norm, a gate) into the reduction and recompute it for
every output column.
"""

from __future__ import annotations

import torch
import torch.fx

from kvexport.passes.base import emit
from kvexport.passes.weight_stationary_linear import Fp32LinearRewrite

aten = torch.ops.aten


class ReductionLinearPass(Fp32LinearRewrite):
    name = "reduction_linear"
    leftover = "fp32 linears with few rows left on the BLAS"

    def __init__(self, max_rows: int):
        import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)

        super().__init__(max_rows)

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        x, weight, bias, lead, width, rows, out_features = self.parts(node)

        def op(target, *args, **kwargs):
            return emit(graph, node, target, *args, **kwargs)

        pinned = op(aten.reshape.default, x, [rows, width])
        pinned = op(torch.ops.prims.inductor_force_stride_order.default, pinned, [width, 1])
        products = op(aten.mul.Tensor, op(aten.reshape.default, pinned, [rows, 1, width]), op(aten.unsqueeze.default, weight, 0))
        out = op(aten.sum.dim_IntList, products, [-1])  # [rows, N]
        if bias is not None:
            out = op(aten.add.Tensor, out, bias)
        return op(aten.reshape.default, out, [*lead, out_features])
