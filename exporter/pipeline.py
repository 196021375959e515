"""The export pipeline: one ordered list of steps (`STEPS`), run by one loop
over one export state. The loop times each step, prints its progress line,
and dumps every method's graph after the steps that change graphs
(`--dump-graphs DIR`: DIR/<method>/<n>-<step>.txt).

    memory plan             the private memory the export needs, from the source's
                            headers; over --max-memory it stops before any work
    backend options         what the backend decides once (it may measure the
                            machine or build its kernels) and its partitioners
    load                    the model (and tokenizer) from its source, mapped
    reference (float)       a quantized export's float greedy tokens (for fp32_agreement)
    quantize                when --qlinear / --qembedding ask
    reference               the model's own greedy tokens on the probe prompts (golden.py)
    build_forward           the contract's forward module and its metadata
    plan                    each method: module, example inputs, I/O specs
    trace                   torch.export, each method          (dumped)
    caller_passes           the caller's transform passes      (dumped)
    fuse sibling linears    q/k/v and gate/up as one product each (dumped)
    backend_passes          each partitioner's passes          (dumped)
    partition_and_lower     tag, lower, the backend's checks   (dumped)
    reserve_constant_names  package-wide constant names        (dumped)
    gather_weights          one copy of every tensor, tied ones once
    write                   weights (streamed, one tensor at a time), programs,
                            tokenizer, into a partial dir
    compile                 the backend's compile hook (AOTInductor's, say); its
                            compile passes are dumped as they apply (copies)
    commit                  the manifest, checked; the package verified against its
                            reference (the CLI's check), then one rename into place
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kvexport.contract import manifest as mf
from kvexport.contract import schemes, torch_compat, trust
from kvexport.contract.errors import ExportError
from kvexport.contract.package import PackageReader, PackageWriter, check_output
from kvexport.contract.safetensors_io import SafetensorsWriter
from kvexport.contract.sections import (
    BackendSection, ContractRef, QuantizationSection, ReferenceSection, TokenizerSection, WeightsSection,
)
from kvexport.contract.tokenizer_files import tokenizer_problems
from kvexport.exporter import golden
from kvexport.exporter.forwards import CACHE_BUFFER
from kvexport.exporter.memory import MemoryPlan, PeakSampler, check_budget, parse_size, plan_memory
from kvexport.exporter.output_files import GraphDump
from kvexport.exporter.plan import MethodPlan, build_forward, contract_metadata, plan_methods
from kvexport.exporter.quantization.quantize import plain_weights, quantize_model
from kvexport.exporter.sources.mapped import source_ranges
from kvexport.exporter.sources.models import LoadedModel, load_model, source_weights
from kvexport.exporter.spec import ExportSpec
from kvexport.partitioners.base import Partitioner
from kvexport.partitioners.registry import Backend, BackendOptions, CompileContext, get_backend
from kvexport.passes.base import Pass, run_passes
from kvexport.passes.check_step_width import STEP_WIDTH_META, USER_INPUTS_META
from kvexport.passes.fuse_linears import FusedWeights, fuse_sibling_int8_products, fuse_sibling_linears
from kvexport.passes.reserve_constant_names import ConstantNames, ReserveConstantNamesPass

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


@dataclass
class ExportState:
    """Everything the steps share; each step reads what earlier ones set."""

    spec: ExportSpec
    progress: Progress
    transform_passes: list[Pass]
    backend: Backend
    given_partitioners: list[Partitioner] | None  # the caller's, in place of the backend's own
    stack: contextlib.ExitStack
    dump: "GraphDump"
    options: BackendOptions | None = None  # what the backend decided for this export, once
    partitioners: list[Partitioner] = field(default_factory=list)
    loaded: LoadedModel | None = None
    coverage: list[dict] = field(default_factory=list)
    forward: Any = None
    metadata: dict = field(default_factory=dict)
    plans: list[MethodPlan] = field(default_factory=list)
    programs: dict[str, torch.export.ExportedProgram] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    bindings: dict[str, dict] = field(default_factory=dict)
    writer: PackageWriter | None = None
    methods: dict[str, dict] = field(default_factory=dict)
    tokenizer: TokenizerSection | None = None
    reference: ReferenceSection | None = None
    fp32_tokens: dict[str, list[int]] | None = None
    check_package: Callable[[Path], str] | None = None
    verification: str | None = None
    result: "ExportResult | None" = None
    memory: MemoryPlan | None = None
    fused: FusedWeights = field(default_factory=FusedWeights)


def step(title: str, dump: str | None = None):
    """Marks a pipeline step: its progress title, and the name its graph
    dump gets when it changes graphs."""

    def mark(fn):
        fn.title, fn.dump = title, dump
        return fn

    return mark


@step("memory plan")
def memory_plan(state: ExportState) -> None:
    """The private memory the export will need, from the source's headers;
    over --max-memory, the export stops here, before any work (the backend's
    compile workers as its compile_workers hook counts them)."""
    _plan_memory(state, state.backend.compile_workers(state.spec))


def _plan_memory(state: ExportState, workers: int) -> None:
    spec = state.spec
    source = source_weights(spec.model, spec.dtype)
    quantized = 0
    if spec.qlinear or spec.qembedding:
        quantized = schemes.scheme(spec.qlinear or spec.qembedding).plan_bytes(source.matrix_values)
    plan = state.memory = plan_memory(private_weights=source.private_bytes, quantized_bytes=quantized, compile_workers=workers)
    state.progress(f"memory plan: about {plan.total / 1e9:.2f} GB of private memory ({plan.describe()}); "
                   f"{source.export_bytes / 1e9:.2f} GB of weights")
    if spec.max_memory:
        hints = []
        if source.private_bytes:
            hints.append("a safetensors checkpoint in the export's dtype is mapped instead of held")
        if quantized:
            hints.append("quantization holds the quantized weights")
        if workers > 1:
            hints.append("--compile-workers 1 runs one compile at a time")
        check_budget(plan, parse_size(spec.max_memory), hints + ["raise --max-memory"])


@step("load")
def load(state: ExportState) -> None:
    state.progress(f"loading {state.spec.model} ({state.spec.dtype})")
    state.loaded = load_model(state.spec.model, state.spec.dtype, state.progress)


@step("quantize")
def quantize(state: ExportState) -> None:
    spec = state.spec
    if not (spec.qlinear or spec.qembedding):
        return
    loaded = state.loaded
    state.coverage = quantize_model(
        loaded.model, spec.qlinear, spec.qlinear_group_size, spec.qembedding,
        algorithm=spec.qlinear_algorithm, keep_8w=tuple(p.strip() for p in spec.qlinear_keep_8w.split(",") if p.strip()), tokenizer=loaded.tokenizer,
        gguf=loaded.gguf, qact=_qact(spec, state.options), progress=state.progress,
    )
    inner = plain_weights(loaded.model)  # torchao's (8da4w)
    for row in state.coverage:
        if row["module"] in inner:
            row["stored"] = inner[row["module"]]  # tensors for now: named once weights are gathered


@step("backend options")
def backend_options(state: ExportState) -> None:
    """After the memory plan: a backend may measure the machine or build its
    kernels here, work an export refused for memory never waits for."""
    state.options = state.backend.configure(state.spec)
    if state.options.compile_workers != state.backend.compile_workers(state.spec):  # a backend without the hook
        _plan_memory(state, state.options.compile_workers)
    given = state.given_partitioners
    state.partitioners = list(given) if given is not None else state.backend.partitioners(state.options)


def _qact(spec, options) -> str:
    """--qact as asked, or each linear's by its codes' width
    (schemes.QACT_BY_BITS) where the backend multiplies rounded activations
    on its own kernels and the scheme can take them."""
    if spec.qact:
        return spec.qact
    takes = options.int8_products and schemes.int8_activations(schemes.BY_NAME.get(spec.qlinear))
    return schemes.BY_WIDTH if takes else "none"


@step("reference (float)")
def reference_float(state: ExportState) -> None:
    """A quantized package's reference is the quantized model; the float
    model's tokens are kept to record how often the two agree."""
    spec = state.spec
    if spec.verify and (spec.qlinear or spec.qembedding):
        section = _reference(state)
        state.fp32_tokens = {p["name"]: p["tokens"] for p in section.probes}


@step("reference")
def reference_tokens(state: ExportState) -> None:
    if not state.spec.verify:
        return
    state.reference = _reference(state)
    if state.fp32_tokens is not None:
        agree = golden.agreement(state.reference, state.fp32_tokens)
        state.reference = dataclasses.replace(state.reference, fp32_agreement=agree)
        state.progress(f"reference: the quantized model agrees with the float model on {agree:.1%} of greedy tokens")


def _reference(state: ExportState) -> ReferenceSection:
    spec, loaded = state.spec, state.loaded
    config = loaded.model.config.get_text_config()
    native = getattr(config, "max_position_embeddings", None) or 4096
    context = min(native, spec.max_context_len or native)
    int8 = any(row.get("activations") in schemes.ROUNDED for row in state.coverage)
    return golden.reference(loaded.model, loaded.tokenizer, dtype=spec.dtype, steps=spec.verify_tokens,
                            widest_static=max(spec.forward_sizes), context=context, int8_activations=int8,
                            progress=state.progress)


@step("build forward")
def build_forward_step(state: ExportState) -> None:
    state.forward = build_forward(state.spec, state.loaded)
    state.metadata = contract_metadata(state.spec, state.loaded, state.forward)


@step("plan")
def plan(state: ExportState) -> None:
    state.plans = plan_methods(state.spec, state.forward, state.metadata)


@step("trace", dump="trace")
def trace(state: ExportState) -> None:
    state.programs = trace_methods(state.plans, state.progress)


@step("caller's passes", dump="transform")
def caller_passes(state: ExportState) -> None:
    run_on_each(state.programs, state.transform_passes)


@step("fuse sibling linears", dump="fuse")
def fuse_linears(state: ExportState) -> None:
    groups = sum(fuse_sibling_linears(program, state.fused) + fuse_sibling_int8_products(program, state.fused)
                 for program in state.programs.values())
    if groups:
        state.progress(f"fused {groups} groups of sibling linears (q/k/v, gate/up) into one product each")


@step("backend passes", dump="backend_passes")
def backend_passes(state: ExportState) -> None:
    run_on_each(state.programs, [p for partitioner in state.partitioners for p in partitioner.edge_transform_passes()])


@step("partition, lower and check", dump="partition_lower")
def partition_and_lower_step(state: ExportState) -> None:
    partition_and_lower(state.programs, state.plans, state.partitioners)


@step("reserve constant names", dump="reserve_constant_names")
def reserve_constant_names_step(state: ExportState) -> None:
    reserve_constant_names(state.programs)


@step("gather weights")
def gather(state: ExportState) -> None:
    state.tensors, state.aliases, state.bindings = gather_weights(state.plans, state.programs)
    if state.coverage:
        state.coverage = name_stored_tensors(state.coverage, state.programs, state.aliases, state.fused)


@step("write")
def write(state: ExportState) -> None:
    """Weights, programs and tokenizer into the writer's partial directory;
    leaving the pipeline by an exception removes it."""
    spec = state.spec
    writer = state.writer = state.stack.enter_context(PackageWriter(Path(spec.output), overwrite=spec.overwrite))
    write_weights(writer.weights_path, state.tensors, state.loaded.weight_files, state.progress, state.fused)
    for plan in state.plans:
        entry = {
            "kind": plan.kind,
            "program": writer.write_program(plan.name, torch_compat.graph_to_json(state.programs[plan.name])),
            "inputs": plan.inputs,
            "outputs": plan.outputs,
            "weights": state.bindings[plan.name],
        }
        if plan.step_width is not None:
            entry["step_width"] = plan.step_width
        if state.bindings[plan.name]["state"]:
            constants = state.programs[plan.name].constants
            entry["state"] = [
                {"name": n, "dtype": str(constants[n].dtype).removeprefix("torch."), "shape": list(constants[n].shape)}
                for n in state.bindings[plan.name]["state"]
            ]
        state.methods[plan.name] = entry
    tokenizer = state.loaded.tokenizer
    if tokenizer is not None:
        tokenizer.save_pretrained(str(writer.tokenizer_dir))
        state.tokenizer = TokenizerSection(writer.tokenizer_dir.name, bool(getattr(tokenizer, "chat_template", None)))


@step("compile")
def compile_methods(state: ExportState) -> None:
    if state.backend.compile is None:
        return
    passes = state.backend.compile_passes(state.options)
    if passes and state.dump.directory is not None:
        state.dump("compile_passes", {name: compiled_view(program, passes, name) for name, program in state.programs.items()})
    writer = state.writer
    context = CompileContext(
        writer.root, writer.weights_path, state.methods, state.bindings, state.aliases, state.options, state.spec,
        state.progress,
    )
    for name, rel in state.backend.compile(context).items():
        state.methods[name]["compiled"] = rel


@step("commit")
def commit(state: ExportState) -> None:
    """The manifest, checked by the contract registry, then one rename."""
    spec, writer = state.spec, state.writer
    manifest = {
        "format": mf.FORMAT,
        "format_version": mf.FORMAT_VERSION,
        "contract": ContractRef(spec.contract, mf.CONTRACTS[spec.contract]).to_json(),
        "metadata": state.metadata,
        "methods": state.methods,
        "weights": WeightsSection(writer.weights_path.name, len(state.tensors), state.aliases).to_json(),
        "backend": BackendSection(spec.backend, state.backend.manifest_entry(state.options)).to_json(),
        "tokenizer": state.tokenizer.to_json() if state.tokenizer else None,
        "provenance": provenance(spec, state.loaded),
    }
    if state.reference is not None:
        manifest["reference"] = state.reference.to_json()
    if state.coverage:
        manifest["quantization"] = QuantizationSection(
            spec.qlinear or None, spec.qlinear_group_size or None, spec.qembedding or None, state.coverage
        ).to_json()
    mf.require(mf.check_manifest({**manifest, "files": {}}), "the exporter built an invalid manifest")
    weights_bytes = sum(t.numel() * t.element_size() for t in state.tensors.values())
    package_bytes = sum(p.stat().st_size for p in writer.files())
    def check(root: Path) -> None:
        # what the runtime will refuse of the tokenizer is refused now, not on the user's first prompt
        problems = tokenizer_problems(PackageReader(root)) if state.tokenizer is not None else []
        if problems:
            raise ExportError(f"the source's tokenizer was written as files a package may not hold: {'; '.join(problems[:3])}")
        if state.reference is not None and state.check_package is not None:
            state.verification = state.check_package(root)
            state.progress(f"verify: {state.verification}")

    writer.commit(manifest, check=check)
    package_bytes += (Path(spec.output) / "manifest.json").stat().st_size
    if any("compiled" in entry for entry in state.methods.values()):
        # this user compiled it on this machine: its native code is theirs
        trust.trust_exported(Path(spec.output))
    state.result = ExportResult(Path(spec.output), list(state.methods), package_bytes, weights_bytes, 0.0, state.coverage)


STEPS = [
    memory_plan, backend_options, load, reference_float, quantize, reference_tokens, build_forward_step, plan, trace, caller_passes, fuse_linears,
    backend_passes, partition_and_lower_step,
    reserve_constant_names_step, gather, write, compile_methods, commit,
]


def export_package(
    spec: ExportSpec,
    progress: Progress = log.info,
    *,
    transform_passes: Sequence[Pass] = (),
    partitioners: Sequence[Partitioner] | None = None,
    dump_graphs: str | Path | None = None,
    check_package: Callable[[Path], str] | None = None,
    steps: list | None = None,
) -> ExportResult:
    """Runs STEPS over one export state, recording each step's time and
    peak memory in `steps` (a list the caller may pass, so that it holds
    them when a step fails). `partitioners` replaces the backend's own
    (tests and experiments). `check_package(root)` runs the
    finished package before it is placed (the CLI passes the runtime's
    reference check, which the exporter may not import): it returns a line
    to show, or raises to refuse the package."""
    start = time.perf_counter()
    steps = [] if steps is None else steps
    spec.validate()
    check_output(Path(spec.output), spec.overwrite)  # a bad -o fails now, not after the tracing
    backend = get_backend(spec.backend)
    dump = GraphDump(dump_graphs)
    with contextlib.ExitStack() as stack:
        given = list(partitioners) if partitioners is not None else None
        state = ExportState(spec, progress, list(transform_passes), backend, given, stack, dump)
        state.check_package = check_package
        sampler = stack.enter_context(PeakSampler())
        for run in STEPS:
            began = time.perf_counter()
            try:
                run(state)
            finally:
                steps.append({"step": run.title, "seconds": round(time.perf_counter() - began, 3), **peak_rss_mb(),
                              **sampler.take()})
            progress(f"{run.title}: {time.perf_counter() - began:.1f} s")
            if run.dump:
                dump(run.dump, state.programs)
    state.result.seconds = time.perf_counter() - start
    state.result.steps = steps
    state.result.memory = memory_summary(state, steps)
    state.result.verification = state.verification
    return state.result


def memory_summary(state: ExportState, steps: list[dict]) -> dict[str, float | None]:
    """The plan against what the export reached; a warning when the reached
    peak passed --max-memory (the plan is an estimate)."""
    budget = parse_size(state.spec.max_memory) / 2**20 if state.spec.max_memory else None
    out = {
        "plan_private_mb": round(state.memory.total / 2**20, 1) if state.memory else None,
        "budget_mb": round(budget, 1) if budget else None,
        "peak_private_mb": max((row.get("peak_tree_private_mb", 0.0) for row in steps), default=0.0),
        "peak_rss_mb": max((row.get("peak_tree_rss_mb", 0.0) for row in steps), default=0.0),
    }
    if budget and out["peak_private_mb"] > budget:
        log.warning("the export reached %.0f MB of private memory, over --max-memory (%.0f MB)", out["peak_private_mb"], budget)
    return out


def peak_rss_mb() -> dict[str, float]:
    """Peak resident memory so far of this process and of its finished
    children (the compile workers), in MB."""
    import resource

    scale = 1 / 1024 if platform.system() != "Darwin" else 1 / 2**20  # KiB on Linux, bytes on macOS
    return {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, 1),
            "peak_rss_children_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale, 1)}


@dataclass
class ExportResult:
    path: Path
    methods: list[str]
    package_bytes: int
    weights_bytes: int
    seconds: float
    coverage: list | None = None
    steps: list = field(default_factory=list)  # {"step", "seconds", "peak_rss_mb", "peak_rss_children_mb"}
    verification: str | None = None  # the package's reference check, when it ran
    memory: dict = field(default_factory=dict)  # plan_private_mb, budget_mb, peak_private_mb, peak_rss_mb

    @property
    def size_ratio(self) -> float:
        return self.package_bytes / self.weights_bytes


def compiled_view(program: torch.export.ExportedProgram, passes: list[Pass], method: str) -> torch.fx.GraphModule:
    """The method as the backend's compile step sees it after its own passes
    (a copy: the stored program is left as it is)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(program.graph_module.graph, {}))
    module = torch.fx.GraphModule(program.graph_module, graph)
    run_passes(module, passes, method)
    return module


def _fingerprint(graph_module: torch.fx.GraphModule) -> list[tuple]:
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs)) for n in graph_module.graph.nodes]


def run_on_each(programs: dict[str, torch.export.ExportedProgram], passes: list[Pass]) -> None:
    if passes:
        for name, program in programs.items():
            run_passes(program.graph_module, passes, name)


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


def write_weights(path: Path, tensors: dict[str, torch.Tensor], source_files: list[Path], progress: Progress,
                  fused: FusedWeights | None = None, every_s: float = 5.0) -> None:
    """The package's weights file, one tensor at a time: a tensor that is
    still the source checkpoint's bytes is copied from the file in chunks
    (exporter/mapped.py), a stacked weight (passes/fuse_linears.py) is
    written part after part, so neither the model nor a serialized copy of
    it is ever held whole. Progress every `every_s` seconds: tensors and
    bytes done, the rate and the time left."""
    stacked = {name: parts for name, t in tensors.items() if fused and (parts := fused.parts(t)) is not None}
    # a stacked weight's parts are looked up under "<name>\0<k>"
    ranges = source_ranges({**tensors, **{f"{n}\0{k}": p for n, parts in stacked.items() for k, p in enumerate(parts)}}, source_files)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    done = 0
    start = last = time.perf_counter()
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    with SafetensorsWriter(path, specs, {"format": "pt"}) as out:
        for i, name in enumerate(out.names, 1):
            tensor = tensors[name]
            if name in stacked:
                out.write(name, [ranges.get(f"{name}\0{k}", part) for k, part in enumerate(stacked[name])])
            else:
                out.write(name, ranges.get(name, tensor))
            done += tensor.numel() * tensor.element_size()
            now = time.perf_counter()
            if now - last >= every_s and i < len(out.names):
                last = now
                rate = done / (now - start)
                progress(f"weights: {i}/{len(out.names)} tensors, {done / 1e9:.2f}/{total / 1e9:.2f} GB, "
                         f"{rate / 1e6:.0f} MB/s, about {(total - done) / rate:.0f} s left")
    if ranges:
        copied = sum(r.nbytes for r in ranges.values())
        log.info("weights: %.2f of %.2f GB copied straight from the source files", copied / 1e9, total / 1e9)


def name_stored_tensors(coverage: list[dict], programs: dict[str, torch.export.ExportedProgram], aliases: dict[str, str],
                        fused: FusedWeights | None = None) -> list[dict]:
    """The coverage rows with each quantized weight's inner tensors (qdata,
    scale, zero_point) given by the names they are stored under; a part of a
    stacked tensor (passes/fuse_linears.py) as its rows of it,
    `name[start:stop]`."""
    def key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), t.dtype, tuple(t.shape)

    names: dict[tuple, str] = {}
    for program in programs.values():
        for name, tensor in program.state_dict.items():
            stored = aliases.get(name, name)
            names.setdefault(key(tensor), stored)
            start = 0
            for part in (fused.parts(tensor) if fused else None) or []:
                names.setdefault(key(part), f"{stored}[{start}:{start + part.shape[0]}]")
                start += part.shape[0]
    return [
        {**row, "stored": {k: names[key(v)] if isinstance(v, torch.Tensor) else v for k, v in row["stored"].items()}}
        if "stored" in row else row
        for row in coverage
    ]


# recipe keys that say where and how the package was written, not what it is
_NOT_CONTENT = ("output", "overwrite", "compile_workers", "max_memory")


def provenance(spec: ExportSpec, loaded: LoadedModel) -> dict[str, Any]:
    """Where the package came from. Two exports of the same inputs with the
    same recipe store the same provenance: no output path, no clock (a
    time only from SOURCE_DATE_EPOCH, the reproducible-builds convention)."""

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    out = {
        **loaded.provenance,
        "tools": {name: version(name) for name in ("kvexport", "torch", "transformers", "safetensors")}
        | {"python": platform.python_version()},
        "command": _without_output(spec.command),
        "recipe": {k: v for k, v in spec.recipe().items() if k not in _NOT_CONTENT},
    }
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if epoch.isdigit():
        out["created_utc"] = datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc).isoformat(timespec="seconds")
    return out


# options whose value is where this run writes, not what the package is
_WHERE = {"-o": "PKG", "--output": "PKG", "--report": "FILE", "--dump-graphs": "DIR"}


def _without_output(command: list[str]) -> list[str]:
    """The command line with the output directory, report and graph dump
    paths replaced by PKG, FILE and DIR."""
    out, placeholder = [], None
    for arg in command:
        name, eq, _ = arg.partition("=")
        if placeholder:
            out.append(placeholder)
            placeholder = None
        elif arg in _WHERE:
            out.append(arg)
            placeholder = _WHERE[arg]
        elif eq and name in _WHERE:
            out.append(f"{name}={_WHERE[name]}")
        elif arg.startswith("-o") and len(arg) > 2:
            out.append("-oPKG")
        else:
            out.append(arg)
    return out
