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

import types
import typing

import torch
from torch._export.serde import serialize as serde

from kvexport.runtime.errors import PackageError


def graph_to_json(program: torch.export.ExportedProgram) -> bytes:
    """The program's graph, signature and shape constraints; no tensors.
    Stack traces are dropped: they hold the export machine's paths and make
    the bytes depend on where the export ran."""
    for node in program.graph_module.graph.nodes:
        node.meta.pop("stack_trace", None)
    # torch 2.13's serializer calls canonicalize() only to test that a
    # canonical form exists and drops the result; its deep copies are two
    # thirds of the serializing time of a 30-layer graph.
    original = serde.canonicalize
    serde.canonicalize = _skip_canonical_check
    try:
        artifact = serde.serialize(
            program,
            serialize_state_dict=False,
            serialize_constants=False,
            serialize_example_inputs=False,
        )
    finally:
        serde.canonicalize = original
    return artifact.exported_program


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
    graph_json: bytes,
    state_dict: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
) -> torch.export.ExportedProgram:
    """Rebuilds a program around tensors the caller owns (they are bound, not
    copied). Passing dicts keeps the serializer from ever calling torch.load."""
    _cache_serde_type_hints()
    try:
        return serde.deserialize(serde.SerializedArtifact(graph_json, state_dict, constants, b""))
    except Exception as e:  # the serializer raises many types; name the cause
        raise PackageError(
            f"cannot rebuild an exported program with torch {torch.__version__} ({type(e).__name__}: {e})"
        ) from e


def placeholder_names(program: torch.export.ExportedProgram) -> dict[str, list[str]]:
    """The tensor names the program's signature binds, by kind: parameters,
    buffers (persistent ones, in the state dict) and constants."""
    sig = program.graph_signature
    return {
        "parameters": list(sig.inputs_to_parameters.values()),
        "buffers": [name for name in sig.inputs_to_buffers.values() if name in program.state_dict],
        "constants": [name for name, value in program.constants.items() if isinstance(value, torch.Tensor)],
    }
