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
    """torchao's intx configs, asymmetric: on SmolLM2 they agree with fp32
    more often than the symmetric ones and Int8WeightOnlyConfig
    (bench/quant_variants.py)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

    if scheme == "8w":
        granularity = PerGroup(group_size) if group_size else PerAxis(0)
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=granularity, mapping_type=MappingType.ASYMMETRIC)
    group = PerGroup(group_size or DEFAULT_GROUP_4BIT)
    if scheme == "4w":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=group, mapping_type=MappingType.ASYMMETRIC)
    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=group, weight_mapping_type=MappingType.ASYMMETRIC
    )


def _embedding_config() -> Any:
    """int8 per row: the 8w linear config with one scale per row, so a tied
    LM head can share the table (quantize_model)."""
    return _linear_config("8w", 0)


def quantize_model(model: nn.Module, qlinear: str, group_size: int, qembedding: str) -> list[dict[str, Any]]:
    """Quantizes in place with torchao; returns one coverage row per linear
    and embedding. With `--qembedding 8w`, an LM head tied to the embedding
    shares the embedding's int8 per-row table whatever `--qlinear` asks for
    (its rows are the output channels, so one stored matrix serves both; a
    4-bit head would need a second copy). Other tied weights are skipped,
    since quantizing one would untie them and store both."""
    from torchao.quantization import quantize_

    modules = {fqn: m for fqn, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    owners: dict[int, list[str]] = {}
    for fqn, module in modules.items():
        owners.setdefault(id(module.weight), []).append(fqn)
    rows, linears, embeddings, shared = [], set(), set(), {}
    for fqn, module in modules.items():
        kind = "linear" if isinstance(module, nn.Linear) else "embedding"
        scheme = qlinear if kind == "linear" else qembedding
        row = {"module": fqn, "kind": kind, "shape": list(module.weight.shape), "scheme": None, "skipped": None}
        tied = [o for o in owners[id(module.weight)] if o != fqn]
        shares = _shared_tie([fqn, *tied], modules) if qlinear and qembedding == "8w" else None
        group = (group_size or (DEFAULT_GROUP_4BIT if scheme in ("4w", "8da4w") else 0)) if kind == "linear" else 0
        if not scheme:
            row["skipped"] = f"no --q{kind} scheme asked for"
        elif tied and not shares:
            row["skipped"] = f"tied with {tied[0]}.weight (quantizing one would untie and store it twice)"
        elif kind == "linear" and shares:
            row.update(scheme="8w", granularity="per row", shared_with=shares)
            shared[fqn] = shares
        elif group and module.weight.shape[1] % group:
            row["skipped"] = f"width {module.weight.shape[1]} is not divisible by the group size {group}"
        else:
            row.update(scheme=scheme, granularity=f"per group of {group}" if group else "per row")
            (linears if kind == "linear" else embeddings).add(fqn)
        rows.append(row)
    if linears:
        quantize_(model, _linear_config(qlinear, group_size), filter_fn=lambda m, fqn: fqn in linears)
    if embeddings:
        quantize_(model, _embedding_config(), filter_fn=lambda m, fqn: fqn in embeddings)
    for fqn, embedding in shared.items():
        modules[fqn].weight = modules[embedding].weight
    return rows


def _shared_tie(group: list[str], modules: dict[str, nn.Module]) -> str | None:
    """The embedding of a tie of one embedding and one linear, else None."""
    if len(group) != 2:
        return None
    embeddings = [fqn for fqn in group if isinstance(modules[fqn], nn.Embedding)]
    return embeddings[0] if len(embeddings) == 1 else None


def plain_weights(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Replaces every quantized (torchao tensor subclass) weight with its
    plain inner tensors, held by torchao's unwrapping parametrization and
    turned back into the subclass when the module runs, so tracing records
    torchao's own arithmetic on plain tensors. Returns, per quantized
    weight, its class and its inner tensors by role (qdata, scale,
    zero_point, ...)."""
    from torchao.utils import unwrap_tensor_subclass

    layout: dict[str, dict[str, Any]] = {}
    for fqn, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None and hasattr(weight, "__tensor_flatten__") and type(weight) is not nn.Parameter:
            names, _ = weight.__tensor_flatten__()
            layout[f"{fqn}.weight"] = {"class": type(weight).__name__} | {n: getattr(weight, n) for n in names}
    unwrap_tensor_subclass(model)
    return layout


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
            if r.get("shared_with"):
                lines.append(f"  {r['module']} shares the int8 per-row weight of {r['shared_with']} (tied)")
    return lines
