"""Backends register here, one object each, keyed by id. A backend brings
its partitioners (which contribute its passes, tag and lower, and check the
lowered program), an optional compile hook that turns the written programs
into what the backend runs, and what it adds to the manifest's `backend`
entry. Adding one touches no file of the project:

    register_backend(Backend("mine", partitioners=lambda spec: [MyPartitioner()]))

then `kvexport export --backend mine` (once the module that registers it is
imported) or `export_package(spec)` with `spec.backend = "mine"`.

Partitioners are built lazily, so listing the backends (the CLI's choices)
imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvexport.contract.errors import SpecError


@dataclass
class CompileContext:
    """What a compile hook gets: the package being written (its root, the
    weights file and every method's manifest entry so far), the tensor
    bindings, and the spec. It returns method -> compiled file, relative to
    the package root."""

    root: Path
    weights: Path
    methods: dict[str, dict]
    bindings: dict[str, dict]
    aliases: dict[str, str]
    spec: Any
    progress: Callable[[str], None]


@dataclass
class Backend:
    id: str
    description: str = ""
    partitioners: Callable[[Any], list] = field(default=lambda spec: [])
    compile: Callable[[CompileContext], dict[str, str]] | None = None
    manifest_entry: Callable[[Any], dict] = field(default=lambda spec: {})
    devices: tuple[str, ...] = ("cpu",)


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    if backend.id in _BACKENDS and _BACKENDS[backend.id] is not backend:
        raise ValueError(f"a backend {backend.id!r} is already registered")
    _BACKENDS[backend.id] = backend
    return backend


def backend_ids() -> list[str]:
    return list(_BACKENDS)


def get_backend(backend_id: str) -> Backend:
    if backend_id not in _BACKENDS:
        raise SpecError(f"--backend {backend_id!r} is not available; known backends: {', '.join(_BACKENDS)}")
    return _BACKENDS[backend_id]


# ------------------------------------------------------------------ built-in
def _portable_partitioners(spec) -> list:
    from kvexport.partitioners.portable import PortablePartitioner

    return [PortablePartitioner()]


def _aoti_partitioners(spec) -> list:
    import torch

    from kvexport.contract.errors import ExportError
    from kvexport.exporter.kernel_probe import kernel_rows
    from kvexport.partitioners.aoti import AotiPartitioner

    if spec.device == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda needs a CUDA GPU, and torch sees none on this machine")
    rows = kernel_rows(spec.device, spec.row_kernel)
    if rows:
        from kvexport.exporter.row_kernel import archive_dir

        archive_dir()  # built (once per machine) before any work, so a missing compiler fails first
    return [AotiPartitioner(spec.device, kernel_rows=rows)]


def _aoti_entry(spec) -> dict:
    from kvexport.exporter.kernel_probe import kernel_rows
    from kvexport.partitioners.aoti import compile_target

    return {"target": compile_target(spec.device) | {"fp32_kernel_rows": list(kernel_rows(spec.device, spec.row_kernel))}}


def _aoti_compile(ctx: CompileContext) -> dict[str, str]:
    """Every method compiled by AOTInductor in worker processes, the weights
    left out of the code (the runtime binds the package's one copy)."""
    from kvexport.contract.package import program_path
    from kvexport.exporter import row_kernel
    from kvexport.exporter.aoti_compile import CompileJob, compile_methods
    from kvexport.exporter.kernel_probe import kernel_rows

    rows = kernel_rows(ctx.spec.device, ctx.spec.row_kernel)
    archive = row_kernel.archive_dir() if rows else None
    if rows:
        ctx.progress(f"kvexport's kernels for fp32 products and attention over {','.join(map(str, rows))} rows: {archive}")
    jobs = [
        CompileJob(name, ctx.root / entry["program"], ctx.weights, ctx.bindings[name], ctx.aliases, entry["inputs"],
                   ctx.root / program_path(name, compiled=True), ctx.spec.device, entry.get("state", []),
                   rows, archive)
        for name, entry in ctx.methods.items()
    ]
    compile_methods(jobs, ctx.spec.compile_workers, ctx.progress)
    return {job.method: job.output.relative_to(ctx.root).as_posix() for job in jobs}


register_backend(Backend("portable", "PyTorch's own kernels run each method's graph", _portable_partitioners))
register_backend(
    Backend("aoti", "every method compiled ahead of time with AOTInductor", _aoti_partitioners, _aoti_compile,
            _aoti_entry, devices=("cpu", "cuda"))
)
