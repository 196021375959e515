"""RowsLinearPass: fp32 linears over a few static rows call kvexport's
row kernel (kernels/rows_linear.cpp) in AOTInductor's compiled code.

The kernel reads each weight once at close to the memory's streaming rate
while it multiplies up to 8 rows in registers; the BLAS's small-row GEMM
reads at half that rate or less on some CPUs (bench/floor.py). Which row
counts gain is measured once per machine (partitioners/aoti/kernels/probe.py).

The rewrite happens only where a method is compiled (partitioners/aoti/compile.py),
never in the program a package stores: that stays plain aten, so any runtime
can still read it. In the compiled code the operator is a direct C call into
the kernel, linked into the method's library (kernels/build.py); its
eager implementation here is the reference `F.linear`, which tracing and
tests run.
"""

from __future__ import annotations

import torch
import torch.fx

from kvexport.passes.base import emit
from kvexport.passes.weight_stationary_linear import Fp32LinearRewrite, fp32_linears

aten = torch.ops.aten


@torch.library.custom_op("kvexport::rows_linear", mutates_args=())
def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows contiguous) times weight [N, K] transposed: [M, N]."""
    return torch.nn.functional.linear(x, weight)


@rows_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


ROWS_LINEAR = torch.ops.kvexport.rows_linear.default


class RowsLinearPass(Fp32LinearRewrite):
    name = "rows_linear"
    leftover = "fp32 linears over the row kernel's row counts left on the BLAS"

    def __init__(self, rows: tuple[int, ...]):
        super().__init__(max(rows, default=0))
        self.rows = frozenset(rows)

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        """Weights the kernel reads row by row: contiguous (a view of a
        parameter stays on the BLAS)."""
        return [n for n in fp32_linears(graph_module, self.max_rows)
                if self.parts(n)[5] in self.rows and self.parts(n)[1].meta["val"].is_contiguous()]

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        x, weight, bias, lead, width, rows, out_features = self.parts(node)

        def op(target, *args, **kwargs):
            return emit(graph, node, target, *args, **kwargs)

        flat = op(aten.clone.default, op(aten.reshape.default, x, [rows, width]), memory_format=torch.contiguous_format)
        out = op(ROWS_LINEAR, flat, weight)
        if bias is not None:
            out = op(aten.add.Tensor, out, bias)
        return op(aten.reshape.default, out, [*lead, out_features])
