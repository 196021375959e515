"""`kvexport validate`: checks a package without running it. Programs are
read as JSON; nothing is rebuilt, compiled or unpickled."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvexport.contract.errors import PackageError
from kvexport.contract import manifest as mf
from kvexport.contract.display import escape
from kvexport.contract.package import PackageReader
from kvexport.contract.torch_compat import parse_program_json
from kvexport.contract.op_allowlist import program_limits
from kvexport.contract.program_check import check_program
from kvexport.contract.step_width import GraphView, StepWidthError, check_step_width, view_of_serialized
from kvexport.contract.tokenizer_files import tokenizer_problems


@dataclass
class Report:
    path: str
    violations: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        if self.ok:
            return f"{self.path}: ok ({', '.join(self.checked)})"
        return f"{self.path}: {len(self.violations)} violation(s)"


def validate_package(path: str | Path) -> Report:
    """Every violation the package holds, never an exception: a package is
    untrusted input, and a CI job needs the whole list."""
    report = Report(str(path))
    try:
        reader = PackageReader(path)
        check = mf.contract_check(reader.manifest)
    except PackageError as e:
        report.violations.append(str(e))
        return report
    manifest = reader.manifest
    contract = manifest["contract"]
    contract_problems = check(manifest)
    report.violations += contract_problems
    report.checked.append(f"{contract['name']} v{contract['version']} schema")
    report.violations += reader.verify_checksums()
    report.checked.append(f"{len(manifest['files'])} checksums")
    if manifest.get("tokenizer"):
        report.violations += tokenizer_problems(reader)
        report.checked.append("the tokenizer's files and config")
    if contract_problems:
        return report  # the programs cannot be compared with an invalid manifest
    try:
        header = weights_header(reader)
    except PackageError as e:
        report.violations.append(str(e))
        header = None
    for name, entry in manifest["methods"].items():
        report.violations += check_method(reader, name, entry, header)
    report.checked.append(
        f"{len(manifest['methods'])} programs against the allowlist, their specs, step widths and the weights they bind"
    )
    return report


def check_method(reader: PackageReader, name: str, entry: dict, header: dict | None) -> list[str]:
    """One method's stored program: the allowlist, then its I/O against the
    manifest, its step width, and the tensors it binds against the weights."""
    try:
        program = parse_program_json(reader.program_json(name), name)
    except PackageError as e:
        return [str(e)]
    problems = check_program(name, program, program_limits(reader.manifest))
    if problems:
        return problems
    try:
        view = view_of_serialized(program)
        problems += check_program_io(name, entry, program, view)
        if "step_width" in entry:
            try:
                check_step_width(entry["step_width"], view)
            except StepWidthError as e:
                problems.append(f"methods.{name}.step_width: {e}")
        if header is not None:
            problems += check_bound_tensors(name, entry, program, view, header, reader.manifest)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        problems.append(f"methods.{name}.program: malformed program ({type(e).__name__}: {str(e)[:200]})")
    return problems


def weights_header(reader: PackageReader) -> dict:
    """The safetensors header of the weights file: name -> (dtype, shape).
    Read alone (8 bytes of length, then JSON), no tensor is loaded; the
    tensors' byte ranges must tile the rest of the file, as the loader
    requires."""
    return {name: (dtype, shape) for name, (dtype, shape, _) in weights_layout(reader).items()}


def weights_layout(reader: PackageReader) -> dict:
    """name -> (dtype, shape, (begin, end)): each tensor's bytes as a range
    of the file, checked as `weights_header` says."""
    path = reader.weights_path
    where = f"weights.file {path.name}"
    fd = reader.open_file(reader.weights_file, "weights.file")  # no link followed, as the loader opens it
    try:
        (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if size > MAX_HEADER_BYTES:
            raise PackageError(f"{where}: a header of {size} bytes is not safetensors")
        header = json.loads(os.pread(fd, size, 8))
        data_bytes = os.fstat(fd).st_size - 8 - size
    except (OSError, struct.error, ValueError, RecursionError) as e:
        raise PackageError(f"{where}: not a safetensors file ({type(e).__name__}: {str(e)[:200]})") from None
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise PackageError(f"{where}: the header is not a JSON object")
    out, spans = {}, []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(info, dict) and DTYPE_BYTES.get(str(info.get("dtype"))) and _ints(info.get("shape"))):
            raise PackageError(f"{where}: tensor {key!r:.100} has no known dtype and shape of ints")
        offsets = info.get("data_offsets")
        if not (_ints(offsets) and len(offsets) == 2 and offsets[1] - offsets[0] == math.prod(info["shape"]) * DTYPE_BYTES[info["dtype"]]):
            raise PackageError(f"{where}: tensor {key!r:.100}: data_offsets {offsets!r:.80} do not hold its dtype and shape")
        spans.append(offsets)
        begin = 8 + size + offsets[0]
        out[key] = (SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"]), tuple(info["shape"]), (begin, begin + offsets[1] - offsets[0]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise PackageError(f"{where}: the tensors' bytes overlap or leave a gap at byte {end} of the data")
        end = stop
    if end != data_bytes:
        raise PackageError(f"{where}: the tensors take {end} bytes, the file holds {data_bytes} after its header")
    return out


def _ints(value: object) -> bool:
    """A list of non-negative ints (a shape, or a byte range)."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


MAX_HEADER_BYTES = 100 << 20
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def check_bound_tensors(
    method: str, entry: dict, program: dict, view: GraphView, header: dict, manifest: dict
) -> list[str]:
    """Every tensor the program takes from the weights file exists there
    with the dtype and shape the program was traced with."""
    aliases = manifest.get("weights", {}).get("aliases", {})
    state = set(entry["weights"].get("state", []))
    # what the runtime allocates for them (check_bindings vouched for the specs)
    allocated = {s["name"]: (s["dtype"], tuple(s["shape"])) for s in entry.get("state", [])}
    problems = []
    for spec in program["graph_module"]["signature"]["input_specs"]:
        kind = next((k for k in ("parameter", "buffer", "tensor_constant") if k in spec), None)
        if kind is None:
            continue
        target = spec[kind].get("parameter_name") or spec[kind].get("buffer_name") or spec[kind].get("tensor_constant_name")
        placeholder = spec[kind]["arg"]["name"]
        want_dtype, want_shape = view.dtypes.get(placeholder), view.shapes.get(placeholder)
        if target in state:  # allocated by the runtime, not read from the file
            if target in allocated and allocated[target] != (want_dtype, want_shape):
                dtype, shape = allocated[target]
                problems.append(
                    f"methods.{method}.state: {target!r} is {dtype} {list(shape)}, the program takes "
                    f"{want_dtype} {list(want_shape or ())}"
                )
            continue
        key = aliases.get(target, target)
        where = f"methods.{method}.weights: {target!r}"
        if key not in header:
            problems.append(f"{where} is not in the weights file")
            continue
        dtype, shape = header[key]
        if dtype != want_dtype or shape != want_shape:
            problems.append(
                f"{where}: the weights file holds {dtype} {list(shape)}, the program takes {want_dtype} {list(want_shape or ())}"
            )
    return problems


def check_program_io(method: str, entry: dict, program: dict, view: GraphView) -> list[str]:
    """The stored graph's user inputs and outputs against the manifest's
    specs: count, dtype, rank, static sizes and dynamic ranges."""
    graph = program["graph_module"]
    ranges = {k: (v.get("min_val"), v.get("max_val")) for k, v in program.get("range_constraints", {}).items()}
    outputs = [
        spec["user_output"]["arg"]["as_tensor"]["name"]
        for spec in graph["signature"]["output_specs"]
        if "user_output" in spec and "as_tensor" in spec["user_output"]["arg"]
    ]
    problems = []
    for side, names, specs in (("inputs", view.user_inputs, entry["inputs"]), ("outputs", outputs, entry["outputs"])):
        if len(names) != len(specs):
            problems.append(f"methods.{method}.{side}: the program has {len(names)}, the manifest lists {len(specs)}")
            continue
        for i, (value, spec) in enumerate(zip(names, specs)):
            where = f"methods.{method}.{side}[{i}] ({spec['name']})"
            dtype, shape = view.dtypes.get(value), view.shapes.get(value, ())
            if dtype != spec["dtype"]:
                problems.append(f"{where}: the program's dtype is {dtype}, the manifest says {spec['dtype']}")
            if len(shape) != len(spec["shape"]):
                problems.append(f"{where}: the program's rank is {len(shape)}, the manifest says {len(spec['shape'])}")
                continue
            for d, (size, want) in enumerate(zip(shape, spec["shape"])):
                if isinstance(want, int) and size != want:
                    problems.append(f"{where}: dim {d} is {size} in the program, the manifest says {want}")
                elif isinstance(want, dict):
                    if isinstance(size, int):
                        problems.append(f"{where}: dim {d} is static {size} in the program, the manifest says dynamic {want['name']}")
                    elif size in ranges and ranges[size] != (want["min"], want["max"]):
                        lo, hi = ranges[size]
                        problems.append(
                            f"{where}: dim {d} ranges over {lo}..{hi} in the program, the manifest says {want['min']}..{want['max']}"
                        )
    return problems


def render(report: Report) -> str:
    """One line per violation: a violation quotes package strings, escaped so
    that none can forge a line or steer the terminal."""
    if report.ok:
        return escape(report.summary())
    return escape(report.summary()) + "\n" + "\n".join(f"  - {escape(v)}" for v in report.violations)

