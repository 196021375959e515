"""RowsLinearPass: fp32 and bf16 linears over a few static rows call
kvexport's row kernel (kernels/rows_linear.cpp) in AOTInductor's compiled
code. A bf16 weight is read as bf16 (half fp32's bytes) and multiplied in
fp32; the result is rounded to bf16, as torch's bf16 linear rounds it.

Where torch has no fast bf16 product (an AVX2 CPU: no AVX-512, so no oneDNN
bf16 GEMM, and ATen's own bf16 GEMM ran 34 GFLOPS on a prefill's products
where the row kernel ran 131, bench/bf16_products.py), bf16 linears take the
kernel at every row count, prefill slices and dynamic rows included.

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

from torch._subclasses.fake_tensor import FakeTensor

from kvexport.passes.base import RewritePass, arguments, emit, emit_shape, static_rows

KERNEL_DTYPES = (torch.float32, torch.bfloat16)

aten = torch.ops.aten


@torch.library.custom_op("kvexport::rows_linear", mutates_args=())
def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows contiguous) times weight [N, K] transposed: [M, N],
    fp32 or bf16 (both the same)."""
    return torch.nn.functional.linear(x, weight)


@rows_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


ROWS_LINEAR = torch.ops.kvexport.rows_linear.default


def emit_rows_product(graph: torch.fx.Graph, node: torch.fx.Node, target, *operands,
                      x: torch.fx.Node | None = None) -> torch.fx.Node:
    """What replaces linear `node` by a kernel `target(x rows, *operands)`
    that returns [rows, out_features]: x (the linear's input unless given,
    of the same shape) flattened into contiguous rows, the bias added, the
    leading dims restored (a dynamic one read back from x)."""
    given = arguments(node)
    x, bias = x if x is not None else given["input"], given.get("bias")
    width, out_features, rows = x.meta["val"].shape[-1], node.meta["val"].shape[-1], static_rows(x)

    def op(op_target, *args, **kwargs):
        return emit(graph, node, op_target, *args, **kwargs)

    flat = op(aten.clone.default, op(aten.reshape.default, x, [-1 if rows is None else rows, width]),
              memory_format=torch.contiguous_format)
    out = op(target, flat, *operands)
    if bias is not None:
        out = op(aten.add.Tensor, out, bias)
    return op(aten.reshape.default, out, [*emit_shape(graph, node, x)[:-1], out_features])


class RowsLinearPass(RewritePass):
    name = "rows_linear"
    leftover = "fp32 and bf16 linears over the row kernel's row counts left on the BLAS"

    def __init__(self, rows: tuple[int, ...], bf16_every_row_count: bool = False):
        self.rows = frozenset(rows)
        self.bf16_every_row_count = bf16_every_row_count

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        """Linears whose weight the kernel reads row by row: 2-d, contiguous
        (a view of a parameter stays on the BLAS), fp32 or bf16 like x."""
        found = []
        for node in graph_module.graph.nodes:
            if node.target is not torch.ops.aten.linear.default:
                continue
            given = arguments(node)
            x, weight = given["input"], given["weight"].meta.get("val")
            if not (type(weight) is FakeTensor and weight.dim() == 2 and weight.dtype in KERNEL_DTYPES
                    and weight.is_contiguous() and x.meta["val"].dtype == weight.dtype):
                continue
            if static_rows(x) in self.rows or (self.bf16_every_row_count and weight.dtype == torch.bfloat16):
                found.append(node)
        return found

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        return emit_rows_product(graph, node, ROWS_LINEAR, arguments(node)["weight"])
