"""Compiled methods kept by what their bytes depend on, so an export whose
method compiled before (a re-export, another forward size, a method shared
between packages such as `sample`) copies it instead of compiling again.

A method compiles in a directory fixed by its name (compile.py), so two
compiles of one key give the same bytes, and a copy from here is the bytes a
compile would give. The key covers the stored program, the weights' names,
dtypes and shapes (the compile never reads a parameter's values; buffers and
constants it may fold in are keyed by their bytes), the inputs, the compile
options and kernels, the thread count inductor splits loops for, torch, the C++ compiler, the CPU instruction set and
kvexport's own code. The folder is the user's own, beside the kernels'
library that every compiled method links (kernels/build.py): whoever can
write there could change either.

KVEXPORT_COMPILE_CACHE=off turns it off; a path moves it (default: kvexport's
cache directory / compiled). The oldest entries go beyond LIMIT_BYTES."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SETTING = "KVEXPORT_COMPILE_CACHE"
LIMIT_BYTES = 4 * 2**30
FORMAT = 1  # bump when what a key covers changes


@dataclass(frozen=True)
class Entry:
    seconds: float  # how long the compile took
    calls: dict  # kvexport's kernels the code calls, by name


def folder() -> Path | None:
    """Where compiled methods are kept, or None when the cache is off."""
    from kvexport.contract.package import cache_dir

    setting = os.environ.get(SETTING, "")
    if setting.lower() in ("off", "0", "no", "false"):
        return None
    return Path(setting) if setting else cache_dir() / "compiled"


def key(job, configs: dict) -> str:
    """Everything the compiled bytes of `job` (a CompileJob) depend on, hashed."""
    import torch
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from kvexport.contract.safetensors_io import read_header
    from kvexport.partitioners.aoti.kernels.build import compiler_version

    digest = hashlib.sha256()

    def part(*values) -> None:
        digest.update(json.dumps(values, sort_keys=True, default=str).encode() + b"\0")

    compiler = get_cpp_compiler()
    part(FORMAT, job.method, job.threads, job.inputs, job.device, list(job.state), list(job.kernel_rows), list(job.packed_rows),
         list(job.attention_rows), job.bf16_every_row_count,
         job.kernel_archive.name if job.kernel_archive else None, {k: repr(v) for k, v in sorted(configs.items())}, torch.__version__,
         str(pick_vec_isa()), os.environ.get("ATEN_CPU_CAPABILITY"), compiler, compiler_version(compiler), _code_digest())
    digest.update(gzip.decompress(job.graph.read_bytes()))
    ranges, _ = read_header(job.weights)
    parameters = set(job.bindings["parameters"])
    with open(job.weights, "rb") as weights:
        for kind in ("parameters", "buffers", "constants"):
            for name in sorted(job.bindings[kind]):
                stored = ranges[job.aliases.get(name, name)]
                part(kind, name, stored.name, str(stored.dtype), list(stored.shape))
                if name not in parameters:  # values the compile may fold into the code
                    weights.seek(stored.offset)
                    digest.update(weights.read(stored.nbytes))
    return digest.hexdigest()


@functools.cache
def _code_digest() -> str:
    """kvexport's code that shapes a compile: the graph reader (contract),
    the passes and the backend with its kernels. Read once a process, not
    once a method."""
    import kvexport.contract
    import kvexport.partitioners
    import kvexport.passes

    return source_digest(kvexport.contract, kvexport.partitioners, kvexport.passes)


def source_digest(*packages) -> str:
    """A digest of these import packages' code (.py, .cpp, .h), file by file
    under their names: the compile cache's key, and the benches' for the
    packages they export once."""
    digest = hashlib.sha256()
    for package in packages:
        for root in map(Path, package.__path__):
            for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h")):
                digest.update(f"{package.__name__}/{path.relative_to(root).as_posix()}".encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def fetch(root: Path, key: str, output: Path) -> Entry | None:
    """Copies the method kept under `key` to `output`; None when there is
    none, or when its bytes are not the ones recorded."""
    archive, record = root / f"{key}.pt2", root / f"{key}.json"
    try:
        meta = json.loads(record.read_text())
        data = archive.read_bytes()
        entry = Entry(float(meta["seconds"]), {str(k): int(v) for k, v in dict(meta["calls"]).items()})
        intact = hashlib.sha256(data).hexdigest() == meta["sha256"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not intact:
        log.warning("the compile cache's %s is damaged: compiling again", archive)
        return None
    staged = output.with_name(output.name + ".partial")
    staged.write_bytes(data)
    os.replace(staged, output)
    for path in (archive, record):
        path.touch()  # recently used: kept longest
    return entry


def store(root: Path, key: str, output: Path, entry: Entry) -> None:
    """Keeps `output` under `key` (the record last: a reader finds both or
    neither), then trims the folder to LIMIT_BYTES. A folder that cannot be
    written costs the cache, never the export."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        data = output.read_bytes()
        record = {"seconds": round(entry.seconds, 1), "calls": entry.calls, "sha256": hashlib.sha256(data).hexdigest()}
        for suffix, content in ((".pt2", data), (".json", json.dumps(record).encode())):
            fd, staged = tempfile.mkstemp(dir=root, prefix=".staged-")
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.replace(staged, root / f"{key}{suffix}")
        _trim(root)
    except OSError as e:
        log.warning("could not keep a compiled method in %s: %s", root, e)


def _trim(root: Path) -> None:
    archives = sorted(root.glob("*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
    kept = 0
    for archive in archives:
        kept += archive.stat().st_size
        if kept > LIMIT_BYTES:
            archive.with_suffix(".json").unlink(missing_ok=True)
            archive.unlink(missing_ok=True)
