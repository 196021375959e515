"""MaskedAttentionPass: attention of a few static query rows over the cell
pools calls kvexport's masked attention (kernels/masked_attention.cpp) in
AOTInductor's compiled code, instead of sdpa.

sdpa scores every row against every cell of the pool view before the mask
drops most of them: with 8 sessions in a step, each row sees only its own
session's cells. The kernel gathers each row's visible cells and attends over
those alone (bench/attention_kernels.py measures both).

Over a row count known only at run time (forward_others, a prefill), the
kernel's shim takes one session's slice of a prompt of 256 rows or more as
two sdpa calls, a dense one over the session's earlier cells and a causal
one over the slice's own cells, merged by their log-sum-exps: through the
mask, sdpa scores every cell and drops half of the slice's own
(bench/prefill.py measures a 2048-token prompt, bench/attention_kernels.py
the slices). Shorter slices and other masks over more than 16 rows go to
sdpa through the mask, as before.

Like the row kernel, the rewrite happens only where a method is compiled
(compile.py), for the row counts the row kernel takes; the
stored programs keep `aten.scaled_dot_product_attention`. The eager
implementation here is sdpa itself.
"""

from __future__ import annotations

import torch
import torch.fx

from kvexport.passes.base import RewritePass, arguments, emit

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


@torch.library.custom_op("kvexport::masked_attention", mutates_args=())
def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """query [1, H, T, D], key and value [1, Hkv, C, D], mask [T, C] bool."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                          enable_gqa=True)
    return out.contiguous()


@masked_attention.register_fake
def _(query, key, value, mask, scale):
    return query.new_empty(query.shape)


MASKED_ATTENTION = torch.ops.kvexport.masked_attention.default


class MaskedAttentionPass(RewritePass):
    name = "masked_attention"
    leftover = "attention over the kernel's row counts left on sdpa"

    def __init__(self, rows: tuple[int, ...], dynamic: bool = True):
        self.rows = frozenset(rows)
        self.dynamic = dynamic  # also a row count known only at run time

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target is _SDPA and self._takes(n)]

    def _takes(self, node: torch.fx.Node) -> bool:
        given = arguments(node)
        vals = [given[k].meta.get("val") if isinstance(given.get(k), torch.fx.Node) else None
                for k in ("query", "key", "value", "attn_mask")]
        if any(v is None for v in vals) or given.get("dropout_p", 0.0) or given.get("is_causal", False):
            return False
        query, key, value, mask = vals
        if query.dim() != 4 or not all(isinstance(d, int) for d in (*query.shape[:2], query.shape[3])):
            return False
        rows = query.shape[2]
        return ((rows in self.rows if isinstance(rows, int) else self.dynamic) and query.shape[0] == 1
                and query.dtype in (torch.float32, torch.bfloat16) and key.dtype == value.dtype == query.dtype
                and key.dim() == 4 and value.dim() == 4
                and mask.dtype == torch.bool and mask.dim() == 2
                and (given.get("enable_gqa", False) or key.shape[1] == query.shape[1]))

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        given = arguments(node)
        scale = given.get("scale")
        if scale is None:
            scale = given["query"].meta["val"].shape[-1] ** -0.5
        return emit(graph, node, MASKED_ATTENTION, given["query"], given["key"], given["value"], given["attn_mask"],
                    float(scale))
