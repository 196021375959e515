"""Packed integer weights: the stored formats (row lanes; blocks, for
products with int8 activations), the operators that say what they mean, and
the form AOTInductor compiles for a product with a few rows.

Format (row lanes). Codes of `bits` bits (4 or 8) sit `lanes = 32 // bits`
to an int32 word: lane b of word [r, k] holds code [b * R + r, k] of the
[N, K] code matrix, where R = ceil(N / lanes) is the number of word rows
(rows past N are zero padding). Values are

    w[n, k] = scale[n, k // G] * code[n, k] + offset[n, k // G]

with G = K / scale.shape[1] (one group per row is a per-row scale); scale
and offset have lanes * R rows. 4-bit codes take half the bytes of 8-bit
ones, and every method reads them packed.

Why lanes across rows: a product reads whole vectors of words along K, and
unpacking a lane (a shift and a mask) is elementwise, so every load in the
compiled loop is a full vector on AVX2 and AVX-512 alike (a byte per value
makes inductor load 8 or 16 bytes at a time, a partial load filled element by
element on AVX2). Lanes across columns would tie the layout to K: a group
must not straddle two lanes, and K = 576 has no eighth that is a multiple of
32. Across rows, groups run along K untouched, whatever K is.

`kvexport::dequantize_packed` is the weight as a float tensor. Export keeps
it as one node (it is CompositeImplicitAutograd, like torchao's ops), so the
backend picks the kernel: FusedPackedLinearPass writes a product with a few
rows as one reduction per lane that loads each word once for every lane and
every row; DecomposeCustomOpsPass inlines what is left (prefill products,
the portable backend) as plain ATen shifts, masks and arithmetic.
"""

from __future__ import annotations

import torch
import torch.fx

from kvexport.passes.base import RewritePass, arguments, emit, static_rows

aten = torch.ops.aten
BITS = (4, 8)

_LIB = torch.library.Library("kvexport", "FRAGMENT")
_LIB.define("dequantize_packed(Tensor words, Tensor scale, Tensor offset, int bits, int rows, ScalarType dtype) -> Tensor")


def lanes_of(bits: int) -> int:
    return 32 // bits


def pack(codes: torch.Tensor, bits: int, chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """uint8 codes [N, K] (each < 2**bits) as int32 words [ceil(N / lanes), K],
    a band of columns at a time (the int64 arithmetic takes 8 bytes a code:
    a 1 GB embedding's codes at once would take 4 GB)."""
    lanes, (n, k) = lanes_of(bits), codes.shape
    rows = -(-n // lanes)
    out = torch.empty(rows, k, dtype=torch.int32)
    width = max(1, chunk_bytes // (8 * lanes * rows))
    for start in range(0, k, width):
        cols = slice(start, min(k, start + width))
        padded = torch.zeros(lanes * rows, cols.stop - start, dtype=torch.int64)
        padded[:n] = codes[:, cols].to(torch.int64)
        words = torch.zeros(rows, cols.stop - start, dtype=torch.int64)
        for b, lane in enumerate(padded.view(lanes, rows, -1)):
            words |= lane << (bits * b)
        out[:, cols] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return out


def lane(words: torch.Tensor, bits: int, b: int) -> torch.Tensor:
    """The codes lane `b` holds, as int32 [R, K]: rows b*R .. b*R + R - 1."""
    return torch.bitwise_and(torch.bitwise_right_shift(words, bits * b), (1 << bits) - 1)


def unpack(words: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 codes [rows, K]: the inverse of `pack`."""
    return torch.cat([lane(words, bits, b) for b in range(lanes_of(bits))])[:rows]


def pad_rows(t: torch.Tensor, bits: int) -> torch.Tensor:
    """scale or offset [N, groups] padded with zero rows to lanes * R rows."""
    lanes = lanes_of(bits)
    extra = -t.shape[0] % lanes
    return torch.cat([t, t.new_zeros(extra, t.shape[1])]) if extra else t


def _values(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scale * code + offset per group, for codes [T, K] and their rows'
    scale and offset [T, groups]."""
    width, groups = codes.shape[1], scale.shape[1]
    grouped = codes.to(dtype).reshape(-1, groups, width // groups)
    values = grouped * scale.to(dtype).unsqueeze(-1) + offset.to(dtype).unsqueeze(-1)
    return values.reshape(-1, width)


def _dequantize_packed(words, scale, offset, bits: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    return _values(unpack(words, bits, rows), scale[:rows], offset[:rows], dtype)


_LIB.impl("dequantize_packed", _dequantize_packed, "CompositeImplicitAutograd")


def dequantize_packed(words, scale, offset, bits: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.kvexport.dequantize_packed(words, scale, offset, bits, rows, dtype)


def dequantize_rows(words, scale, offset, bits: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` (any shape) of the weight, [*index.shape, K], reading only
    those rows' words: what an embedding lookup needs. The index only ever
    feeds index ops (an embedding lookup, a gather), so the program's data
    flow still reads as a lookup (contract/step_width.py)."""
    flat = index.reshape(-1)
    per_word = words.shape[0]
    word = torch.nn.functional.embedding(torch.remainder(flat, per_word), words)  # [T, K]
    lanes = torch.stack([lane(word, bits, b) for b in range(lanes_of(bits))], 1)  # [T, lanes, K]
    which = torch.div(flat, per_word, rounding_mode="floor").reshape(-1, 1, 1).expand(-1, 1, word.shape[1])
    codes = torch.gather(lanes, 1, which).squeeze(1)
    embedding = torch.nn.functional.embedding
    values = _values(codes, embedding(flat, scale), embedding(flat, offset), dtype)
    return values.reshape(*index.shape, word.shape[1])


# ------------------------------------------------------------------ blocks
# The format of products with int8 activations (--qact int8): weight rows in
# panels of 8, each panel's codes block by block (32 values of K), so that a
# vector of 32 bytes holds 4 codes of each of the panel's 8 rows: one integer
# dot product against 4 activation codes broadcast gives the 8 rows' sums,
# and a block ends in one convert, scale and FMA for 8 rows at once.
#
# data is uint8 [N / 8, K * bits]: panel p, block b, then quads. 8-bit codes:
# 8 quads q, each 8 rows r of 4 bytes, byte t = code [8p + r, 32b + 4q + t].
# 4-bit codes: 4 quads, byte t of row r holding code 32b + 4q + t in its low
# nibble and code 32b + 16 + 4q + t in its high one (a mask and a shift
# unpack two quads). Scale and offset ("tables") are [N / 8, groups * 8]:
# panel p, group g, row r. w = scale * code + offset as above. N is a
# multiple of 8 (a linear with other N keeps float activations).

BLOCK = 32  # values per block of codes, and per scale of the int8 activations
PANEL_ROWS = 8  # weight rows a panel of the blocks format interleaves


def pack_blocks(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K] (each < 2**bits, N a multiple of 8, K of 32) in the blocks format."""
    n, k = codes.shape
    quads = codes.to(torch.uint8).reshape(n // PANEL_ROWS, PANEL_ROWS, k // BLOCK, BLOCK // 4, 4)
    if bits == 4:
        quads = quads[:, :, :, :4] | (quads[:, :, :, 4:] << 4)
    return quads.permute(0, 2, 3, 1, 4).reshape(n // PANEL_ROWS, -1).contiguous()


def _code_quads(quads: torch.Tensor, bits: int) -> torch.Tensor:
    """A panel's stored quads [..., blocks, bits, rows, 4] as codes' quads
    [..., blocks, 8, rows, 4]: for 4 bits, the low nibbles' 4 quads, then the
    high nibbles' (the compile pass matches exactly these ops)."""
    if bits == 8:
        return quads
    return torch.cat([torch.bitwise_and(quads, 15), torch.bitwise_right_shift(quads, 4)], 2)


def unpack_blocks(data: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [N, K]: the inverse of `pack_blocks`, in plain ATen."""
    panels, width = data.shape
    k = width // bits
    quads = _code_quads(data.reshape(panels, k // BLOCK, BLOCK * bits // 32, PANEL_ROWS, 4), bits)
    # contiguous, then a view: a reshape of the permuted codes would trace to _unsafe_view, off the allowlist
    return quads.permute(0, 3, 1, 2, 4).contiguous().view(panels * PANEL_ROWS, k)


def pack_table(t: torch.Tensor) -> torch.Tensor:
    """A scale or offset [N, groups] in the blocks format's order, [N / 8, groups * 8]."""
    n, groups = t.shape
    return t.reshape(n // PANEL_ROWS, PANEL_ROWS, groups).transpose(1, 2).reshape(n // PANEL_ROWS, -1).contiguous()


def unpack_table(t: torch.Tensor) -> torch.Tensor:
    """[N, groups]: the inverse of `pack_table`, in plain ATen."""
    panels, width = t.shape
    return t.reshape(panels, width // PANEL_ROWS, PANEL_ROWS).permute(0, 2, 1).contiguous().view(panels * PANEL_ROWS, -1)


HALF_NORMAL = 2.0**-14  # fp16's smallest normal number


def narrow_tables(scale: torch.Tensor, offset: torch.Tensor, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """scale and offset in fp16 where that keeps them (a weight reads a fifth
    fewer bytes at 4 bits): `exact`, when every value survives the round
    trip (a GGUF's own scales); else when every value is within fp16's range
    and every nonzero scale at least its smallest normal (so a scale keeps
    11 significant bits). Otherwise both stay fp32."""
    scale, offset = scale.float(), offset.float()
    half_scale, half_offset = scale.half(), offset.half()
    if exact:
        fits = torch.equal(half_scale.float(), scale) and torch.equal(half_offset.float(), offset)
    else:
        scales = scale.abs()
        fits = (bool(torch.isfinite(half_scale).all() and torch.isfinite(half_offset).all())
                and bool((scales[scales != 0] >= HALF_NORMAL).all()))
    return (half_scale, half_offset) if fits else (scale, offset)


def dequantize_block_rows(data, scale, offset, bits: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` (any shape) of a blocks-format weight, [*index.shape, K],
    reading only their panels: the lookups of an embedding whose codes a tied
    LM head multiplies with int8 activations. The index feeds only index ops
    and integer arithmetic, as dequantize_rows'."""
    flat = index.reshape(-1)
    panel = torch.div(flat, PANEL_ROWS, rounding_mode="floor")
    lane = torch.remainder(flat, PANEL_ROWS)
    rows = torch.nn.functional.embedding(panel, data)  # [T, K * bits]: each row's panel
    k = rows.shape[1] // bits
    quads = rows.reshape(-1, k // BLOCK, BLOCK * bits // 32, PANEL_ROWS, 4)  # -1, not T: sizes stay literal ints
    mine = torch.gather(quads, 3, lane.reshape(-1, 1, 1, 1, 1).expand(-1, k // BLOCK, BLOCK * bits // 32, 1, 4))
    codes = _code_quads(mine, bits).reshape(-1, k)  # [T, blocks, 8 quads, 1, 4]: K order

    def rows_of(table: torch.Tensor) -> torch.Tensor:
        groups = table.shape[1] // PANEL_ROWS
        grouped = torch.nn.functional.embedding(panel, table).reshape(-1, groups, PANEL_ROWS)
        return torch.gather(grouped, 2, lane.reshape(-1, 1, 1).expand(-1, groups, 1)).reshape(-1, groups)

    return _values(codes, rows_of(scale), rows_of(offset), dtype).reshape(*index.shape, k)


def _dequantize_blocks(data, scale, offset, bits: int, dtype: torch.dtype) -> torch.Tensor:
    return _values(unpack_blocks(data, bits), unpack_table(scale), unpack_table(offset), dtype)


INV_127 = 1.0 / 127  # an int8 code's step is a block's largest magnitude times this (rounded to fp32)
INV_32767 = 1.0 / 32767  # an int16 code's
SMALLEST_TOP = 1e-30  # a block's largest magnitude counts as at least this, so an all-zero block has a step


def _rounded_blocks(x: torch.Tensor, inverse_limit: float) -> torch.Tensor:
    """x with every row's blocks of 32 values rounded to integer codes
    times a step per block (symmetric: step = largest magnitude times
    `inverse_limit`), as float: what an integer kernel multiplies. Written
    with the operators a stored program may call (no abs: the larger of the
    max and minus the min)."""
    *lead, k = x.shape
    blocks = x.reshape(*lead, k // BLOCK, BLOCK)
    top = torch.maximum(torch.amax(blocks, -1, True), torch.neg(torch.amin(blocks, -1, True)))
    step = torch.mul(torch.clamp(top, SMALLEST_TOP), inverse_limit)
    codes = torch.round(torch.div(blocks, step))
    return torch.mul(codes, step).reshape(x.shape)


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded per block of 32 to int8 codes (step = largest magnitude / 127)."""
    return _rounded_blocks(x, INV_127)


def _int16_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded per block of 32 to int16 codes (step = largest magnitude /
    32767, --qact int16): 16 bits of each activation, whose products with 4-
    or 8-bit codes are sums of int16 pairs."""
    return _rounded_blocks(x, INV_32767)


def _int8x2_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as int8_rows rounds it, plus its rounding error rounded the
    same way: two int8 codes and two steps per value of a block, about 15
    bits of it (the second step is at most 1/254 of the first), for twice
    the integer products (--qact int8x2)."""
    first = torch.ops.kvexport.int8_rows(x)
    return torch.add(first, torch.ops.kvexport.int8_rows(torch.sub(x, first)))


def _int8_peak_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as int8_rows rounds it, plus, on each row's peak blocks
    (those whose largest magnitude is the row's largest, clamped as
    int8_rows clamps it), their rounding error rounded the same way: int8x2
    on the block that sets the row's scale, int8 elsewhere (--qact
    int8-peak). The peak block's error dominates a row's: over SmolLM2 4w
    its second term alone took the logits' error from 0.18 to 0.11 (RMS
    against weight-only) for 5% more integer products."""
    first = torch.ops.kvexport.int8_rows(x)
    *lead, k = x.shape
    blocks = x.reshape(*lead, k // BLOCK, BLOCK)
    top = torch.maximum(torch.amax(blocks, -1, True), torch.neg(torch.amin(blocks, -1, True)))
    top = torch.clamp(top, SMALLEST_TOP)
    below = torch.lt(top, torch.amax(top, -2, True))  # [*lead, blocks, 1]: not a peak
    second = torch.ops.kvexport.int8_rows(torch.sub(x, first)).reshape(*lead, k // BLOCK, BLOCK)
    return torch.add(first, torch.masked_fill(second, below, 0.0).reshape(x.shape))


_LIB.define("dequantize_blocks(Tensor data, Tensor scale, Tensor offset, int bits, ScalarType dtype) -> Tensor")
_LIB.impl("dequantize_blocks", _dequantize_blocks, "CompositeImplicitAutograd")
_LIB.define("int8_rows(Tensor x) -> Tensor")
_LIB.impl("int8_rows", _int8_rows, "CompositeImplicitAutograd")
_LIB.define("int8x2_rows(Tensor x) -> Tensor")
_LIB.impl("int8x2_rows", _int8x2_rows, "CompositeImplicitAutograd")
_LIB.define("int16_rows(Tensor x) -> Tensor")
_LIB.impl("int16_rows", _int16_rows, "CompositeImplicitAutograd")
_LIB.define("int8_peak_rows(Tensor x) -> Tensor")
_LIB.impl("int8_peak_rows", _int8_peak_rows, "CompositeImplicitAutograd")


def dequantize_blocks(data, scale, offset, bits: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.kvexport.dequantize_blocks(data, scale, offset, bits, dtype)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvexport.int8_rows(x)


def int8x2_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvexport.int8x2_rows(x)


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvexport.int16_rows(x)


def int8_peak_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvexport.int8_peak_rows(x)


def rounded_rows(x: torch.Tensor, qact: str) -> torch.Tensor:
    """x as a product with `qact` activations (contract/schemes.py) takes it."""
    return {"int8x2": int8x2_rows, "int16": int16_rows, "int8-peak": int8_peak_rows}.get(qact, int8_rows)(x)


def _is_packed(node: object) -> bool:
    return getattr(node, "target", None) is torch.ops.kvexport.dequantize_packed.default


class FusedPackedLinearPass(RewritePass):
    """linear(x, dequantize_packed(...)) with a static count of rows up to
    `max_rows`, as one reduction over K per lane: the compiler fuses the
    lanes into one loop that loads a vector of words once and unpacks each
    lane with a shift and a mask, so neither the float weight nor the
    unpacked codes are ever written. Rows are the outer loop: each row reads
    the words again, from cache where a layer fits. Measured on SmolLM2 at
    8 rows (bench/decode.py): rows inner (the product as [R, rows],
    transposed) ran 0.52 x the batch-1 rate; one reduction per row and lane
    sharing the unpacking ran 1.8 x but took 10 minutes to compile. A
    per-group scale multiplies inside the reduction (it is constant over a
    group's inner loop); the offsets, a few per row, are a
    small reduction over the rows' group sums. Rows are pinned to memory first
    (see FusedDequantizeMatmulPass)."""

    name = "fused_packed_linear"
    leftover = "packed products with a few rows left"

    def __init__(self, max_rows: int = 8, skip_rows: tuple[int, ...] = ()):
        import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)

        self.rows = frozenset(range(1, max_rows + 1)) - frozenset(skip_rows)  # the rest: the aoti backend's packed kernel

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [
            n for n in graph_module.graph.nodes
            if n.target is aten.linear.default and _is_packed(n.args[1])
            and static_rows(n.args[0]) in self.rows
        ]

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        x, packed = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        given = arguments(packed)
        words, scale, offset, bits, n_out, dtype = (
            given[k] for k in ("words", "scale", "offset", "bits", "rows", "dtype")
        )
        lead, width = list(x.meta["val"].shape[:-1]), x.meta["val"].shape[-1]
        rows, groups = static_rows(x), scale.meta["val"].shape[1]
        per_word, size = words.meta["val"].shape[0], width // groups

        def op(target, *args, **kwargs):
            return emit(graph, node, target, *args, **kwargs)

        def as_float(t):
            return t if t.meta["val"].dtype == dtype else op(aten._to_copy.default, t, dtype=dtype)

        pinned = op(aten.reshape.default, x, [rows, width])
        pinned = op(torch.ops.prims.inductor_force_stride_order.default, pinned, [width, 1])
        x_grouped = op(aten.reshape.default, pinned, [rows, 1, groups, size])
        scales = op(aten.reshape.default, as_float(scale), [lanes_of(bits), per_word, groups, 1])
        by_lane = []
        for b in range(lanes_of(bits)):
            shifted = op(aten.bitwise_right_shift.Tensor_Scalar, words, bits * b)
            codes = op(aten.reshape.default, op(aten.bitwise_and.Scalar, shifted, (1 << bits) - 1), [per_word, groups, size])
            weight = op(aten.mul.Tensor, as_float(codes), op(aten.select.int, scales, 0, b))
            by_lane.append(op(aten.sum.dim_IntList, op(aten.mul.Tensor, x_grouped, weight), [-1, -2]))  # [rows, R]
        out = op(aten.cat.default, by_lane, 1)
        sums = op(aten.sum.dim_IntList, op(aten.reshape.default, pinned, [rows, groups, size]), [-1])
        offsets = op(aten.mul.Tensor, op(aten.unsqueeze.default, sums, 1), as_float(offset))  # [rows, lanes * R, groups]
        out = op(aten.add.Tensor, out, op(aten.sum.dim_IntList, offsets, [-1]))
        out = op(aten.slice.Tensor, out, 1, 0, n_out)
        if bias is not None:
            out = op(aten.add.Tensor, out, bias)
        return op(aten.reshape.default, out, [*lead, n_out])
