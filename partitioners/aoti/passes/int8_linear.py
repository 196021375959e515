"""Int8LinearPass: products with int8 activations (--qact int8) over a few
static rows call kvexport's int8 kernel (kernels/int8_linear.cpp) in
AOTInductor's compiled code.

The stored program holds such a product as plain ATen: the rows rounded to
int8 codes times a step per block of 32 (passes/packed_weights.py,
int8_rows), the weight's codes in blocks dequantized, and a linear. This
pass, run only where a method is compiled, recognizes exactly that
arithmetic and replaces it with one kernel call, which rounds the rows the
same way and multiplies the codes as integers. Rows rounded with two terms
(--qact int8x2: int8_rows(x) + int8_rows(x - int8_rows(x))), to int16
codes (--qact int16: int16_rows, a step of largest magnitude / 32767) or
with a second term on each row's peak blocks (--qact int8-peak,
int8_peak_rows) take the same kernel, its `qact` argument saying which
(contract/schemes.py's QACT index). Anything that does not match the
decomposition exactly is left as it is. The eager implementation of the
op is the decomposition itself.
"""

from __future__ import annotations

import torch
import torch.fx

from kvexport.contract.schemes import QACT
from kvexport.partitioners.aoti.passes.packed_linear import _source, _stored, _val, dequantized
from kvexport.partitioners.aoti.passes.rows_linear import emit_rows_product
from kvexport.passes.base import RewritePass, arguments, static_rows
from kvexport.passes.packed_weights import (
    BLOCK, INV_127, INV_32767, PANEL_ROWS, SMALLEST_TOP, _dequantize_blocks, rounded_rows,
)

aten = torch.ops.aten


@torch.library.custom_op("kvexport::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                qact: int) -> torch.Tensor:
    """x [M, K] (rows contiguous), rounded per block of 32 as QACT[qact]
    rounds it (int8, int8x2 or int16), times the weight of codes in blocks,
    transposed: [M, N]."""
    rounded = rounded_rows(x, QACT[qact])
    return torch.nn.functional.linear(rounded, _dequantize_blocks(data, scale, offset, bits, x.dtype))


@int8_linear.register_fake
def _(x, data, scale, offset, bits, qact):
    return x.new_empty(x.shape[0], data.shape[0] * PANEL_ROWS)


INT8_LINEAR = torch.ops.kvexport.int8_linear.default


def _call(node: object, target, arity: int) -> bool:
    return isinstance(node, torch.fx.Node) and node.target is target and len(node.args) == arity


def int8_rows_of(node: object, inverse_limit: float = INV_127) -> torch.fx.Node | None:
    """x when `node` is exactly int8_rows(x) of a 2-d fp32 x: its blocks of
    32, their step (the larger of max and minus min, at least SMALLEST_TOP,
    times INV_127), round(blocks / step) * step; else None. With
    INV_32767, the same for int16_rows(x)."""
    result = _source(node)
    if not _call(result, aten.mul.Tensor, 2):
        return None
    rounded, step = result.args
    if not (_call(rounded, aten.round.default, 1) and _call(rounded.args[0], aten.div.Tensor, 2)):
        return None
    blocks, divisor = rounded.args[0].args
    if divisor is not step or not (_call(step, aten.mul.Tensor, 2) and step.args[1] == inverse_limit):
        return None
    found = block_tops_of(step.args[0])
    return found[1] if found is not None and found[0] is blocks else None


def block_tops_of(node: object) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(blocks, x) when `node` is exactly the largest magnitude of each
    block of 32 of a 2-d fp32 x, at least SMALLEST_TOP: clamp(maximum(
    amax(blocks), neg(amin(blocks)))) over the last dim of blocks = x viewed
    [M, K / 32, 32]; else None."""
    if not (_call(node, aten.clamp.default, 2) and node.args[1] == SMALLEST_TOP):
        return None
    top = node.args[0]
    if not (_call(top, aten.maximum.default, 2) and _call(top.args[1], aten.neg.default, 1)):
        return None
    largest, smallest = top.args[0], top.args[1].args[0]
    blocks = largest.args[0] if isinstance(largest, torch.fx.Node) else None
    if not (_call(largest, aten.amax.default, 3) and _call(smallest, aten.amin.default, 3)
            and smallest.args[0] is blocks and tuple(largest.args[1:]) == tuple(smallest.args[1:]) == ([-1], True)):
        return None
    if not (isinstance(blocks, torch.fx.Node) and blocks.target in (aten.view.default, aten.reshape.default)):
        return None
    shape, x = _val(blocks).shape, blocks.args[0]
    xv = _val(x)
    if not (isinstance(xv, torch.Tensor) and xv.dtype == torch.float32 and shape[-1] == BLOCK
            and tuple(xv.shape[:-1]) == tuple(shape[:-2]) and xv.shape[-1] == shape[-2] * BLOCK):
        return None
    return blocks, x


def rounded_rows_of(node: object) -> tuple[torch.fx.Node, int] | None:
    """(x, qact) when `node` is exactly int8_rows(x) (qact 1), int8x2_rows(x),
    int8_rows(x) + int8_rows(x - int8_rows(x)) with the first rounding
    computed once (2), int16_rows(x) (3), or int8_peak_rows(x) (4: the
    second term masked off the blocks below the row's largest top); else
    None."""
    x = int8_rows_of(node)
    if x is not None:
        return x, QACT.index("int8")
    x = int8_rows_of(node, INV_32767)
    if x is not None:
        return x, QACT.index("int16")
    if not _call(node, aten.add.Tensor, 2):
        return None
    first, second = node.args
    x, masked = int8_rows_of(first), _source(second)
    peak = _call(masked, aten.masked_fill.Scalar, 3) and masked.args[2] == 0.0
    error = int8_rows_of(masked.args[0] if peak else second)
    if x is None or not (_call(error, aten.sub.Tensor, 2) and error.args[0] is x and error.args[1] is first):
        return None
    if not peak:
        return x, QACT.index("int8x2")
    below = masked.args[1]
    if not (_call(below, aten.lt.Tensor, 2) and _call(below.args[1], aten.amax.default, 3)
            and below.args[1].args[0] is below.args[0] and tuple(below.args[1].args[1:]) == ([-2], True)):
        return None
    tops = block_tops_of(below.args[0])
    second_blocks = _val(masked.args[0])
    if tops is None or tops[1] is not x or tuple(second_blocks.shape) != tuple(_val(tops[0]).shape):
        return None
    return x, QACT.index("int8-peak")


def _panel_order(node: object, dims: list[int], rank: int) -> torch.fx.Node | None:
    """What `node` permutes when it is exactly permute(t, dims) of a `rank`-d t."""
    if not (_call(node, aten.permute.default, 2) and list(node.args[1]) == dims):
        return None
    inner = node.args[0]
    return inner if isinstance(_val(inner), torch.Tensor) and _val(inner).dim() == rank else None


def _block_codes(node: object) -> tuple[torch.fx.Node, int] | None:
    """(data, bits) when `node` holds the codes of a blocks-format weight
    (passes/packed_weights.py, unpack_blocks): the uint8 data's quads
    [panels, blocks, quads, 8, 4] permuted to rows, for 4 bits after the low
    and the high nibbles of 4 quads are concatenated into 8."""
    quads = _panel_order(node, [0, 3, 1, 2, 4], 5)
    if quads is None or tuple(_val(quads).shape[-3:]) != (BLOCK // 4, PANEL_ROWS, 4):
        return None
    if _stored(_source(quads), torch.uint8):
        return _source(quads), 8
    if not (_call(quads, aten.cat.default, 2) and quads.args[1] in (2, -3) and len(quads.args[0]) == 2):
        return None
    low, high = quads.args[0]
    if not (_call(low, aten.bitwise_and.Scalar, 2) and low.args[1] == 15
            and _call(high, aten.bitwise_right_shift.Tensor_Scalar, 2) and high.args[1] == 4):
        return None
    pairs = low.args[0]
    data = _source(pairs)
    if high.args[0] is not pairs or not _stored(data, torch.uint8) or tuple(_val(pairs).shape[-3:]) != (4, PANEL_ROWS, 4):
        return None
    return data, 4


def _block_table(node: object) -> torch.fx.Node | None:
    """The stored scale or offset (fp32 or fp16, [panels, groups * 8]) when
    `node` is its table in row order (passes/packed_weights.py, unpack_table)."""
    inner = _panel_order(node, [0, 2, 1], 3)
    table = _source(inner) if inner is not None else None
    if not (_stored(table, torch.float32) or _stored(table, torch.float16)):
        return None
    return table if tuple(_val(inner).shape[1:]) == (_val(table).shape[1] // PANEL_ROWS, PANEL_ROWS) else None


def int8_product(linear: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, torch.fx.Node, int, int] | None:
    """(x, data, scale, offset, bits, qact) when `linear` multiplies
    int8_rows(x), int8x2_rows(x) or int16_rows(x) by a blocks-format
    weight's dequantization; else None."""
    given = arguments(linear)
    rounded = rounded_rows_of(given["input"])
    found = dequantized(given["weight"], _block_codes, _block_table)
    if rounded is None or found is None:
        return None
    x, qact = rounded
    (data, bits), scale, offset, product = found
    (panels, width), (scale_panels, columns), k = _val(data).shape, _val(scale).shape, _val(x).shape[-1]
    groups, n = columns // PANEL_ROWS, panels * PANEL_ROWS
    w = _val(given["weight"])
    if (width == k * bits and scale_panels == panels and columns % PANEL_ROWS == 0 and groups
            and tuple(_val(offset).shape) == (panels, columns) and _val(offset).dtype == _val(scale).dtype
            and k % (BLOCK * groups) == 0 and tuple(_val(product).shape[-2:]) == (groups, k // groups)
            and w.dtype == torch.float32 and tuple(w.shape) == (n, k)):
        return x, data, scale, offset, bits, qact
    return None


class Int8LinearPass(RewritePass):
    """Products over the given static row counts, and over a row count
    known only at run time (a method taking up to --max-step-tokens: prefill
    slices) by codes of `dynamic_bits`: from 8 rows the kernel puts rows
    across its lanes, and reads each block of codes once for every 8 or 16
    rows (kernels/int8_linear.cpp), where the stored form dequantizes the
    whole weight to fp32 on every call and multiplies in fp32."""

    name = "int8_linear"
    leftover = "int8 products with the kernel's row counts left"

    def __init__(self, rows: tuple[int, ...], dynamic_bits: tuple[int, ...] = ()):
        self.rows, self.dynamic_bits = frozenset(rows), frozenset(dynamic_bits)

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        found = []
        for node in graph_module.graph.nodes:
            if node.target is not aten.linear.default:
                continue
            rows = static_rows(node.args[0])
            if rows in self.rows or (rows is None and self.dynamic_bits):
                product = int8_product(node)
                if product is not None and (rows is not None or product[4] in self.dynamic_bits):
                    found.append(node)
        return found

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        x, data, scale, offset, bits, qact = int8_product(node)
        return emit_rows_product(graph, node, INT8_LINEAR, data, scale, offset, bits, qact, x=x)
