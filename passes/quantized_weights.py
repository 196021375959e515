"""Passes for weights that reach the graph as stored integer tensors plus
the arithmetic that dequantizes them (torchao's 8da4w, see
exporter/quantization/quantize.py; packed weights have their own, passes/packed_weights.py).

FusedDequantizeMatmulPass (AOTInductor on the CPU): a product of a few rows
with a weight dequantized at run time is written as a multiply and a sum
over the input width, so the compiler fuses the dequantization into the
product and reads the integers once; as a matrix product it would write the
dequantized weight out in full first (4 x the bytes of an int8 weight, on
every call). The rows are pinned to memory first (inductor's
force_stride_order): left to fusion, whatever computes them (a norm, 8da4w's
activation quantization) would be recomputed for every output column, 15 x
slower for an LM head here. Only static row counts up to `max_rows`; a
prefill keeps the matrix product, where the dequantization is shared by many
rows. Needs a compiler: run eagerly, the multiply would materialize
rows x out x in floats.
"""

from __future__ import annotations

import torch
import torch.fx

from kvexport.passes.base import RewritePass, arguments, emit, static_rows
from kvexport.passes.check_step_width import USER_INPUTS_META

aten = torch.ops.aten
STORED_INTEGERS = (torch.int8, torch.uint8)


def dequantized_weights(graph_module: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The values computed from stored tensors only (no user input reaches
    them) with a stored integer tensor among those: dequantized weights and
    the steps on the way. One pass over the graph, in order."""
    user_inputs = set(graph_module.meta[USER_INPUTS_META])
    from_inputs: set[torch.fx.Node] = set()
    from_integers: set[torch.fx.Node] = set()
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if node.name in user_inputs:
                from_inputs.add(node)
            elif isinstance(val, torch.Tensor) and val.dtype in STORED_INTEGERS:
                from_integers.add(node)
        elif any(i in from_inputs for i in node.all_input_nodes):
            from_inputs.add(node)
        elif any(i in from_integers for i in node.all_input_nodes):
            from_integers.add(node)
    return {n for n in from_integers if n.op != "placeholder"}


def _operands(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None]:
    """(x, weight, bias) of linear(x, W [out, in], bias) or mm(x, W' [in, out])."""
    given = arguments(node)
    if node.target is aten.linear.default:
        return given["input"], given["weight"], given.get("bias")
    return given["self"], given["mat2"], None


class FusedDequantizeMatmulPass(RewritePass):
    name = "fused_dequantize_matmul"
    leftover = "products with dequantized weights left"

    def __init__(self, max_rows: int = 8):
        import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)

        self.max_rows = max_rows

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        """Products over a dequantized weight and a few rows."""
        weights = dequantized_weights(graph_module)
        found = []
        for node in graph_module.graph.nodes:
            if node.target not in (aten.linear.default, aten.mm.default):
                continue
            x, weight, _ = _operands(node)
            rows = static_rows(x)
            if weight in weights and rows is not None and 1 <= rows <= self.max_rows:
                found.append(node)
        return found

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        if USER_INPUTS_META not in graph_module.meta:
            raise AssertionError("the graph does not record its user inputs")

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        x, weight, bias = _operands(node)
        if node.target is aten.mm.default:  # weight [in, out]: a transposed view, folded by the compiler
            weight = emit(graph, node, aten.t.default, weight)
        lead, width = list(x.meta["val"].shape[:-1]), x.meta["val"].shape[-1]
        rows, out_features = static_rows(x), weight.meta["val"].shape[0]
        pinned = emit(graph, node, aten.reshape.default, x, [rows, width])
        pinned = emit(graph, node, torch.ops.prims.inductor_force_stride_order.default, pinned, [width, 1])
        columns = emit(graph, node, aten.reshape.default, pinned, [rows, 1, width])
        products = emit(graph, node, aten.mul.Tensor, columns, weight)
        out = emit(graph, node, aten.sum.dim_IntList, products, [-1])
        if bias is not None:
            out = emit(graph, node, aten.add.Tensor, out, bias)
        return emit(graph, node, aten.reshape.default, out, [*lead, out_features])
