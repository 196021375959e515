"""The export pipeline, as one ordered list of steps (`export_package`):

    trace each method
    -> the caller's transform passes
    -> each partitioner's contributed passes, in the partitioners' order
    -> partition and lower (then the backends' checks of the lowered program)
    -> reserve constant names, package-wide
    -> write the package

`dump_graphs` writes every method's graph after each step.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import save_file
from torch import nn
from torch.export import Dim

from kvexport.exporter.models import LoadedModel, load_model
from kvexport.exporter.offgraph_module import (
    CACHE_BUFFER,
    ContractForward,
    OffgraphForward,
    SampleArgmaxModule,
    SampleModule,
    SingleSequenceForward,
)
from kvexport.exporter.quantize import plain_weights, quantize_model
from kvexport.exporter.spec import ExportSpec
from kvexport.partitioners.base import Partitioner
from kvexport.exporter.aoti_compile import CompileJob, compile_methods
from kvexport.partitioners.aoti import AotiPartitioner, compile_target
from kvexport.partitioners.portable import PortablePartitioner
from kvexport.passes.base import Pass, run_passes
from kvexport.passes.check_step_width import STEP_WIDTH_META, USER_INPUTS_META
from kvexport.passes.reserve_constant_names import ConstantNames, ReserveConstantNamesPass
from kvexport.runtime import manifest as mf
from kvexport.runtime import torch_compat, trust
from kvexport.runtime.errors import ExportError, ModelError, SpecError
from kvexport.runtime.package import PackageWriter, check_output, program_path

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


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


@dataclass
class ExportResult:
    path: Path
    methods: list[str]
    package_bytes: int
    weights_bytes: int
    seconds: float
    coverage: list | None = None

    @property
    def size_ratio(self) -> float:
        return self.package_bytes / self.weights_bytes


class GraphDump:
    """Writes each method's graph after each step, when asked to."""

    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory) if directory else None
        self.count = 0

    def __call__(self, step: str, programs: dict[str, torch.export.ExportedProgram]) -> None:
        if self.directory is None:
            return
        self.count += 1
        for name, program in programs.items():
            path = self.directory / name / f"{self.count}-{step}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{program.graph_signature}\n\n{program.graph_module.print_readable(print_output=False)}")


def export_package(
    spec: ExportSpec,
    progress: Progress = log.info,
    *,
    transform_passes: Sequence[Pass] = (),
    partitioners: Sequence[Partitioner] | None = None,
    dump_graphs: str | Path | None = None,
) -> ExportResult:
    start = time.perf_counter()
    spec.validate()
    check_output(Path(spec.output), spec.overwrite)  # a bad -o fails now, not after the tracing
    partitioners = list(partitioners) if partitioners is not None else default_partitioners(spec)
    dump = GraphDump(dump_graphs)
    progress(f"loading {spec.model} ({spec.dtype})")
    loaded = load_model(spec.model, spec.dtype, progress)
    coverage = []
    if spec.qlinear or spec.qembedding:
        with _timed(progress, "quantize"):
            coverage = quantize_model(loaded.model, spec.qlinear, spec.qlinear_group_size, spec.qembedding)
            inner = plain_weights(loaded.model)
            for row in coverage:
                if row["scheme"]:
                    row["stored"] = inner[f"{row['module']}.weight"]  # tensors for now: named in write_package
    forward = build_forward(spec, loaded)
    metadata = contract_metadata(spec, loaded, forward)
    plans = plan_methods(spec, forward, metadata)

    programs = trace_methods(plans, progress)
    dump("trace", programs)
    with _timed(progress, "caller's passes"):
        run_on_each(programs, list(transform_passes))
    dump("transform", programs)
    with _timed(progress, "backend passes"):
        run_on_each(programs, [p for partitioner in partitioners for p in partitioner.edge_transform_passes()])
    dump("backend_passes", programs)
    with _timed(progress, "partition, lower and check"):
        partition_and_lower(programs, plans, partitioners)
    dump("partition_lower", programs)
    with _timed(progress, "reserve constant names"):
        reserve_constant_names(programs)
    dump("reserve_constant_names", programs)
    with _timed(progress, f"write {spec.output}"):
        result = write_package(spec, loaded, metadata, plans, programs, progress, coverage)
    result.seconds = time.perf_counter() - start
    return result


def default_partitioners(spec: ExportSpec) -> list[Partitioner]:
    if spec.backend == "aoti":
        if spec.device == "cuda" and not torch.cuda.is_available():
            raise ExportError("--device cuda needs a CUDA GPU, and torch sees none on this machine")
        return [AotiPartitioner(spec.device)]
    return [PortablePartitioner()]


@contextlib.contextmanager
def _timed(progress: Progress, what: str):
    start = time.perf_counter()
    yield
    progress(f"{what}: {time.perf_counter() - start:.1f} s")


def run_on_each(programs: dict[str, torch.export.ExportedProgram], passes: list[Pass]) -> None:
    if passes:
        for name, program in programs.items():
            run_passes(program.graph_module, passes, name)


def _fingerprint(graph_module: torch.fx.GraphModule) -> list[tuple]:
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs)) for n in graph_module.graph.nodes]


def partition_and_lower(
    programs: dict[str, torch.export.ExportedProgram], plans: list[MethodPlan], partitioners: Sequence[Partitioner]
) -> None:
    """Each partitioner tags what its backend takes (and must leave the graph
    as it was), then lowers; the backends' checks run on the lowered program
    with the step width the lowering declares."""
    checks = [check for partitioner in partitioners for check in partitioner.lowered_checks()]
    for plan in plans:
        program = programs[plan.name]
        for partitioner in partitioners:
            before = _fingerprint(program.graph_module)
            partitioner.partition(program.graph_module)
            if _fingerprint(program.graph_module) != before:
                raise ExportError(f"partitioner {partitioner.backend_id!r} changed the graph of {plan.name} while tagging")
            program = partitioner.lower(program, plan.name)
            if plan.step_width is not None:
                plan.step_width = partitioner.step_width(plan.step_width)
        programs[plan.name] = program
        program.graph_module.meta[STEP_WIDTH_META] = plan.step_width
        program.graph_module.meta[USER_INPUTS_META] = list(program.graph_signature.user_inputs)
        run_passes(program.graph_module, checks, plan.name)


def reserve_constant_names(programs: dict[str, torch.export.ExportedProgram]) -> ConstantNames:
    """Every name every method holds is reserved before any new constant is
    named; then the tensors passes attached are lifted under fresh names."""
    names = ConstantNames()
    for program in programs.values():
        names.reserve_program(program)
    for name, program in programs.items():
        run_passes(program.graph_module, [ReserveConstantNamesPass(names, program)], name)
    return names


def write_package(
    spec: ExportSpec,
    loaded: LoadedModel,
    metadata: dict,
    plans: list[MethodPlan],
    programs: dict[str, torch.export.ExportedProgram],
    progress: Progress = log.info,
    coverage: list[dict] | None = None,
) -> ExportResult:
    tensors, aliases, bindings = gather_weights(plans, programs)
    if coverage:
        coverage = name_stored_tensors(coverage, programs, aliases)
    with PackageWriter(Path(spec.output), overwrite=spec.overwrite) as writer:
        save_file({k: t.cpu() for k, t in tensors.items()}, str(writer.weights_path), metadata={"format": "pt"})
        methods = {}
        for plan in plans:
            entry = {
                "kind": plan.kind,
                "program": writer.write_program(plan.name, torch_compat.graph_to_json(programs[plan.name])),
                "inputs": plan.inputs,
                "outputs": plan.outputs,
                "weights": bindings[plan.name],
            }
            if plan.step_width is not None:
                entry["step_width"] = plan.step_width
            if bindings[plan.name]["state"]:
                constants = programs[plan.name].constants
                entry["state"] = [
                    {"name": n, "dtype": str(constants[n].dtype).removeprefix("torch."), "shape": list(constants[n].shape)}
                    for n in bindings[plan.name]["state"]
                ]
            methods[plan.name] = entry
        backend = {"id": spec.backend}
        if spec.backend == "aoti":
            backend["target"] = compile_target(spec.device)
            jobs = [
                CompileJob(plan.name, writer.root / methods[plan.name]["program"], writer.weights_path,
                           bindings[plan.name], aliases, plan.inputs, writer.root / program_path(plan.name, compiled=True),
                           spec.device, methods[plan.name].get("state", []))
                for plan in plans
            ]
            compile_methods(jobs, spec.compile_workers, progress)
            for job in jobs:
                methods[job.method]["compiled"] = job.output.relative_to(writer.root).as_posix()
        tokenizer = None
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(str(writer.tokenizer_dir))
            tokenizer = {"dir": writer.tokenizer_dir.name, "chat_template": bool(getattr(loaded.tokenizer, "chat_template", None))}
        manifest = {
            "format": mf.FORMAT,
            "format_version": mf.FORMAT_VERSION,
            "contract": {"name": spec.contract, "version": mf.CONTRACTS[spec.contract]},
            "metadata": metadata,
            "methods": methods,
            "weights": {"file": writer.weights_path.name, "tensors": len(tensors), "aliases": aliases},
            "backend": backend,
            "tokenizer": tokenizer,
            "provenance": provenance(spec, loaded),
        }
        if coverage:
            manifest["quantization"] = {
                "qlinear": spec.qlinear or None,
                "qlinear_group_size": spec.qlinear_group_size or None,
                "qembedding": spec.qembedding or None,
                "coverage": coverage,
            }
        mf.require(mf.check_manifest({**manifest, "files": {}}), "the exporter built an invalid manifest")
        weights_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        package_bytes = sum(p.stat().st_size for p in writer.files())
        writer.commit(manifest)
    package_bytes += (Path(spec.output) / "manifest.json").stat().st_size
    if spec.backend == "aoti":
        # this user compiled it on this machine: its native code is theirs
        trust.trust_exported(Path(spec.output))
    return ExportResult(Path(spec.output), [p.name for p in plans], package_bytes, weights_bytes, 0.0, coverage)


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
        common = {
            "get_max_seq_len": spec.max_step_tokens,
            "get_vocab_size": forward.vocab_size,
            "get_n_layers": geometry.n_layers,
            "get_bos_id": bos,
            "get_eos_ids": eos,
            "dtype": spec.dtype,
            "architecture": architecture,
        }
        if spec.contract == mf.INGRAPH_KV:
            return {**common, "get_max_context_len": forward.context, "use_kv_cache": True, "enable_dynamic_shape": True}
        return {
            **common,
            "get_max_cache_len": forward.context,
            "get_kv_heads": list(geometry.kv_heads),
            "get_head_dims": list(geometry.head_dims),
            "get_windows": list(geometry.windows),
        }
    context = context_len(spec, config)
    return {
        "get_max_context_len": context,
        "get_max_seq_len": spec.max_step_tokens,
        "get_vocab_size": forward.vocab_size,
        "get_logits_to_keep_mode": mf.LOGITS_MODE_SELECTED,
        "get_n_caches": geometry.n_layers,
        "get_kv_heads": list(geometry.kv_heads),
        "get_head_dims": list(geometry.head_dims),
        "get_windows": list(geometry.windows),
        "get_offgraph_kv_max_cells": spec.max_cells,
        "get_min_prefill_chunk": spec.min_prefill_chunk,
        "bos_id": bos,
        "eos_ids": eos,
        "dtype": spec.dtype,
        "forward_sizes": list(spec.forward_sizes),
        "architecture": architecture,
    }


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
    inputs, outputs = mf.forward_io(geometry, cache_dtype, forward.vocab_size, spec.max_cells, t_dim, k_dim)
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
    example_args = (
        torch.arange(t, dtype=torch.int64).unsqueeze(0) % forward.vocab_size,
        torch.arange(t, dtype=torch.int64),
        torch.arange(k, dtype=torch.int64) % t,
        *pools,
        torch.arange(t, dtype=torch.int64) % c,
        *masks,
    )
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
    inputs, outputs = mf.single_sequence_io(
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
    inputs, outputs = mf.sampler_io(vocab, True)
    plans.append(MethodPlan("sample", "sampler", SampleModule(), (logits, params), ({0: rows}, {0: rows}), inputs, outputs))
    inputs, outputs = mf.sampler_io(vocab, False)
    plans.append(MethodPlan("sample_argmax", "sampler", SampleArgmaxModule(), (logits,), ({0: rows},), inputs, outputs))
    return plans


def trace_methods(plans: list[MethodPlan], progress: Progress) -> dict[str, torch.export.ExportedProgram]:
    programs = {}
    for i, plan in enumerate(plans, 1):
        start = time.perf_counter()
        try:
            with torch.no_grad():
                program = torch.export.export(
                    plan.module, plan.example_args, dynamic_shapes=plan.dynamic_shapes, strict=False
                )
            program.graph_module.meta[USER_INPUTS_META] = list(program.graph_signature.user_inputs)
            programs[plan.name] = program
        except Exception as e:
            raise ExportError(f"tracing {plan.name} failed: {type(e).__name__}: {e}") from e
        progress(f"[{i}/{len(plans)}] {plan.name} traced in {time.perf_counter() - start:.1f} s")
    return programs


def gather_weights(
    plans: list[MethodPlan], programs: dict[str, torch.export.ExportedProgram]
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, dict[str, list[str]]]]:
    """The tensors to store, the aliases (names bound to the same tensor,
    such as tied embeddings: stored once), and which names each method
    binds. Methods traced from the same module share weights by name;
    a name bound to two different values is an error."""
    by_name: dict[str, torch.Tensor] = {}
    bindings = {}
    for plan in plans:
        program = programs[plan.name]
        names = torch_compat.placeholder_names(program)
        # ingraph_kv's cache buffers: the runtime allocates them, the package holds none
        names["state"] = [n for n in names["constants"] if n.startswith(CACHE_BUFFER + ".")]
        names["constants"] = [n for n in names["constants"] if n not in names["state"]]
        for kind, source in (("parameters", program.state_dict), ("buffers", program.state_dict), ("constants", program.constants)):
            for name in names[kind]:
                tensor = source[name]
                if name in by_name and by_name[name] is not tensor and not torch.equal(by_name[name], tensor):
                    # reserve_constant_names makes names unique package-wide
                    raise AssertionError(f"{plan.name}: {name!r} names two different tensors")
                by_name.setdefault(name, tensor)
        bindings[plan.name] = names
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name in sorted(by_name):
        tensor = by_name[name].detach()
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        storage = tensor.untyped_storage().data_ptr()
        # safetensors keeps each tensor on its own: a view into a storage already stored is copied out
        tensors[name] = tensor.contiguous() if storage not in storages else tensor.clone()
        storages.add(storage)
    return tensors, aliases, bindings


def name_stored_tensors(coverage: list[dict], programs: dict[str, torch.export.ExportedProgram], aliases: dict[str, str]) -> list[dict]:
    """The coverage rows with each quantized weight's inner tensors (qdata,
    scale, zero_point) given by the names they are stored under."""
    def key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), t.dtype, tuple(t.shape)

    names: dict[tuple, str] = {}
    for program in programs.values():
        for name, tensor in program.state_dict.items():
            names.setdefault(key(tensor), aliases.get(name, name))
    return [
        {**row, "stored": {k: names[key(v)] if isinstance(v, torch.Tensor) else v for k, v in row["stored"].items()}}
        if "stored" in row else row
        for row in coverage
    ]


def provenance(spec: ExportSpec, loaded: LoadedModel) -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        **loaded.provenance,
        "tools": {name: version(name) for name in ("kvexport", "torch", "transformers", "safetensors")}
        | {"python": platform.python_version()},
        "command": spec.command,
        "recipe": spec.recipe(),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
