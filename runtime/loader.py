"""Loading a package: the I/O-manager registry, the shared weights, and the
programs (rebuilt lazily, on first use, around the one copy of the weights).

Third parties add a contract by registering an IOManager subclass:

    @register_io_manager("my_contract", 1)
    class MyManager(IOManager):
        @staticmethod
        def check_manifest(manifest): ...   # -> list of violations (registered
                                            # with kvexport.contract's registry)
        def __init__(self, package, **options): ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from kvexport.contract import manifest as mf
from kvexport.contract import safetensors_io, torch_compat, trust
from kvexport.contract.errors import PackageError
from kvexport.contract.op_allowlist import program_limits
from kvexport.contract.package import WEIGHTS_MEMORY, PackageReader

log = logging.getLogger(__name__)


class IOManager:
    """Drives a package's programs according to the contract it declares."""

    contract: tuple[str, int]
    batches_sessions = False  # True: step() takes many sessions at once (generate batches them)

    @staticmethod
    def check_manifest(manifest: dict) -> list[str]:
        """The contract's check, from the contract registry."""
        return mf.check_manifest(manifest)

    def __init__(self, package: "LoadedPackage", **options: Any):
        self.package = package


_REGISTRY: dict[tuple[str, int], type[IOManager]] = {}


def register_io_manager(name: str, version: int) -> Callable[[type[IOManager]], type[IOManager]]:
    def decorate(cls: type[IOManager]) -> type[IOManager]:
        key = (name, version)
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise ValueError(f"an I/O manager for {name} v{version} is already registered: {_REGISTRY[key].__name__}")
        cls.contract = key
        if "check_manifest" in cls.__dict__:  # a third party's contract brings its own check
            mf.register_contract(name, version, cls.check_manifest)
        _REGISTRY[key] = cls
        return cls

    return decorate


def registered_contracts() -> list[tuple[str, int]]:
    return sorted(_REGISTRY)


def select_io_manager(manifest: dict) -> type[IOManager]:
    mf.contract_check(manifest)  # refuses an unknown contract or version, naming the known ones
    key = (manifest["contract"]["name"], manifest["contract"]["version"])
    if key not in _REGISTRY:
        raise PackageError(f"contract: this runtime has no I/O manager for {key[0]} v{key[1]}")
    return _REGISTRY[key]


class LoadedPackage:
    """A package's manifest, its one copy of the weights, and its methods."""

    def __init__(self, reader: PackageReader, verify: bool = True, trust_native_code: bool = False,
                 weights: str = "mapped"):  # load() has checked `weights`
        self.reader = reader
        self.manifest = reader.manifest
        self.backend = self.manifest.get("backend", {"id": mf.DEFAULT_BACKEND})
        self.device = "cpu"
        target = mf.compiled_target(self.manifest)
        if target is not None:
            check_target(target)
            # before any byte of it is read: native code runs with the user's permissions
            trust.require_native_code_trusted(reader, trust_native_code)
            self.device = target["device"]
            verify = True  # native code: never load a byte the manifest does not vouch for
        if verify:
            # The weights are hashed from their mapping, below. Compiled archives
            # (small: no weights) are checked here, so a damaged one is named at
            # load, and again from the copy that _load_compiled loads.
            mf.require(reader.verify_checksums(skip=(reader.weights_file,)), f"{reader.path}: the package is damaged")
        reader.hold_programs()  # every method is built from these bytes, whenever it is first used
        start = time.perf_counter()
        self.tensors: dict[str, torch.Tensor] = self._map_weights(reader.weights_file, verify, weights)
        log.debug("loaded %d weight tensors in %.2f s", len(self.tensors), time.perf_counter() - start)
        self.aliases: dict[str, str] = self.manifest.get("weights", {}).get("aliases", {})
        self.state: dict[str, torch.Tensor] = {}  # runtime-owned tensors a program binds (ingraph_kv's cache)
        self._parameters: dict[str, torch.nn.Parameter] = {}
        self._methods: dict[str, Callable] = {}

    def _map_weights(self, rel: str, verify: bool, hold: str) -> dict[str, torch.Tensor]:
        """The weights as views of one private mapping of the file (or, as
        `hold` says, of their copy in this process's memory), hashed from that
        mapping: no later rename in the folder changes them. safetensors'
        header, parsed here: no pickle; these tensors are the only copy every
        method binds."""
        mapping = self.reader.map_file(rel, "weights.file", verify, hold)
        try:
            tensors = safetensors_io.map_tensors(mapping, Path(rel))
        except ValueError as e:
            raise PackageError(f"weights.file {rel}: not a safetensors file this runtime can read ({str(e)[:200]})") from None
        if self.device != "cpu":
            tensors = {k: v.to(self.device) for k, v in tensors.items()}
        return tensors

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest["metadata"]

    def has_method(self, name: str) -> bool:
        return name in self.manifest["methods"]

    def build_methods(self) -> None:
        """Builds every method now rather than at its first call."""
        for name in self.manifest["methods"]:
            self.method(name)

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
            program = torch_compat.graph_from_json(
                self.reader.program_json(name), state, constants, method=name, limits=program_limits(self.manifest)
            )
            _check_bound_tensors(program, name)
            module = torch_compat.module_of(program, name)
            # The I/O manager builds every input from the manifest's specs;
            # the per-call shape checks cost milliseconds a step.
            module._forward_pre_hooks.clear()
            self._methods[name] = module
            log.debug("rebuilt %s in %.2f s", name, time.perf_counter() - start)
        return self._methods[name]

    def run(self, name: str, *inputs: torch.Tensor) -> Any:
        """Calls a method on inputs the I/O manager built from the manifest.
        The program is the package's, so one that fails on them is a broken
        package (a graph edited by hand, say), named as such."""
        method = self.method(name)
        try:
            return method(*inputs)
        except torch.OutOfMemoryError:
            raise  # the machine's limit, not the package's fault
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise PackageError(
                f"methods.{name}: the program fails on the inputs its manifest describes ({type(e).__name__}: "
                f"{str(e)[:300]}); the package is damaged or inconsistent: check it with kvexport validate, or export it again"
            ) from e

    def _load_compiled(self, name: str) -> Callable:
        """An AOTInductor method with the package's tensors bound as
        user-managed constants (no copy), before it can ever be called:
        calling one with unbound constants crashes the process."""
        if mf.compiled_target(self.manifest) is None:
            # only the compiled branch of __init__ makes the trust decision
            raise PackageError(f"methods.{name}.compiled: only a package whose backend declares a compile target may "
                               f"hold compiled code (backend {self.backend['id']!r} declares none)")
        entry = self.manifest["methods"][name]
        start = time.perf_counter()
        runner = load_compiled_copy(self.reader, entry["compiled"], f"methods.{name}.compiled")
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
        return CompiledMethod(runner)

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

        return load_tokenizer(self.reader)


class CompiledMethod:
    """A loaded AOTInductor method, called with a flat list of tensors (what
    the I/O managers pass). torch's own call flattens the inputs through
    pytree on every call, a fifth of a decode step's host work; the output
    spec is read once here."""

    def __init__(self, model: Any):
        self.model = model
        self.loader = model.loader
        in_spec, self.out_spec = (pytree.treespec_loads(s) for s in self.loader.get_call_spec())
        self.flat_inputs = in_spec.num_leaves if in_spec == pytree.tree_structure((tuple(range(in_spec.num_leaves)), {})) else None

    def __call__(self, *inputs: Any) -> Any:
        if self.flat_inputs != len(inputs) or not all(isinstance(x, torch.Tensor) for x in inputs):
            return self.model(*inputs)  # torch's own call, and its own error
        return pytree.tree_unflatten(self.loader.boxed_run(list(inputs)), self.out_spec)


def check_output(method: str, value: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A method's result is what the contract says it returns: the program
    is the package's, and the runtime indexes into what it gets."""
    if not (isinstance(value, torch.Tensor) and tuple(value.shape) == shape and value.dtype == dtype):
        found = type(value).__name__
        if isinstance(value, torch.Tensor):
            found = f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
        raise PackageError(
            f"methods.{method}: returned {found}, the contract says {str(dtype).removeprefix('torch.')} {list(shape)}"
        )
    return value


def _check_bound_tensors(program: torch.export.ExportedProgram, method: str) -> None:
    """Every tensor bound into the program (weights, runtime state) has the
    dtype and static shape the program was traced with: the weights file
    and the manifest's state specs may disagree with the graph."""
    sig = program.graph_signature
    targets = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    bound = {**program.state_dict, **program.constants}
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in targets or targets[node.name] not in bound:
            continue
        want, tensor = node.meta.get("val"), bound[targets[node.name]]
        if not isinstance(want, torch.Tensor) or not isinstance(tensor, torch.Tensor):
            continue
        shape = [d if isinstance(d, int) else None for d in want.shape]  # a symbolic dim takes any size
        if tensor.dtype != want.dtype or len(shape) != tensor.dim() or any(
            d is not None and d != t for d, t in zip(shape, tensor.shape)
        ):
            raise PackageError(
                f"methods.{method}: {targets[node.name]!r} is bound as {str(tensor.dtype).removeprefix('torch.')} "
                f"{list(tensor.shape)}, the program takes {str(want.dtype).removeprefix('torch.')} {list(want.shape)}"
            )


def load_compiled_copy(reader: PackageReader, rel: str, what: str):
    """Loads a compiled archive from a copy hashed as it was made, in a
    folder only this user can write, never from the package's folder
    (torch opens the archive by path, more than once when a load fails).
    torch unpacks the archive under the temp dir it reads from TMPDIR: that
    is pointed into the same folder for the call, so removing the folder
    afterwards leaves nothing behind, whether the load succeeded or not;
    the library, once loaded, needs none of those files."""
    folder = tempfile.mkdtemp(prefix="kvexport-aoti-")  # mode 0700
    try:
        copy = reader.copy_file(rel, Path(folder), what)
        with _temp_dir(folder):
            try:
                return torch._inductor.aoti_load_package(str(copy))
            except Exception as e:  # torch raises RuntimeError, or anything its archive reader meets
                raise PackageError(
                    f"{what}: the compiled library in {rel} does not load ({type(e).__name__}: {str(e)[:300]}); "
                    f"export the package again on this machine, or use a portable package"
                ) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _temp_dir(folder: str) -> Iterator[None]:
    """TMPDIR (read by torch's C++ loader) and Python's tempfile point at
    `folder` for the block. Process-wide: loads are not run concurrently."""
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = folder, folder
    try:
        yield
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env


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


def load(
    path: str | Path, *, verify: bool = True, trust_native_code: bool = False, expect_digest: str | None = None,
    weights: str = "mapped", **options: Any
) -> IOManager:
    """Opens a package and returns the I/O manager its contract selects.
    Options go to the manager (for offgraph_kv: max_cells, allocator).

    `weights`: "mapped" (a private mapping of the file: processes that load
    the package share one copy in the page cache, and a model larger than
    memory pages in and out), "private" (copied into this process's
    memory on transparent huge pages where the kernel has them: faster
    streaming of the weights, at the price of a copy per process; refused
    where the weights do not fit in the memory available) or "auto"
    (private where the weights take at most half the memory available,
    mapped otherwise). `runtime.package.reader.holding` says which.

    A package with native code (aoti) loads only when trusted: its manifest
    digest is in the trust store (`kvexport trust`, or exported here), or
    `trust_native_code`, or it equals `expect_digest`. A package whose digest
    differs from `expect_digest` is refused, compiled or not."""
    if weights not in WEIGHTS_MEMORY:  # before any byte of the package is read
        raise ValueError(f"weights={weights!r}: one of {', '.join(WEIGHTS_MEMORY)}")
    reader = PackageReader(path)
    trust.check_expected_digest(reader, expect_digest)
    manager_cls = select_io_manager(reader.manifest)
    mf.require(mf.check_manifest(reader.manifest), f"{reader.path}: the package breaks its contract")
    trusted = trust_native_code or expect_digest is not None  # a pin that matched vouches for the code
    return manager_cls(LoadedPackage(reader, verify=verify, trust_native_code=trusted, weights=weights), **options)
