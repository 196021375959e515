"""WeightStationaryLinearPass: computes a linear over a few rows as
`W @ x.T` instead of `x @ W.T`, for CPU backends.

Both are one matrix product over the same numbers; what changes is which
operand the BLAS streams. With MKL (the CPU wheel's BLAS) `x @ W.T` over 2-8
rows packs the whole weight matrix on every call, and a single row goes to a
matrix-vector product that reads weights at about half the memory bandwidth.
`W @ x.T` streams the weights once, at full bandwidth, for 2-4 rows; a single
row is padded to two to take that path. `bench/linear_layout.py` measures
both layouts for a model's weight shapes on the machine at hand.

Only static row counts up to `max_rows` are rewritten: over many rows (a
prefill) both layouts are compute-bound and alike, and a dynamic count could
not choose the padding. Row counts in `skip_rows` stay linears: the AOTInductor
backend gives those to its row kernel (partitioners/aoti/passes/rows_linear.py).
"""

from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from kvexport.passes.base import RewritePass, arguments, emit, static_rows

aten = torch.ops.aten
_LINEAR = aten.linear.default


def _plain_weight(node: torch.fx.Node) -> bool:
    """A 2-D fp32 weight (the layouts were measured for fp32 products; bf16
    ones go to other kernels)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return type(val) is FakeTensor and val.dim() == 2 and val.dtype == torch.float32


def fp32_linears(graph_module: torch.fx.GraphModule, max_rows: int) -> list[torch.fx.Node]:
    """The linears over a 2-D fp32 weight with a static count of 1..max_rows rows."""
    found = []
    for node in graph_module.graph.nodes:
        if node.target is not _LINEAR:
            continue
        given = arguments(node)
        rows = static_rows(given["input"])
        if _plain_weight(given["weight"]) and rows is not None and 1 <= rows <= max_rows:
            found.append(node)
    return found


class Fp32LinearRewrite(RewritePass):
    """Rewrites every fp32 linear over 1..max_rows static rows; `parts`
    gives a rewrite what it needs of one."""

    def __init__(self, max_rows: int = 8):
        self.max_rows = max_rows

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return fp32_linears(graph_module, self.max_rows)

    @staticmethod
    def parts(node: torch.fx.Node) -> tuple:
        """(x, weight, bias, leading dims, width, rows, out_features)."""
        given = arguments(node)
        x, weight = given["input"], given["weight"]
        lead, width = list(x.meta["val"].shape[:-1]), x.meta["val"].shape[-1]
        return x, weight, given.get("bias"), lead, width, static_rows(x), weight.meta["val"].shape[0]


class WeightStationaryLinearPass(Fp32LinearRewrite):
    name = "weight_stationary_linear"
    leftover = "linears left in the row-major layout"

    def __init__(self, max_rows: int = 8, skip_rows: tuple[int, ...] = ()):
        super().__init__(max_rows)
        self.skip_rows = frozenset(skip_rows)

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [n for n in super().candidates(graph_module) if self.parts(n)[5] not in self.skip_rows]

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        x, weight, bias, lead, width, rows, out_features = self.parts(node)
        flat = emit(graph, node, aten.reshape.default, x, [rows, width])
        if rows == 1:
            flat = emit(graph, node, aten.constant_pad_nd.default, flat, [0, 0, 0, 1])
        columns = emit(graph, node, aten.mm.default, weight, emit(graph, node, aten.t.default, flat))
        if bias is not None:
            columns = emit(graph, node, aten.add.Tensor, columns, emit(graph, node, aten.unsqueeze.default, bias, 1))
        out = emit(graph, node, aten.t.default, columns)
        if rows == 1:
            out = emit(graph, node, aten.slice.Tensor, out, 0, 0, 1)
        out = emit(graph, node, aten.clone.default, out, memory_format=torch.contiguous_format)
        return emit(graph, node, aten.reshape.default, out, [*lead, out_features])
