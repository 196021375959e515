"""PackedLinearPass: products of a few static rows by a packed integer weight
(passes/packed_weights.py) call kvexport's packed kernel
(kernels/packed_linear.cpp) in AOTInductor's compiled code.

The stored program holds such a product as plain ATen: the weight
dequantized (each lane's codes a shift and a mask of the words, concatenated,
cast, times the group's scale plus its offset) and a linear. The backend's
partitioner leaves the kernel's row counts in that form (the stored program
stays on the allowlist); this pass, run only where a method is compiled,
recognizes exactly that arithmetic, rooted at one words tensor and its
scale and offset, and replaces the linear with one kernel call: the weight is
never dequantized to memory, and each vector of words is unpacked once for
several rows. Anything that does not match the decomposition exactly is left
as it is. The eager implementation of the op is the decomposition itself.
"""

from __future__ import annotations

import torch
import torch.fx

from kvexport.partitioners.aoti.passes.rows_linear import emit_rows_product
from kvexport.passes.base import RewritePass, arguments, static_rows
from kvexport.passes.packed_weights import BITS, _dequantize_packed, lanes_of

aten = torch.ops.aten

# ops the decomposition puts between a value and what it is computed from,
# which change its shape or dtype but not which numbers it holds, in order
# (a slice only when it keeps the first rows)
_PASS_THROUGH = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
                 aten._to_copy.default, aten.clone.default, aten.alias.default}


@torch.library.custom_op("kvexport::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                  rows: int) -> torch.Tensor:
    """x [M, K] (rows contiguous) times the first `rows` rows of the packed
    weight, transposed: [M, rows]."""
    return torch.nn.functional.linear(x, _dequantize_packed(words, scale, offset, bits, rows, x.dtype))


@packed_linear.register_fake
def _(x, words, scale, offset, bits, rows):
    return x.new_empty(x.shape[0], rows)


PACKED_LINEAR = torch.ops.kvexport.packed_linear.default


def _source(node: object) -> object:
    """What `node` holds the numbers of, past reshapes, casts and slices."""
    while isinstance(node, torch.fx.Node) and (node.target in _PASS_THROUGH or _first_rows(node)):
        node = node.args[0]
    return node


def _first_rows(node: torch.fx.Node) -> bool:
    """A slice that keeps the first rows: x[:n]."""
    if node.target is not aten.slice.Tensor:
        return False
    given = arguments(node)
    return given.get("dim", 0) == 0 and given.get("start") in (None, 0) and given.get("step", 1) in (None, 1)


def _val(node: object):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _stored(node: object, dtype: torch.dtype) -> bool:
    """A 2-d tensor of `dtype` that the program takes as an input (a weight)."""
    val = _val(node)
    return (isinstance(node, torch.fx.Node) and node.op == "placeholder" and isinstance(val, torch.Tensor)
            and val.dtype == dtype and val.dim() == 2)


def _lane_words(node: object, bits: int, lane: int) -> torch.fx.Node | None:
    """The words placeholder when `node` is lane `lane` of it: (words >> bits * lane) & mask
    (the shift left out for lane 0)."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.bitwise_and.Scalar and node.args[1] == (1 << bits) - 1):
        return None
    inner = node.args[0]
    if isinstance(inner, torch.fx.Node) and inner.target is aten.bitwise_right_shift.Tensor_Scalar:
        if inner.args[1] != bits * lane:
            return None
        inner = inner.args[0]
    elif lane:
        return None
    return inner if _stored(inner, torch.int32) else None


def _codes(node: object) -> tuple[torch.fx.Node, int] | None:
    """(words, bits) when `node` is the concatenation of every lane of one words tensor, in order."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.cat.default):
        return None
    parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    for bits in BITS:
        if dim == 0 and len(parts) == lanes_of(bits):
            found = {_lane_words(part, bits, lane) for lane, part in enumerate(parts)}
            if len(found) == 1 and None not in found:
                return found.pop(), bits
    return None


def _fp32_table(node: object) -> torch.fx.Node | None:
    return node if _stored(node, torch.float32) else None


def dequantized(weight: object, codes_of, table_of=_fp32_table) -> tuple[object, torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(what `codes_of` found, scale, offset, the product) when `weight` is
    codes * scale + offset per group, the codes recognised by `codes_of`
    and the scale and offset by `table_of` (each a node -> its stored form,
    or None; by default fp32 weights as they are)."""
    total = _source(weight)
    if not (isinstance(total, torch.fx.Node) and total.target is aten.add.Tensor and len(total.args) == 2):
        return None
    for product, offset in (total.args, reversed(total.args)):
        product, offset = _source(product), table_of(_source(offset))
        if not (isinstance(product, torch.fx.Node) and product.target is aten.mul.Tensor and offset is not None):
            continue
        for codes, scale in (product.args, reversed(product.args)):
            codes, scale = codes_of(_source(codes)), table_of(_source(scale))
            if codes is not None and scale is not None:
                return codes, scale, offset, product
    return None


def packed_weight(weight: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, int] | None:
    """(words, scale, offset, bits) when `weight` is exactly the packed
    weight's dequantization, codes * scale + offset per group; else None."""
    found = dequantized(weight, _codes)
    if found is None:
        return None
    (words, bits), scale, offset, product = found
    (r, k), (scale_rows, groups) = _val(words).shape, _val(scale).shape
    w = _val(weight)
    if (scale_rows == lanes_of(bits) * r and tuple(_val(offset).shape) == (scale_rows, groups)
            and k % (8 * groups) == 0 and tuple(_val(product).shape[-2:]) == (groups, k // groups)
            and w.dtype == torch.float32 and w.dim() == 2 and w.shape[1] == k and w.shape[0] <= scale_rows):
        return words, scale, offset, bits
    return None


class PackedLinearPass(RewritePass):
    name = "packed_linear"
    leftover = "packed products with the kernel's row counts left"

    def __init__(self, rows: tuple[int, ...]):
        self.rows = frozenset(rows)

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        found = []
        for node in graph_module.graph.nodes:
            if node.target is not aten.linear.default:
                continue
            given = arguments(node)
            x, weight = given["input"], given["weight"]
            val = _val(x)
            if (static_rows(x) in self.rows and isinstance(val, torch.Tensor) and val.dtype == torch.float32
                    and packed_weight(weight) is not None):
                found.append(node)
        return found

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        words, scale, offset, bits = packed_weight(arguments(node)["weight"])
        return emit_rows_product(graph, node, PACKED_LINEAR, words, scale, offset, bits, node.meta["val"].shape[-1])
