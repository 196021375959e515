"""Compiling a package's methods with AOTInductor, in parallel worker
processes. Each worker rebuilds its method from the package's own files (the
JSON graph, and the weights file's header: the weights' dtypes and shapes),
so nothing but paths crosses the process boundary. Weights stay out of the
compiled code (`package_constants_in_so=False`), so the workers compile
around uninitialized stand-ins of the parameters and never read one; the
runtime binds the real ones."""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from kvexport.contract.errors import ExportError
from kvexport.partitioners.aoti import compile_cache

log = logging.getLogger(__name__)

# no line tables: they were two thirds of a compiled method's bytes (debug
# sections of the .so) and hold the build directory's paths
INDUCTOR_CONFIGS = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.enable_line_tables": False,
    # the compile sees stand-ins, not the weights: nothing may be folded from
    # their values (inductor folds a tensor whose elements are all equal,
    # such as a fresh RMSNorm weight, into the code)
    "joint_graph_constant_folding": False,
}
HEARTBEAT_S = 20.0  # a progress line at least this often while compiling


@dataclass(frozen=True)
class CompileJob:
    method: str
    graph: Path  # programs/<method>.json.gz
    weights: Path
    bindings: dict  # parameters / buffers / constants names
    aliases: dict
    inputs: list  # the manifest's input specs: example shapes come from them
    output: Path
    device: str = "cpu"
    state: tuple = ()  # runtime-owned buffers (ingraph_kv's cache): zeros stand in while compiling
    kernel_rows: tuple = ()  # fp32 linears and attention over these static row counts call kvexport's kernels
    kernel_archive: Path | None = None  # the folder of kvexport's kernels' static library (kernels/build.py)
    packed_rows: tuple = ()  # products by packed weights over these static row counts call the packed kernel
    threads: int = 0  # torch's threads while compiling (inductor splits loops by them); 0: the exporter's
    attention_rows: tuple = ()  # attention over these static row counts calls the masked attention kernel
    bf16_every_row_count: bool = False  # bf16 linears over any rows call the row kernel (AVX2: no fast bf16 GEMM)


def configs_of(job: CompileJob) -> dict:
    """The inductor settings `job` compiles with."""
    if not (job.kernel_rows or job.packed_rows or job.attention_rows or job.bf16_every_row_count):
        return _known(INDUCTOR_CONFIGS)
    from kvexport.partitioners.aoti.kernels.build import inductor_configs

    return _known(INDUCTOR_CONFIGS) | inductor_configs()


def _known(configs: dict) -> dict:
    """The settings this torch has. torch 2.11 has no
    aot_inductor.enable_line_tables: its methods keep their line tables
    (larger archives, nothing else)."""
    from torch._inductor import config

    def has(key: str) -> bool:
        owner = config
        for part in key.split("."):
            if not hasattr(owner, part):
                return False
            owner = getattr(owner, part)
        return True

    return {key: value for key, value in configs.items() if has(key)}


def compile_one(job: CompileJob) -> tuple[str, float, dict[str, int], bool]:
    """Runs in a worker: rebuild the method around the weights and compile.
    Returns the method, the seconds it took, how many calls of each of
    kvexport's kernels its compiled code makes, and whether it compiled in
    its fixed directory (so that another compile gives the same bytes)."""
    import warnings

    warnings.filterwarnings("ignore")  # torch's deprecation notices, once per worker
    import torch
    import torch._inductor.inductor_prims  # noqa: F401  (ops the fused products use; see passes/quantized_weights.py)
    from safetensors import safe_open
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from kvexport.contract import torch_compat
    from kvexport.contract.safetensors_io import read_header

    start = time.perf_counter()
    # the compiled code never holds the weights (package_constants_in_so=False),
    # so uninitialized stand-ins of each parameter's dtype and shape serve: their
    # pages are never touched, and a worker's memory does not grow with the
    # model. Buffers and constants (rotary frequencies, a pass's tensors) are
    # mapped from the file: inductor may fold small ones into the code
    ranges, _ = read_header(job.weights)
    tensors: dict[tuple[str, bool], torch.Tensor] = {}  # one tensor per stored name: tied names share it
    parameters = set(job.bindings["parameters"])
    with safe_open(str(job.weights), "pt", device=job.device) as weights:
        def tensor(name: str) -> torch.Tensor:
            stored = job.aliases.get(name, name)
            key = (stored, name in parameters)
            if key not in tensors:
                if name in parameters:
                    tensors[key] = torch.empty(ranges[stored].shape, dtype=ranges[stored].dtype, device=job.device)
                else:
                    tensors[key] = weights.get_tensor(stored)
            return tensors[key]

        state = {k: torch.nn.Parameter(tensor(k), requires_grad=False) for k in job.bindings["parameters"]}
        state.update({k: tensor(k) for k in job.bindings["buffers"]})
        constants = {k: tensor(k) for k in job.bindings["constants"]}
    for spec in job.state:
        constants[spec["name"]] = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=job.device)
    program = torch_compat.graph_from_json(gzip.decompress(job.graph.read_bytes()), state, constants)
    program.example_inputs = (tuple(t.to(job.device) for t in example_inputs(job.inputs)), {})
    calls: dict[str, int] = {}
    if job.kernel_rows or job.packed_rows or job.attention_rows or job.bf16_every_row_count:
        from kvexport.partitioners.aoti.passes import compile_passes
        from kvexport.passes.base import run_passes

        passes = compile_passes(job.kernel_rows, job.packed_rows, job.attention_rows, job.bf16_every_row_count)
        run_passes(program.graph_module, passes, job.method)
        for node in program.graph_module.graph.nodes:
            if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "kvexport":
                name = node.target._schema.name.split("::")[-1]
                calls[name] = calls.get(name, 0) + 1
    if job.device == "cpu":
        # inductor checks which instruction sets the compiler can build by
        # compiling a test library for each (about 2 s apiece); in inductor's
        # own cache folder they compile once a machine, in the method's fresh
        # one below once a method
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        valid_vec_isa_list()
    with compile_directory(job.method) as directory, temporary_cache_dir(str(directory)), _library_path(job.kernel_archive), \
            _threads(job.threads):
        torch._inductor.aoti_compile_and_package(program, package_path=str(job.output), inductor_configs=configs_of(job))
        fixed = directory.name == job.method
    _pack(job.output)
    return job.method, time.perf_counter() - start, calls, fixed


def _pack(archive: Path) -> None:
    """Rewrites a compiled archive smaller: the C++ that inductor generated
    emptied (about 40% of its bytes; loading needs the library, not its
    sources) and every entry deflated (a library shrinks about 3.5 x;
    torch's loader inflates it as it unpacks). The emptied entries stay:
    torch 2.11's loader finds a method's metadata by its source's name.
    Entries keep their order and dates, so the bytes stay the same from one
    compile to the next."""
    import zipfile

    staged = archive.with_name(archive.name + ".partial")
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(staged, "w") as target:
        for info in source.infolist():
            data = b"" if info.filename.endswith(".cpp") else source.read(info)
            info.compress_type = zipfile.ZIP_DEFLATED
            target.writestr(info, data, compresslevel=6)
    os.replace(staged, archive)


@contextlib.contextmanager
def _threads(count: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _library_path(folder: Path | None):
    """The kernels' folder first on LIBRARY_PATH while compiling: the link
    finds its static library there (inductor passes `-l<name>` only)."""
    before = os.environ.get("LIBRARY_PATH")
    if folder is not None:
        os.environ["LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(folder), before]))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LIBRARY_PATH", None)
        else:
            os.environ["LIBRARY_PATH"] = before


@contextlib.contextmanager
def compile_directory(method: str):
    """An empty compile directory at a path fixed by the method's name.
    AOTInductor writes that path into the generated code, so a fixed one
    makes two compiles of one method byte-identical; a fresh one keeps
    code from another export or instruction set (inductor's cache does not
    key on ATEN_CPU_CAPABILITY) out. Held with a lock; when another export
    holds it, a private directory serves, at the cost of identical bytes."""
    root = Path(tempfile.gettempdir()) / f"kvexport-aoti-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    root.mkdir(parents=True, exist_ok=True)
    fixed = root / method
    with open(root / f"{method}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s is in use by another export: compiling %s elsewhere (its bytes will differ)", fixed, method)
            with tempfile.TemporaryDirectory(prefix=f"kvexport-aoti-{method}-") as private:
                yield Path(private)
            return
        shutil.rmtree(fixed, ignore_errors=True)
        fixed.mkdir()
        try:
            yield fixed
        finally:
            shutil.rmtree(fixed, ignore_errors=True)


def example_inputs(specs: list[dict]) -> tuple:
    """Tensors of the specs' dtypes and shapes (each dynamic dim at one size
    per name, >= 2, distinct between names): zeros, so every index is valid,
    and masks all True."""
    import torch

    sizes: dict[str, int] = {}
    for spec in specs:
        for dim in spec["shape"]:
            if isinstance(dim, dict) and dim["name"] not in sizes:
                size = max(dim["min"], 2)
                while size in sizes.values() and size < dim["max"]:
                    size += 1
                sizes[dim["name"]] = size
    out = []
    for spec in specs:
        shape = [d if isinstance(d, int) else sizes[d["name"]] for d in spec["shape"]]
        dtype = getattr(torch, spec["dtype"])
        out.append(torch.ones(shape, dtype=dtype) if dtype == torch.bool else torch.zeros(shape, dtype=dtype))
    return tuple(out)


def compile_methods(jobs: list[CompileJob], workers: int, progress: Callable[[str], None]) -> dict[str, float]:
    """Compiles every job, or copies it from the compile cache; returns the
    seconds each method's compile took. workers=0: one per core, at most one
    per job to compile."""
    import torch

    start = time.perf_counter()
    # every compile, here or in a worker, sees the exporter's thread count
    jobs = [replace(job, threads=job.threads or torch.get_num_threads()) for job in jobs]
    cache = compile_cache.folder()
    keys = {job.method: compile_cache.key(job, configs_of(job)) for job in jobs} if cache else {}
    seconds: dict[str, float] = {}
    left = []
    for job in jobs:
        kept = compile_cache.fetch(cache, keys[job.method], job.output) if cache else None
        if kept is None:
            left.append(job)
            continue
        seconds[job.method] = kept.seconds
        progress(f"[{len(seconds)}/{len(jobs)}] {job.method} from the compile cache (it compiled in {kept.seconds:.1f} s)"
                 f"{_kernel_calls(kept.calls)}")

    def compiled(job: CompileJob, result) -> None:
        method, took, calls, fixed = result
        seconds[method] = took
        progress(f"[{len(seconds)}/{len(jobs)}] {method} compiled in {took:.1f} s{_kernel_calls(calls)}")
        if cache and fixed:  # bytes another compile would reproduce
            compile_cache.store(cache, keys[method], job.output, compile_cache.Entry(took, calls))

    workers = workers or min(len(left), os.cpu_count() or 1)
    if workers <= 1:
        for job in left:
            compiled(job, _run(_compile_in_worker, job))
    elif left:
        # spawn: a forked child would inherit the parent's torch thread pools
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            pending = {pool.submit(_compile_in_worker, job): job for job in left}
            while pending:
                done, _ = wait(pending, timeout=HEARTBEAT_S, return_when=FIRST_COMPLETED)
                for future in done:
                    compiled(pending.pop(future), _run(future.result))
                if not done:
                    progress(_still_compiling(len(left) - len(pending), len(left), time.perf_counter() - start))
    reused = f", {len(jobs) - len(left)} from the compile cache" if len(left) < len(jobs) else ""
    if left:
        progress(f"compiled {len(left)} methods in {time.perf_counter() - start:.1f} s with {workers} worker(s){reused}")
    else:
        progress(f"all {len(jobs)} methods from the compile cache ({compile_cache.SETTING}=off compiles them)")
    return seconds


def _kernel_calls(calls: dict[str, int]) -> str:
    """', calling kvexport's packed_linear x15, rows_linear x2' (sorted), or ''."""
    if not calls:
        return ""
    return ", calling kvexport's " + ", ".join(f"{name} x{n}" for name, n in sorted(calls.items()))


def _still_compiling(done: int, total: int, elapsed: float) -> str:
    line = f"compiling: {done}/{total} methods done, {elapsed:.0f} s elapsed"
    if done:
        line += f", about {elapsed / done * (total - done):.0f} s left"
    return line


def _compile_in_worker(job: CompileJob) -> tuple[str, float, dict[str, int], bool]:
    """compile_one, whose failure becomes an ExportError naming the method,
    its message as text: an inductor error can hold frames, which do not
    pickle, and the parent of a worker would see "cannot pickle 'frame'
    object" instead of what went wrong."""
    try:
        return compile_one(job)
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001  (any compile failure: its type and message cross as text)
        raise ExportError(f"AOTInductor compile of {job.method} failed: {type(e).__name__}: {_short(e)}") from None


def _short(e: Exception, limit: int = 2000) -> str:
    text = str(e)
    return text if len(text) <= limit else text[:limit] + " [...]"


def _run(fn, *args):
    """fn(*args), a failure outside the compile itself (a worker that died)
    as an ExportError."""
    try:
        return fn(*args)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"AOTInductor compile failed: {type(e).__name__}: {e}") from e
