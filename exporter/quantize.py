"""torchao weight quantization before tracing, with a coverage report: every
linear and embedding, with the scheme applied or the reason it was skipped.

Schemes (`--qlinear`): 8w (int8 weights, per channel, or per group when a
group size is given), 4w (int4 weights per group, torchao's intx weight-only
config: the CPU one), 8da4w (int8 dynamic activations, int4 weights per
group). `--qembedding 8w`: int8 embeddings, per row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

QLINEAR = ("8w", "4w", "8da4w")
QEMBEDDING = ("8w",)
DEFAULT_GROUP_4BIT = 32


def _linear_config(scheme: str, group_size: int) -> Any:
    from torchao.quantization import (
        Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    if scheme == "8w":
        return Int8WeightOnlyConfig(group_size=group_size or None)
    group = PerGroup(group_size or DEFAULT_GROUP_4BIT)
    if scheme == "4w":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=group)
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=group)


def _embedding_config() -> Any:
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis

    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def quantize_model(model: nn.Module, qlinear: str, group_size: int, qembedding: str) -> list[dict[str, Any]]:
    """Quantizes in place; returns one coverage row per linear and embedding."""
    from torchao.quantization import quantize_

    owners: dict[int, list[str]] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            owners.setdefault(module.weight.data_ptr(), []).append(fqn)
    rows, linears, embeddings = [], set(), set()
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        kind = "linear" if isinstance(module, nn.Linear) else "embedding"
        scheme = qlinear if kind == "linear" else qembedding
        row = {"module": fqn, "kind": kind, "shape": list(module.weight.shape), "scheme": None, "skipped": None}
        tied = [o for o in owners[module.weight.data_ptr()] if o != fqn]
        width = module.weight.shape[1]
        group = group_size or (DEFAULT_GROUP_4BIT if scheme in ("4w", "8da4w") else 0)
        if not scheme:
            row["skipped"] = f"no --q{kind} scheme asked for"
        elif tied:
            row["skipped"] = f"tied with {tied[0]}.weight (quantizing one would untie and store it twice)"
        elif group and width % group:
            row["skipped"] = f"width {width} is not divisible by the group size {group}"
        else:
            row["scheme"] = scheme
            (linears if kind == "linear" else embeddings).add(fqn)
        rows.append(row)
    if linears:
        quantize_(model, _linear_config(qlinear, group_size), filter_fn=lambda m, fqn: fqn in linears)
    if embeddings:
        quantize_(model, _embedding_config(), filter_fn=lambda m, fqn: fqn in embeddings)
    return rows


def coverage_summary(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for kind in ("linear", "embedding"):
        of_kind = [r for r in rows if r["kind"] == kind]
        done = [r for r in of_kind if r["scheme"]]
        if not of_kind:
            continue
        schemes = sorted({r["scheme"] for r in done})
        lines.append(f"quantized {len(done)} of {len(of_kind)} {kind}s" + (f" ({', '.join(schemes)})" if schemes else ""))
        for r in of_kind:
            if r["skipped"] and not r["skipped"].startswith("no --q"):
                lines.append(f"  skipped {r['module']}: {r['skipped']}")
    return lines
