"""Loading a package: the I/O-manager registry, the shared weights, and the
programs (rebuilt lazily, on first use, around the one copy of the weights).

Third parties add a contract by registering an IOManager subclass:

    @register_io_manager("my_contract", 1)
    class MyManager(IOManager):
        @staticmethod
        def check_manifest(manifest): ...   # -> list of violations
        def __init__(self, package, **options): ...
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from kvexport.runtime import manifest as mf
from kvexport.runtime import torch_compat
from kvexport.runtime.errors import PackageError
from kvexport.runtime.package import PackageReader

log = logging.getLogger(__name__)


class IOManager:
    """Drives a package's programs according to the contract it declares."""

    contract: tuple[str, int]

    @staticmethod
    def check_manifest(manifest: dict) -> list[str]:
        raise NotImplementedError

    def __init__(self, package: "LoadedPackage", **options: Any):
        self.package = package


_REGISTRY: dict[tuple[str, int], type[IOManager]] = {}


def register_io_manager(name: str, version: int) -> Callable[[type[IOManager]], type[IOManager]]:
    def decorate(cls: type[IOManager]) -> type[IOManager]:
        key = (name, version)
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise ValueError(f"an I/O manager for {name} v{version} is already registered: {_REGISTRY[key].__name__}")
        cls.contract = key
        _REGISTRY[key] = cls
        return cls

    return decorate


def registered_contracts() -> list[tuple[str, int]]:
    return sorted(_REGISTRY)


def select_io_manager(manifest: dict) -> type[IOManager]:
    mf.require(mf.check_envelope(manifest), "not a valid kvexport package")
    name, version = manifest["contract"]["name"], manifest["contract"]["version"]
    known_names = sorted({n for n, _ in _REGISTRY})
    if name not in known_names:
        raise PackageError(f"contract.name: unknown contract {name!r}; this runtime knows {', '.join(known_names)}")
    if (name, version) not in _REGISTRY:
        versions = sorted(v for n, v in _REGISTRY if n == name)
        raise PackageError(f"contract.version: {name} version {version} is not supported (supported: {versions})")
    return _REGISTRY[(name, version)]


class LoadedPackage:
    """A package's manifest, its one copy of the weights, and its methods."""

    def __init__(self, reader: PackageReader, verify: bool = True):
        self.reader = reader
        self.manifest = reader.manifest
        self.backend = self.manifest.get("backend", {"id": "portable"})
        self.device = "cpu"
        if self.backend["id"] == "aoti":
            target = self.backend["target"]
            check_target(target)
            self.device = target["device"]
            verify = True  # native code: never load a byte the manifest does not vouch for
        if verify:
            mf.require(reader.verify_checksums(), f"{reader.path}: the package is damaged")
        start = time.perf_counter()
        # safetensors: no pickle; these tensors are the only copy every method binds.
        self.tensors: dict[str, torch.Tensor] = load_file(reader.weights_path, device=self.device)
        log.debug("loaded %d weight tensors in %.2f s", len(self.tensors), time.perf_counter() - start)
        self.aliases: dict[str, str] = self.manifest.get("weights", {}).get("aliases", {})
        self.state: dict[str, torch.Tensor] = {}  # runtime-owned tensors a program binds (ingraph_kv's cache)
        self._parameters: dict[str, torch.nn.Parameter] = {}
        self._methods: dict[str, Callable] = {}

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest["metadata"]

    def has_method(self, name: str) -> bool:
        return name in self.manifest["methods"]

    def method(self, name: str) -> Callable:
        """The runnable program of a method, rebuilt on first use."""
        if name not in self._methods and "compiled" in self.manifest["methods"][name]:
            self._methods[name] = self._load_compiled(name)
        if name not in self._methods:
            entry = self.manifest["methods"][name]
            start = time.perf_counter()
            names = entry["weights"]
            state = {k: self._parameter(name, k) for k in names["parameters"]}
            state.update({k: self._tensor(name, k) for k in names["buffers"]})
            constants = {k: self._tensor(name, k) for k in names["constants"]}
            constants.update({k: self._state(name, k) for k in names.get("state", [])})
            program = torch_compat.graph_from_json(self.reader.program_json(name), state, constants)
            module = program.module(check_guards=False)
            # The I/O manager builds every input from the manifest's specs;
            # the per-call shape checks cost milliseconds a step.
            module._forward_pre_hooks.clear()
            self._methods[name] = module
            log.debug("rebuilt %s in %.2f s", name, time.perf_counter() - start)
        return self._methods[name]

    def _load_compiled(self, name: str) -> Callable:
        """An AOTInductor method with the package's tensors bound as
        user-managed constants (no copy), before it can ever be called:
        calling one with unbound constants crashes the process."""
        entry = self.manifest["methods"][name]
        start = time.perf_counter()
        runner = torch._inductor.aoti_load_package(str(self.reader.file(entry["compiled"])))
        names = entry["weights"]
        state = set(names.get("state", []))
        wanted = set(names["parameters"] + names["buffers"] + names["constants"]) | state
        fqns = runner.get_constant_fqns()
        missing = sorted(set(fqns) - wanted)
        if missing:
            raise PackageError(f"methods.{name}.compiled: needs constants the manifest does not bind: {missing[:5]}")
        bound = {k: self._state(name, k) if k in state else self._tensor(name, k) for k in fqns}
        runner.load_constants(bound, check_full_update=True, user_managed=True)
        log.debug("loaded compiled %s in %.2f s", name, time.perf_counter() - start)
        return runner

    def _parameter(self, method: str, key: str) -> torch.nn.Parameter:
        """The program checks that parameters are Parameters: wrap (no copy)
        once, so every method binds the same object."""
        key = self.aliases.get(key, key)
        if key not in self._parameters:
            self._parameters[key] = torch.nn.Parameter(self._tensor(method, key), requires_grad=False)
        return self._parameters[key]

    def _state(self, method: str, key: str) -> torch.Tensor:
        if key not in self.state:
            raise PackageError(f"methods.{method}: runtime state {key!r} is not bound (the I/O manager allocates it)")
        return self.state[key]

    def _tensor(self, method: str, key: str) -> torch.Tensor:
        key = self.aliases.get(key, key)
        if key not in self.tensors:
            raise PackageError(f"methods.{method}.weights: tensor {key!r} is not in {self.reader.weights_path.name}")
        return self.tensors[key]

    def tokenizer(self):
        from kvexport.runtime.text import load_tokenizer

        return load_tokenizer(self.reader.tokenizer_dir)


_ISA_ORDER = ("avx2", "avx512")


def check_target(target: dict) -> None:
    """Refuses a compiled package this machine cannot run, saying what the
    package needs and what the machine has."""
    import platform

    needs, has = [], []
    if target.get("torch") != torch.__version__:
        needs.append(f"torch {target.get('torch')}")
        has.append(f"torch {torch.__version__}")
    if target.get("machine") not in (None, platform.machine()):
        needs.append(target["machine"])
        has.append(platform.machine())
    if target.get("device") == "cuda":
        if not torch.cuda.is_available():
            needs.append("a CUDA GPU")
            has.append("none")
    elif target.get("cpu_isa"):
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        available = [str(isa) for isa in valid_vec_isa_list()]
        if target["cpu_isa"] not in available:
            needs.append(f"CPU instructions {target['cpu_isa']}")
            has.append(", ".join(available) or "no vector ISA")
    if needs:
        raise PackageError(
            f"backend.target: this package was compiled for {', '.join(needs)}; this machine has {', '.join(has)}. "
            f"Export it again here (kvexport export --backend aoti), or use a portable package"
        )


def load(path: str | Path, *, verify: bool = True, **options: Any) -> IOManager:
    """Opens a package and returns the I/O manager its contract selects.
    Options go to the manager (for offgraph_kv: max_cells, allocator)."""
    reader = PackageReader(path)
    manager_cls = select_io_manager(reader.manifest)
    mf.require(manager_cls.check_manifest(reader.manifest), f"{reader.path}: the package breaks its contract")
    return manager_cls(LoadedPackage(reader, verify=verify), **options)
