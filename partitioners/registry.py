"""Backends register here, one object each, keyed by id. A backend is a
folder under partitioners/ whose `__init__` registers it (the built-in ones
are imported by `kvexport.partitioners`): it brings its options (decided
once per export, from the spec), its partitioners (which contribute its
passes, tag and lower, and check the lowered program), an optional compile
hook that turns the written programs into what the backend runs, and what it
adds to the manifest's `backend` entry. Adding one touches no file of the
project:

    register_backend(Backend("mine", partitioners=lambda options: [MyPartitioner()]))

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
class BackendOptions:
    """What a backend decided for one export, once (`Backend.configure`):
    its partitioners, compile hook and manifest entry all read this, never
    the spec's backend flags again."""

    device: str = "cpu"
    compile_workers: int = 0  # processes its compile hook runs at once (the memory plan counts each)
    # products with rounded activations run on its integer kernels: --qact's default is by the codes' width
    int8_products: bool = False


@dataclass
class CompileContext:
    """What a compile hook gets: the package being written (its root, the
    weights file and every method's manifest entry so far), the tensor
    bindings, the backend's options and the spec. It returns method ->
    compiled file, relative to the package root."""

    root: Path
    weights: Path
    methods: dict[str, dict]
    bindings: dict[str, dict]
    aliases: dict[str, str]
    options: BackendOptions
    spec: Any
    progress: Callable[[str], None]


def _no_check(spec: Any) -> None:
    return None


@dataclass
class Backend:
    """One backend. `check_spec` refuses bad values of the options it owns
    (cheap: it runs while any spec is validated, so a typo fails whichever
    backend is chosen); `configure` decides its options once per export (it
    may measure the machine); the rest take those options."""

    id: str
    description: str = ""
    partitioners: Callable[[BackendOptions], list] = field(default=lambda options: [])
    compile: Callable[[CompileContext], dict[str, str]] | None = None
    manifest_entry: Callable[[BackendOptions], dict] = field(default=lambda options: {})
    devices: tuple[str, ...] = ("cpu",)
    configure: Callable[[Any], BackendOptions] = field(default=lambda spec: BackendOptions(spec.device))
    # the processes its compile hook will run at once, known from the spec alone: the memory
    # plan counts them before configure runs (configure's compile_workers must agree)
    compile_workers: Callable[[Any], int] = field(default=lambda spec: 0)
    check_spec: Callable[[Any], None] = _no_check
    # passes its compile hook runs on each method before compiling it, never on
    # the stored program (which stays on the package's operator allowlist);
    # declared here so that --dump-graphs shows what they make
    compile_passes: Callable[[BackendOptions], list] = field(default=lambda options: [])


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

