"""The passes the aoti backend runs inside its compile step, on each method
about to be compiled (never on the stored program, which stays on the
package's operator allowlist): products and attention over the static row
counts its kernels take call those kernels (kernels/)."""

from __future__ import annotations

from kvexport.passes.base import Pass


def compile_passes(kernel_rows: tuple[int, ...]) -> list[Pass]:
    if not kernel_rows:
        return []
    from kvexport.partitioners.aoti.passes.masked_attention import MaskedAttentionPass
    from kvexport.partitioners.aoti.passes.rows_linear import RowsLinearPass

    return [RowsLinearPass(kernel_rows), MaskedAttentionPass(kernel_rows)]
