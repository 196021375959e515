"""Passes for quantized weights, which reach the graph as their stored
integer tensors plus the arithmetic that dequantizes them (torchao's, see
exporter/quantize.py).

GatherRowsBeforeDequantizePass (every backend): an embedding lookup over a
weight dequantized per row dequantizes the whole table on every call; it
gathers the selected rows of the stored tensors first and dequantizes those
only. Runs before DecomposeCustomOpsPass, on torchao's dequantize node.

FusedDequantizeMatmulPass (compiling CPU backends): a product of a few rows
with a weight dequantized at run time is written as a multiply and a sum
over the input width, so the compiler fuses the dequantization into the
product and reads the integers once; as a matrix product it would write the
dequantized weight out in full first (4 x the bytes of an int8 weight, on
every call). Only static row counts up to `max_rows`; a prefill keeps the
matrix product, where the dequantization is shared by many rows.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from kvexport.passes.base import Pass, emit, emit_shape
from kvexport.passes.check_step_width import USER_INPUTS_META

aten = torch.ops.aten


def _dequantize_op():
    return getattr(getattr(torch.ops, "torchao", None), "dequantize_affine", None)


class GatherRowsBeforeDequantizePass(Pass):
    name = "gather_rows_before_dequantize"

    def _candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        op = _dequantize_op()
        if op is None:
            return []
        found = []
        for node in graph_module.graph.nodes:
            if node.target is not aten.embedding.default:
                continue
            weight = node.args[0]
            if isinstance(weight, torch.fx.Node) and weight.target is op.default and list(weight.args[1])[0] == 1:
                found.append(node)
        return found

    def call(self, graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
        graph = graph_module.graph
        candidates = self._candidates(graph_module)
        for node in candidates:
            dequantize, indices = node.args[0], node.args[1]
            names = [a.name for a in dequantize.target._schema.arguments]
            arguments = dict(zip(names, dequantize.args)) | dict(dequantize.kwargs)
            width = dequantize.meta["val"].shape[-1]
            with graph.inserting_before(node):
                flat = emit(graph, node, aten.reshape.default, indices, [-1])
                for name in ("input", "scale", "zero_point"):  # the per-row tensors
                    if arguments.get(name) is not None:
                        arguments[name] = emit(graph, node, aten.embedding.default, arguments[name], flat)
                values = emit(graph, node, dequantize.target, **arguments)
                out = emit(graph, node, aten.reshape.default, values, [*emit_shape(graph, node, indices), width])
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            if not dequantize.users:
                graph.erase_node(dequantize)
        return graph_module, bool(candidates)


def _from_stored_tensors(node: torch.fx.Node, user_inputs: set[str]) -> bool:
    """Whether a value is computed from stored tensors only (no user input
    reaches it) with an integer tensor among them: a dequantized weight."""
    seen, todo, integer = set(), [node], False
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name in user_inputs:
                return False
            val = n.meta.get("val")
            integer |= isinstance(val, torch.Tensor) and not val.dtype.is_floating_point
        todo.extend(n.all_input_nodes)
    return integer and node.op != "placeholder"


def _static_rows(x: torch.fx.Node) -> int | None:
    lead = x.meta["val"].shape[:-1]
    return math.prod(lead) if all(isinstance(d, int) for d in lead) else None


class FusedDequantizeMatmulPass(Pass):
    name = "fused_dequantize_matmul"

    def __init__(self, max_rows: int = 8):
        self.max_rows = max_rows

    def _candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        """linear(x, W [out, in]) and mm(x, W' [in, out]) nodes to rewrite."""
        user_inputs = set(graph_module.meta.get(USER_INPUTS_META, ()))
        found = []
        for node in graph_module.graph.nodes:
            if node.target not in (aten.linear.default, aten.mm.default):
                continue
            x, weight = node.args[0], node.args[1]
            rows = _static_rows(x)
            if rows is not None and rows <= self.max_rows and _from_stored_tensors(weight, user_inputs):
                found.append(node)
        return found

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        if USER_INPUTS_META not in graph_module.meta:
            raise AssertionError("the graph does not record its user inputs")

    def call(self, graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
        graph = graph_module.graph
        candidates = self._candidates(graph_module)
        for node in candidates:
            x, weight = node.args[0], node.args[1]
            bias = node.args[2] if node.target is aten.linear.default and len(node.args) > 2 else None
            lead, width = list(x.meta["val"].shape[:-1]), x.meta["val"].shape[-1]
            with graph.inserting_before(node):
                if node.target is aten.mm.default:  # weight [in, out]: a transposed view, folded by the compiler
                    weight = emit(graph, node, aten.t.default, weight)
                out_features = weight.meta["val"].shape[0]
                columns = emit(graph, node, aten.reshape.default, x, [math.prod(lead), 1, width])
                products = emit(graph, node, aten.mul.Tensor, columns, weight)
                out = emit(graph, node, aten.sum.dim_IntList, products, [-1])
                if bias is not None:
                    out = emit(graph, node, aten.add.Tensor, out, bias)
                out = emit(graph, node, aten.reshape.default, out, [*lead, out_features])
            node.replace_all_uses_with(out)
            graph.erase_node(node)
        return graph_module, bool(candidates)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        left = self._candidates(graph_module)
        if left:
            raise AssertionError(f"products with dequantized weights left: {[n.name for n in left[:5]]}")
