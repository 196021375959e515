"""Version-specific uses of torch internals, in one place, each with the
version it was written against. Both the exporter and the runtime use these.

torch 2.13: `torch.export.save` stores each program's weights inside its own
archive (8 programs, 8 copies) and its loader may fall back to a full
unpickler. A package instead stores every program as the serializer's JSON
graph alone, and binds the weights from one safetensors file at load. The
serde module's `serialize(..., serialize_state_dict=False, ...)` and its
`deserialize` taking dicts of tensors are the seam for that.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import types
import typing

import sympy
import torch
from torch._export.serde import serialize as serde

from kvexport.contract.errors import PackageError
from kvexport.contract.op_allowlist import DEFAULT_LIMITS, ProgramLimits
from kvexport.contract.program_check import UnsafeProgram, check_program, parse_sym_expr


@contextlib.contextmanager
def fake_mode_of(values: typing.Any) -> typing.Iterator[None]:
    """Runs an op on the fake tensors among `values` (a graph node's fake
    value) in their fake mode, with the Python dispatcher on. torch 2.11
    needs both for an op whose decomposition reads symbolic sizes (linear
    over [1, T, D]: "Cannot call numel() on tensor with symbolic sizes");
    2.13 finds the mode from the tensors themselves."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(values)
    if mode is None:
        yield
        return
    with mode, enable_python_dispatcher():
        yield


def graph_to_json(program: torch.export.ExportedProgram) -> bytes:
    """The program's graph, signature and shape constraints; no tensors.
    Stack traces are dropped: they hold the export machine's paths and make
    the bytes depend on where the export ran."""
    for node in program.graph_module.graph.nodes:
        node.meta.pop("stack_trace", None)
    # torch 2.13's serializer calls canonicalize() only to test that a
    # canonical form exists and drops the result; its deep copies are two
    # thirds of the serializing time of a 30-layer graph.
    with _patched(serde, "canonicalize", _skip_canonical_check):
        if "serialize_state_dict" in inspect.signature(serde.serialize).parameters:
            artifact = serde.serialize(
                program,
                serialize_state_dict=False,
                serialize_constants=False,
                serialize_example_inputs=False,
            )
        else:  # torch 2.11 has no such options: its pickling of the tensors is skipped by hand
            with _patched(serde, "serialize_torch_artifact", lambda *args, **kwargs: b""):
                artifact = serde.serialize(program)
    return artifact.exported_program


@contextlib.contextmanager
def _patched(module: types.ModuleType, name: str, value: typing.Any) -> typing.Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _skip_canonical_check(exported_program, constants=None):
    return exported_program


def _cache_serde_type_hints() -> None:
    """torch 2.13: the deserializer calls typing.get_type_hints once per JSON
    object (about 50,000 times for a 30-layer graph, 40% of the load time).
    The schema's dataclasses never change, so the serde module gets a typing
    namespace whose get_type_hints remembers its answers per class."""
    if getattr(serde, "typing", None) is not typing:
        return  # already done, or a torch whose serde no longer looks there
    cache: dict[tuple[type, int], dict] = {}

    def get_type_hints(obj, globalns=None, localns=None, include_extras=False):
        key = (obj, id(globalns), id(localns), include_extras)
        if key not in cache:
            cache[key] = typing.get_type_hints(obj, globalns, localns, include_extras)
        return cache[key]

    cached = types.ModuleType("typing")
    cached.__dict__.update(typing.__dict__)
    cached.get_type_hints = get_type_hints
    serde.typing = cached


def graph_from_json(
    program: bytes | dict,
    state_dict: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
    method: str = "program",
    limits: ProgramLimits = DEFAULT_LIMITS,
) -> torch.export.ExportedProgram:
    """Rebuilds a program around tensors the caller owns (they are bound, not
    copied). Passing dicts keeps the serializer from ever calling torch.load.

    Package text never reaches code: the program must pass the allowlist
    (program_check) first, its guards code and node metadata (which the
    deserializer resolves as attribute paths) are dropped, and symbolic
    sizes are built by program_check's own parser instead of sympify.
    `limits` are the package's (op_allowlist.program_limits(manifest))."""
    if isinstance(program, (bytes, str)):
        program = parse_program_json(program, method)
    problems = check_program(method, program, limits)
    if problems:
        raise PackageError("the program holds what a package may not:\n  " + "\n  ".join(problems))
    program = _inert(program)
    _cache_serde_type_hints()
    try:
        with _safe_sympify():
            serialized = serde._dict_to_dataclass(serde.ExportedProgram, program)
            return serde.ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, b"")
    except UnsafeProgram as e:
        raise PackageError(f"methods.{method}.program: {e}") from e
    except Exception as e:  # the serializer raises many types; name the cause
        raise PackageError(
            f"methods.{method}.program: cannot rebuild an exported program with torch {torch.__version__} "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from e


def module_of(program: torch.export.ExportedProgram, method: str = "program") -> torch.fx.GraphModule:
    """The program's runnable module. torch 2.13's unlifting asserts on
    what its deserializer lets through (a signature that does not match the
    graph, say); from a package that is the package's fault, named."""
    try:
        return program.module(check_guards=False)
    except Exception as e:
        raise PackageError(
            f"methods.{method}.program: cannot make a runnable module with torch {torch.__version__} "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from e


def parse_program_json(data: bytes | str, method: str) -> dict:
    try:
        program = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise PackageError(f"methods.{method}.program: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(program, dict):
        raise PackageError(f"methods.{method}.program: not a JSON object")
    return program


def _inert(program: dict) -> dict:
    """A shallow copy without guards code, and nodes without metadata: the
    runtime needs neither, and both are strings torch would interpret."""
    program = dict(program, guards_code=[])
    graph_module = dict(program["graph_module"])
    graph = dict(graph_module["graph"])
    graph["nodes"] = [dict(node, metadata={}) for node in graph["nodes"]]
    graph_module["graph"] = graph
    program["graph_module"] = graph_module
    return program


def _sympify_package_text(expr, locals=None, **kwargs):  # noqa: A002 (sympy's parameter name)
    """sympify as the deserializer may call it: package text goes through
    program_check's parser; sympy objects it built already pass through."""
    if isinstance(expr, sympy.Basic):
        return expr
    return parse_sym_expr(expr)


def _sympy_without_sympify() -> types.ModuleType:
    module = types.ModuleType("sympy")
    module.__dict__.update(sympy.__dict__)
    module.sympify = _sympify_package_text
    return module


@contextlib.contextmanager
def _safe_sympify():
    original = serde.sympy
    serde.sympy = _sympy_without_sympify()
    try:
        yield
    finally:
        serde.sympy = original


def placeholder_names(program: torch.export.ExportedProgram) -> dict[str, list[str]]:
    """The tensor names the program's signature binds, by kind: parameters,
    buffers (persistent ones, in the state dict) and constants."""
    sig = program.graph_signature
    return {
        "parameters": list(sig.inputs_to_parameters.values()),
        "buffers": [name for name in sig.inputs_to_buffers.values() if name in program.state_dict],
        "constants": [name for name, value in program.constants.items() if isinstance(value, torch.Tensor)],
    }
