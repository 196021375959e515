"""The methods an export writes, planned from the spec and the model: the
contract's forward module, its metadata, and for each method the module,
example inputs, dynamic shapes, I/O specs and step width to trace with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from kvexport.contract import manifest as mf
from kvexport.contract import offgraph_kv, single_sequence
from kvexport.contract.errors import ExportError, ModelError, SpecError
from kvexport.exporter.forwards import (
    ContractForward,
    OffgraphForward,
    SampleArgmaxModule,
    SampleModule,
    SingleSequenceForward,
)
from kvexport.exporter.sources.models import LoadedModel
from kvexport.exporter.spec import ExportSpec


@dataclass
class MethodPlan:
    name: str
    kind: str  # "forward" | "sampler"
    module: nn.Module
    example_args: tuple
    dynamic_shapes: tuple
    inputs: list[dict]
    outputs: list[dict]
    step_width: str | None = None


def context_len(spec: ExportSpec, config: Any) -> int:
    native = getattr(config, "max_position_embeddings", None)
    if spec.max_context_len and native and spec.max_context_len > native:
        raise ModelError(f"--max-context-len {spec.max_context_len} exceeds the model's native context {native}")
    context = spec.max_context_len or native
    if not context:
        raise ModelError("the model's config has no max_position_embeddings; pass --max-context-len")
    return int(context)


def build_forward(spec: ExportSpec, loaded: LoadedModel) -> ContractForward:
    model = loaded.model.to(spec.device)
    if spec.contract == mf.OFFGRAPH_KV:
        return OffgraphForward(model).eval()
    context = context_len(spec, model.config)
    if spec.max_step_tokens > context:
        raise SpecError(f"--max-step-tokens {spec.max_step_tokens} exceeds the context of {context}; lower it")
    dtype = getattr(torch, mf.TORCH_DTYPE_NAMES[spec.dtype])
    return SingleSequenceForward(model, context, dtype, cache_as_inputs=spec.contract == mf.HF_STATIC).eval()


def _bos_eos(loaded: LoadedModel) -> tuple[int | None, list[int]]:
    config = loaded.model.config
    generation = getattr(loaded.model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    if eos is None:
        eos = config.eos_token_id
    bos = getattr(generation, "bos_token_id", None)
    if bos is None:
        bos = getattr(config, "bos_token_id", None)
    return bos, sorted({eos} if isinstance(eos, int) else set(eos or []))


def contract_metadata(spec: ExportSpec, loaded: LoadedModel, forward: ContractForward) -> dict[str, Any]:
    config = loaded.model.config
    geometry = forward.geometry
    bos, eos = _bos_eos(loaded)
    architecture = (getattr(config, "architectures", None) or [type(loaded.model).__name__])[0]
    if spec.contract in (mf.INGRAPH_KV, mf.HF_STATIC):
        return single_sequence.build_metadata(
            spec.contract, geometry, forward.vocab_size, forward.context, spec.max_step_tokens, bos, eos, spec.dtype,
            architecture,
        )
    return offgraph_kv.build_metadata(
        geometry, forward.vocab_size, context_len(spec, config), spec.max_step_tokens, spec.max_cells,
        spec.min_prefill_chunk, list(spec.forward_sizes), bos, eos, spec.dtype, architecture,
    )


def _distinct_examples(*ranges: tuple[int, int]) -> list[int]:
    """One example size per dynamic dim, each >= 2 and all different, so that
    tracing neither specializes a dim to 0/1 nor unifies two dims."""
    picked: list[int] = []
    for lo, hi in ranges:
        size = max(lo, 2)
        while size in picked:
            size += 1
        if size > hi:
            raise ExportError(f"no example size in [{lo}, {hi}] distinct from {picked}")
        picked.append(size)
    return picked


def _forward_plan(name: str, spec: ExportSpec, forward: OffgraphForward, metadata: dict, t_dim, k_dim) -> MethodPlan:
    geometry = forward.geometry
    cache_dtype = mf.TORCH_DTYPE_NAMES[spec.dtype]
    inputs, outputs = offgraph_kv.forward_io(geometry, cache_dtype, forward.vocab_size, spec.max_cells, t_dim, k_dim)
    ranges = [(d["min"], d["max"]) for d in (t_dim, k_dim) if isinstance(d, dict)]
    static_sizes = [d for d in (t_dim, k_dim) if isinstance(d, int)]
    examples = _distinct_examples(*ranges, (max(static_sizes or [1]) + 1, spec.max_cells))
    t = t_dim if isinstance(t_dim, int) else examples.pop(0)
    k = k_dim if isinstance(k_dim, int) else examples.pop(0)
    c = examples.pop(0)
    dims = {d["name"]: Dim(d["name"], min=d["min"], max=d["max"]) for d in (t_dim, k_dim) if isinstance(d, dict)}
    cells_dim = Dim("C", min=1, max=spec.max_cells)
    T, K = dims.get("T"), dims.get("K")
    dtype = getattr(torch, cache_dtype)
    pools = [
        torch.zeros(c, heads, dim, dtype=dtype)
        for heads, dim in zip(geometry.kv_heads, geometry.head_dims)
        for _ in ("k", "v")
    ]
    masks = [torch.ones(t, c, dtype=torch.bool) for _ in geometry.distinct_windows]
    example_args = offgraph_kv.ForwardInputs(
        tokens=torch.arange(t, dtype=torch.int64).unsqueeze(0) % forward.vocab_size,
        input_pos=torch.arange(t, dtype=torch.int64),
        logits_to_keep=torch.arange(k, dtype=torch.int64) % t,
        pools=pools,
        cells=torch.arange(t, dtype=torch.int64) % c,
        masks=masks,
    ).pack()
    tdim = {0: T} if T is not None else None
    state_shapes = (
        *({0: cells_dim} for _ in pools),
        tdim,
        *({0: T, 1: cells_dim} if T is not None else {1: cells_dim} for _ in masks),
    )
    dynamic_shapes = ({1: T} if T is not None else None, tdim, {0: K} if K is not None else None, state_shapes)
    example_args = tuple(a.to(spec.device) for a in example_args)
    return MethodPlan(name, "forward", forward, example_args, dynamic_shapes, inputs, outputs, mf.PUBLIC_STEP_WIDTH)


def single_sequence_plan(spec: ExportSpec, forward: SingleSequenceForward) -> MethodPlan:
    geometry = forward.geometry
    cache_dtype = mf.TORCH_DTYPE_NAMES[spec.dtype]
    hf_static = forward.cache_as_inputs
    inputs, outputs = single_sequence.single_sequence_io(
        forward.vocab_size, spec.max_step_tokens, geometry if hf_static else None, cache_dtype, forward.context
    )
    t = min(3, spec.max_step_tokens) if spec.max_step_tokens > 1 else 1
    T = Dim("T", min=1, max=spec.max_step_tokens) if spec.max_step_tokens > 1 else None
    caches = [
        torch.zeros(1, heads, forward.context, dim, dtype=getattr(torch, cache_dtype))
        for heads, dim in zip(geometry.kv_heads, geometry.head_dims)
        for _ in ("k", "v")
    ] if hf_static else []
    args = (torch.arange(t).unsqueeze(0) % forward.vocab_size, torch.arange(t), *caches)
    tdim = {0: T} if T is not None else None
    shapes = ({1: T} if T is not None else None, tdim) + ((tuple(None for _ in caches),) if caches else ())
    args = tuple(a.to(spec.device) for a in args)
    return MethodPlan("forward", "forward", forward, args, shapes, inputs, outputs, mf.PUBLIC_STEP_WIDTH)


def plan_methods(spec: ExportSpec, forward: ContractForward, metadata: dict) -> list[MethodPlan]:
    if isinstance(forward, SingleSequenceForward):
        return [single_sequence_plan(spec, forward)]
    plans = [_forward_plan(f"forward_{n}", spec, forward, metadata, n, n) for n in spec.forward_sizes]
    widest = max(spec.forward_sizes)
    t_dim = mf.dyn("T", widest + 1, spec.max_step_tokens)
    k_dim = mf.dyn("K", metadata["get_min_prefill_chunk"], spec.max_step_tokens)
    plans.append(_forward_plan("forward_others", spec, forward, metadata, t_dim, k_dim))
    vocab = forward.vocab_size
    rows = Dim("R", min=1, max=1 << 16)
    logits = torch.randn(3, vocab, device=spec.device)
    params = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.7, 0.9, 0.0, 0.5], [1.0, 1.0, 5.0, 0.3]], device=spec.device)
    inputs, outputs = offgraph_kv.sampler_io(vocab, True)
    plans.append(MethodPlan("sample", "sampler", SampleModule(), (logits, params), ({0: rows}, {0: rows}), inputs, outputs))
    inputs, outputs = offgraph_kv.sampler_io(vocab, False)
    plans.append(MethodPlan("sample_argmax", "sampler", SampleArgmaxModule(), (logits,), ({0: rows},), inputs, outputs))
    return plans
