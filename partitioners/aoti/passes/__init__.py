"""The passes the aoti backend runs inside its compile step, on each method
about to be compiled (never on the stored program, which stays on the
package's operator allowlist): products and attention over the static row
counts its kernels take call those kernels (kernels/)."""

from __future__ import annotations

from kvexport.passes.base import Pass


def compile_passes(kernel_rows: tuple[int, ...], packed_rows: tuple[int, ...] = (),
                   attention_rows: tuple[int, ...] = (), bf16_every_row_count: bool = False) -> list[Pass]:
    """Products by packed weights first (int8 and weight-only, on the same
    row counts): the row kernel would take their dequantized weights as fp32
    ones. Then float products over kernel_rows (and bf16 ones over any rows
    with bf16_every_row_count) and attention over attention_rows."""
    passes: list[Pass] = []
    if packed_rows:
        from kvexport.partitioners.aoti.kernels.build import DYNAMIC_INT8_BITS
        from kvexport.partitioners.aoti.passes.int8_linear import Int8LinearPass
        from kvexport.partitioners.aoti.passes.packed_linear import PackedLinearPass

        passes += [Int8LinearPass(packed_rows, DYNAMIC_INT8_BITS), PackedLinearPass(packed_rows)]
    if kernel_rows or bf16_every_row_count:
        from kvexport.partitioners.aoti.passes.rows_linear import RowsLinearPass

        passes.append(RowsLinearPass(kernel_rows, bf16_every_row_count))
    if attention_rows:
        from kvexport.partitioners.aoti.passes.masked_attention import MaskedAttentionPass

        passes.append(MaskedAttentionPass(attention_rows))
    return passes
