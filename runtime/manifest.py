"""The package manifest: its schema, the I/O specs the contract fixes, and the
checks. This is the one home of the schema: the exporter builds specs with the
functions here, and the runtime and `validate` check packages with them.

A shape is a list whose entries are ints (static) or dicts
``{"name": str, "min": int, "max": int}`` (a dynamic dim; dims with the same
name are the same size within one call).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kvexport.runtime.errors import PackageError

FORMAT = "kvexport.package"
FORMAT_VERSION = 1
OFFGRAPH_KV = "offgraph_kv"
OFFGRAPH_KV_VERSION = 1
INGRAPH_KV = "ingraph_kv"  # docs/contracts/ingraph_kv-v1.md
INGRAPH_KV_VERSION = 1
HF_STATIC = "hf_static"  # docs/contracts/hf_static-v1.md
HF_STATIC_VERSION = 1
CONTRACTS = {OFFGRAPH_KV: OFFGRAPH_KV_VERSION, INGRAPH_KV: INGRAPH_KV_VERSION, HF_STATIC: HF_STATIC_VERSION}
LOGITS_MODE_SELECTED = 2
PUBLIC_STEP_WIDTH = "1:0"  # input_pos, dim 0
STATIC_FORWARD = re.compile(r"forward_([1-9][0-9]*)")
DTYPES = ("fp32", "bf16")
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def dyn(name: str, lo: int, hi: int) -> dict[str, Any]:
    return {"name": name, "min": lo, "max": hi}


def tensor_spec(name: str, dtype: str, shape: list, role: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": shape, "role": role, **extra}


@dataclass(frozen=True)
class CacheGeometry:
    kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    windows: tuple[int, ...]

    @property
    def n_layers(self) -> int:
        return len(self.kv_heads)

    @property
    def distinct_windows(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.windows)))


def forward_io(
    geometry: CacheGeometry,
    cache_dtype: str,
    vocab_size: int,
    max_cells: int,
    tokens_dim: int | dict,
    rows_dim: int | dict,
) -> tuple[list[dict], list[dict]]:
    """Inputs and outputs of one forward method, in the contract's order."""
    cells = dyn("C", 1, max_cells)
    inputs = [
        tensor_spec("tokens", "int64", [1, tokens_dim], "tokens"),
        tensor_spec("input_pos", "int64", [tokens_dim], "input_pos"),
        tensor_spec("logits_to_keep", "int64", [rows_dim], "logits_to_keep"),
    ]
    for layer, (heads, dim) in enumerate(zip(geometry.kv_heads, geometry.head_dims)):
        for kind in ("k", "v"):
            inputs.append(
                tensor_spec(f"kv.{layer}.{kind}", cache_dtype, [cells, heads, dim], f"kv_{kind}", layer=layer)
            )
    inputs.append(tensor_spec("kv.cells", "int64", [tokens_dim], "kv_cells"))
    for window in geometry.distinct_windows:
        inputs.append(tensor_spec(f"kv.mask.w{window}", "bool", [tokens_dim, cells], "kv_mask", window=window))
    outputs = [tensor_spec("logits", "float32", [rows_dim, vocab_size], "logits")]
    return inputs, outputs


def single_sequence_io(
    vocab_size: int, max_step: int, geometry: CacheGeometry | None = None, cache_dtype: str = "", cache_len: int = 0
) -> tuple[list[dict], list[dict]]:
    """ingraph_kv's forward (geometry None: the cache is inside the program)
    or hf_static's (the cache as inputs, HF's static layout)."""
    t = dyn("T", 1, max_step)
    inputs = [tensor_spec("tokens", "int64", [1, t], "tokens"), tensor_spec("input_pos", "int64", [t], "input_pos")]
    if geometry is not None:
        for layer, (heads, dim) in enumerate(zip(geometry.kv_heads, geometry.head_dims)):
            for kind in ("k", "v"):
                inputs.append(tensor_spec(f"kv.{layer}.{kind}", cache_dtype, [1, heads, cache_len, dim], f"kv_{kind}", layer=layer))
    return inputs, [tensor_spec("logits", "float32", [1, vocab_size], "logits")]


def sampler_io(vocab_size: int, with_params: bool) -> tuple[list[dict], list[dict]]:
    rows = dyn("R", 1, 1 << 16)
    inputs = [tensor_spec("logits", "float32", [rows, vocab_size], "logits")]
    if with_params:
        inputs.append(tensor_spec("params", "float32", [rows, 4], "sampling_params"))
    return inputs, [tensor_spec("tokens", "int64", [rows], "tokens")]


# --------------------------------------------------------------------------
# Checks. Each returns a list of violations, every one naming its key or method.


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) for v in value)


# Caps on what a manifest may declare, checked before the runtime allocates
# anything from it (a max cell count of 2**62 would allocate 16 bytes per
# cell of bookkeeping at load). Each is far above any model served today.
MAX_CELLS = 1 << 24
MAX_CONTEXT = 1 << 24
MAX_STEP_TOKENS = 1 << 20
MAX_VOCAB = 1 << 22
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_FORWARD_SIZES = 64


def _bounded(hi: int, lo: int = 1) -> tuple[str, Any]:
    return (f"int in {lo}..{hi}", lambda v: _is_int(v) and lo <= v <= hi)


def _bounded_list(hi: int, lo: int = 1, max_len: int = MAX_LAYERS) -> tuple[str, Any]:
    return (
        f"list of at most {max_len} ints in {lo}..{hi}",
        lambda v: _int_list(v) and len(v) <= max_len and all(lo <= x <= hi for x in v),
    )


_OFFGRAPH_METADATA_TYPES: dict[str, tuple[str, Any]] = {
    "get_max_context_len": _bounded(MAX_CONTEXT),
    "get_max_seq_len": _bounded(MAX_STEP_TOKENS),
    "get_vocab_size": _bounded(MAX_VOCAB),
    "get_logits_to_keep_mode": ("int", _is_int),
    "get_n_caches": _bounded(MAX_LAYERS),
    "get_kv_heads": _bounded_list(MAX_HEADS),
    "get_head_dims": _bounded_list(MAX_HEAD_DIM),
    "get_windows": _bounded_list(MAX_CONTEXT, lo=0),
    "get_offgraph_kv_max_cells": _bounded(MAX_CELLS),
    "bos_id": ("int or null", lambda v: v is None or _is_int(v)),
    "eos_ids": _bounded_list(MAX_VOCAB, lo=0),
    "dtype": (f"one of {', '.join(DTYPES)}", lambda v: v in DTYPES),
    "forward_sizes": _bounded_list(MAX_STEP_TOKENS, max_len=MAX_FORWARD_SIZES),
}


def check_envelope(manifest: Any) -> list[str]:
    if not isinstance(manifest, dict):
        return ["manifest: not a JSON object"]
    problems = []
    if manifest.get("format") != FORMAT:
        problems.append(f"format: expected {FORMAT!r}, found {manifest.get('format')!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        problems.append(
            f"format_version: this kvexport reads version {FORMAT_VERSION}, found {manifest.get('format_version')!r}"
        )
    contract = manifest.get("contract")
    if not (isinstance(contract, dict) and isinstance(contract.get("name"), str) and _is_int(contract.get("version"))):
        problems.append('contract: expected {"name": str, "version": int}')
    for key in ("metadata", "methods", "files"):
        if not isinstance(manifest.get(key), dict):
            problems.append(f"{key}: missing or not an object")
    return problems


def check_offgraph_metadata(metadata: dict) -> list[str]:
    problems = _check_types(metadata, _OFFGRAPH_METADATA_TYPES)
    chunk = metadata.get("get_min_prefill_chunk", 1)  # optional, default 1
    if not (_is_int(chunk) and chunk > 0):
        problems.append(f"metadata.get_min_prefill_chunk: expected positive int, found {chunk!r}")
    if problems:
        return problems
    n = metadata["get_n_caches"]
    for key in ("get_kv_heads", "get_head_dims", "get_windows"):
        if len(metadata[key]) != n:
            problems.append(f"metadata.{key}: has {len(metadata[key])} entries, get_n_caches is {n}")
    if metadata["get_logits_to_keep_mode"] != LOGITS_MODE_SELECTED:
        problems.append(
            f"metadata.get_logits_to_keep_mode: this contract selects rows (mode {LOGITS_MODE_SELECTED}), "
            f"found {metadata['get_logits_to_keep_mode']}"
        )
    sizes = metadata["forward_sizes"]
    if len(set(sizes)) != len(sizes):
        problems.append(f"metadata.forward_sizes: duplicates in {sizes}")
    max_seq = metadata["get_max_seq_len"]
    if metadata["get_offgraph_kv_max_cells"] <= max_seq:
        problems.append(
            f"metadata.get_offgraph_kv_max_cells: {metadata['get_offgraph_kv_max_cells']} must be above the widest "
            f"step get_max_seq_len={max_seq}"
        )
    if chunk > max_seq:
        problems.append(f"metadata.get_min_prefill_chunk: {chunk} exceeds get_max_seq_len={max_seq}")
    return problems


def _dim_ok(dim: Any) -> bool:
    if _is_int(dim):
        return dim >= 0
    return (
        isinstance(dim, dict)
        and isinstance(dim.get("name"), str)
        and _is_int(dim.get("min"))
        and _is_int(dim.get("max"))
        and 0 <= dim["min"] <= dim["max"]
    )


def _same_spec(found: dict, expected: dict) -> bool:
    keys = ("name", "dtype", "shape", "role")
    return all(found.get(k) == expected.get(k) for k in keys)


def check_offgraph_methods(manifest: dict) -> list[str]:
    """Method set and every method's I/O against the contract; assumes the
    metadata already passed check_offgraph_metadata."""
    metadata, methods = manifest["metadata"], manifest["methods"]
    problems: list[str] = []
    static = {}
    for name in methods:
        match = STATIC_FORWARD.fullmatch(name)
        if match:
            static[int(match.group(1))] = name
        elif name.startswith("forward_") and name != "forward_others":
            problems.append(f"methods.{name}: not a contract method name (forward_<N> with N > 0, or forward_others)")
        elif name not in ("forward_others", "sample", "sample_argmax"):
            problems.append(f"methods.{name}: unknown method")
    if not static:
        problems.append("methods: the contract needs at least one forward_<N>")
    if "sample_argmax" in methods and "sample" not in methods:
        problems.append("methods.sample_argmax: only allowed together with sample")
    if sorted(static) != sorted(metadata["forward_sizes"]):
        problems.append(f"metadata.forward_sizes: {metadata['forward_sizes']} does not match the methods {sorted(static)}")

    geometry = CacheGeometry(
        tuple(metadata["get_kv_heads"]), tuple(metadata["get_head_dims"]), tuple(metadata["get_windows"])
    )
    cache_dtype = TORCH_DTYPE_NAMES[metadata["dtype"]]
    vocab, max_cells = metadata["get_vocab_size"], metadata["get_offgraph_kv_max_cells"]
    widest = max(static) if static else 0
    for n, name in static.items():
        expected = forward_io(geometry, cache_dtype, vocab, max_cells, n, n)
        problems += _check_method(name, methods[name], "forward", expected)
    if "forward_others" in methods:
        entry = methods["forward_others"]
        try:
            t_dim = entry["inputs"][0]["shape"][1]
            k_dim = entry["inputs"][2]["shape"][0]
        except (KeyError, IndexError, TypeError):
            problems.append("methods.forward_others: inputs do not follow the contract (tokens, input_pos, logits_to_keep, ...)")
        else:
            if not (_dim_ok(t_dim) and isinstance(t_dim, dict)):
                problems.append("methods.forward_others: the token count T must be a dynamic dim")
            else:
                if t_dim["max"] <= widest:
                    problems.append(f"methods.forward_others: T up to {t_dim['max']} is not wider than forward_{widest}")
                if t_dim["min"] > widest + 1:
                    problems.append(
                        f"methods.forward_others: T from {t_dim['min']} leaves widths {widest + 1}..{t_dim['min'] - 1} "
                        f"that no method takes"
                    )
                if t_dim["max"] != metadata["get_max_seq_len"]:
                    problems.append(
                        f"metadata.get_max_seq_len: {metadata['get_max_seq_len']} but forward_others takes up to {t_dim['max']}"
                    )
                expected_k = dyn("K", metadata.get("get_min_prefill_chunk", 1), t_dim["max"])
                expected = forward_io(geometry, cache_dtype, vocab, max_cells, t_dim, expected_k)
                problems += _check_method("forward_others", entry, "forward", expected)
    elif static and metadata["get_max_seq_len"] != widest:
        problems.append(f"metadata.get_max_seq_len: {metadata['get_max_seq_len']} but the widest method takes {widest}")
    if "sample" in methods:
        problems += _check_method("sample", methods["sample"], "sampler", sampler_io(vocab, True))
    if "sample_argmax" in methods:
        problems += _check_method("sample_argmax", methods["sample_argmax"], "sampler", sampler_io(vocab, False))
    return problems


def _check_method(name: str, entry: Any, kind: str, expected: tuple[list, list]) -> list[str]:
    if not isinstance(entry, dict):
        return [f"methods.{name}: not an object"]
    problems = []
    if entry.get("kind") != kind:
        problems.append(f"methods.{name}.kind: expected {kind!r}, found {entry.get('kind')!r}")
    if not isinstance(entry.get("program"), str):
        problems.append(f"methods.{name}.program: missing")
    if kind == "forward" and not isinstance(entry.get("step_width"), str):
        problems.append(f"methods.{name}.step_width: missing")
    for side, want in zip(("inputs", "outputs"), expected):
        found = entry.get(side)
        if not isinstance(found, list):
            problems.append(f"methods.{name}.{side}: missing")
            continue
        if len(found) != len(want):
            problems.append(f"methods.{name}.{side}: {len(found)} entries, the contract needs {len(want)}")
            continue
        for i, (f, w) in enumerate(zip(found, want)):
            if not isinstance(f, dict) or not _same_spec(f, w):
                label = f.get("name") if isinstance(f, dict) else i
                problems.append(f"methods.{name}.{side}[{i}] ({label}): expected {_fmt(w)}, found {_fmt(f)}")
    return problems


def _fmt(spec: Any) -> str:
    if not isinstance(spec, dict):
        return repr(spec)
    return f"{spec.get('name')} {spec.get('dtype')} {format_shape(spec.get('shape'))}"


def format_shape(shape: Any) -> str:
    if not isinstance(shape, list):
        return repr(shape)
    parts = [str(d) if not isinstance(d, dict) else f"{d.get('name')}[{d.get('min')}..{d.get('max')}]" for d in shape]
    return "[" + ", ".join(parts) + "]"


_SINGLE_COMMON: dict[str, tuple[str, Any]] = {
    "get_max_seq_len": _bounded(MAX_STEP_TOKENS),
    "get_vocab_size": _bounded(MAX_VOCAB),
    "get_n_layers": _bounded(MAX_LAYERS),
    "get_bos_id": ("int or null", lambda v: v is None or _is_int(v)),
    "get_eos_ids": _bounded_list(MAX_VOCAB, lo=0),
    "dtype": (f"one of {', '.join(DTYPES)}", lambda v: v in DTYPES),
}
_INGRAPH_METADATA = {
    **_SINGLE_COMMON,
    "get_max_context_len": _bounded(MAX_CONTEXT),
    "use_kv_cache": ("true", lambda v: v is True),
    "enable_dynamic_shape": ("true", lambda v: v is True),
}
_HF_STATIC_METADATA = {
    **_SINGLE_COMMON,
    "get_max_cache_len": _bounded(MAX_CONTEXT),
    "get_kv_heads": _bounded_list(MAX_HEADS),
    "get_head_dims": _bounded_list(MAX_HEAD_DIM),
    "get_windows": _bounded_list(MAX_CONTEXT, lo=0),
}


def _check_types(metadata: dict, table: dict) -> list[str]:
    problems = []
    for key, (kind, ok) in table.items():
        if key not in metadata:
            problems.append(f"metadata.{key}: missing")
        elif not ok(metadata[key]):
            problems.append(f"metadata.{key}: expected {kind}, found {metadata[key]!r}")
    return problems


def _check_contract(manifest: Any, name: str) -> list[str]:
    problems = check_envelope(manifest)
    if problems:
        return problems
    contract = manifest["contract"]
    if contract["name"] != name:
        return [f"contract.name: expected {name!r}, found {contract['name']!r}"]
    if contract["version"] != CONTRACTS[name]:
        return [f"contract.version: {name} version {contract['version']} is not supported (this kvexport reads {CONTRACTS[name]})"]
    return []


def check_single_sequence_manifest(manifest: Any, name: str) -> list[str]:
    """ingraph_kv v1 or hf_static v1."""
    problems = _check_contract(manifest, name)
    if problems:
        return problems
    md = manifest["metadata"]
    problems = _check_types(md, _INGRAPH_METADATA if name == INGRAPH_KV else _HF_STATIC_METADATA)
    if problems:
        return problems
    context_key = "get_max_context_len" if name == INGRAPH_KV else "get_max_cache_len"
    if md["get_max_seq_len"] > md[context_key]:
        problems.append(f"metadata.get_max_seq_len: {md['get_max_seq_len']} exceeds {context_key}={md[context_key]}")
    geometry = None
    if name == HF_STATIC:
        for key in ("get_kv_heads", "get_head_dims", "get_windows"):
            if len(md[key]) != md["get_n_layers"]:
                problems.append(f"metadata.{key}: has {len(md[key])} entries, get_n_layers is {md['get_n_layers']}")
        if problems:
            return problems
        geometry = CacheGeometry(tuple(md["get_kv_heads"]), tuple(md["get_head_dims"]), tuple(md["get_windows"]))
    if set(manifest["methods"]) != {"forward"}:
        problems.append(f"methods: {name} has exactly one method, forward; found {sorted(manifest['methods'])}")
        return problems
    expected = single_sequence_io(md["get_vocab_size"], md["get_max_seq_len"], geometry, TORCH_DTYPE_NAMES[md["dtype"]], md.get("get_max_cache_len", 0))
    return (
        problems
        + _check_method("forward", manifest["methods"]["forward"], "forward", expected)
        + check_backend(manifest)
        + check_bindings(manifest)
    )


BACKENDS = ("portable", "aoti")


def check_backend(manifest: dict) -> list[str]:
    """The optional `backend` entry: which lowering made the programs and,
    for compiled ones, the target they need."""
    backend = manifest.get("backend", {"id": "portable"})
    if not isinstance(backend, dict) or backend.get("id") not in BACKENDS:
        return [f"backend: expected {{\"id\": one of {', '.join(BACKENDS)}}}, found {backend!r}"]
    if backend["id"] != "aoti":
        return [
            f"methods.{name}.compiled: only an aoti package holds compiled code (backend is {backend['id']!r})"
            for name, entry in manifest["methods"].items()
            if isinstance(entry, dict) and "compiled" in entry
        ]
    problems = []
    target = backend.get("target")
    if not isinstance(target, dict) or target.get("device") not in ("cpu", "cuda") or not isinstance(target.get("torch"), str):
        problems.append("backend.target: expected the compile target (device, torch, ...)")
    for name, entry in manifest["methods"].items():
        if isinstance(entry, dict) and not isinstance(entry.get("compiled"), str):
            problems.append(f"methods.{name}.compiled: an aoti package needs every method's compiled file")
    return problems


BINDING_KINDS = ("parameters", "buffers", "constants", "state")
STATE_DTYPES = ("float32", "bfloat16", "float16")
MAX_STATE_ELEMENTS = 1 << 36


def check_bindings(manifest: dict) -> list[str]:
    """Each method's tensor bindings (names into the weights file, or
    runtime state) and the state buffers the runtime allocates for it."""
    problems = []
    weights = manifest.get("weights", {})
    aliases = weights.get("aliases", {}) if isinstance(weights, dict) else None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        problems.append("weights.aliases: expected an object of tensor names")
    for name, entry in manifest["methods"].items():
        if not isinstance(entry, dict):
            continue  # named by the contract's method check
        names = entry.get("weights")
        if not isinstance(names, dict) or not all(
            isinstance(names.get(k), list) and all(isinstance(n, str) for n in names[k])
            for k in BINDING_KINDS
            if k in names or k != "state"  # the runtime reads the first three; state only where it allocates some
        ):
            problems.append(
                f"methods.{name}.weights: expected lists of tensor names ({', '.join(BINDING_KINDS[:3])}, and state if any)"
            )
            continue
        bound_state = set(names.get("state", []))
        for i, state in enumerate(entry.get("state", [])) if isinstance(entry.get("state", []), list) else [(0, None)]:
            if not (
                isinstance(state, dict)
                and state.get("name") in bound_state
                and state.get("dtype") in STATE_DTYPES
                and _int_list(state.get("shape"))
                and all(0 < d <= MAX_CONTEXT for d in state["shape"])
                and math.prod(state["shape"]) <= MAX_STATE_ELEMENTS
            ):
                problems.append(
                    f"methods.{name}.state[{i}]: expected a bound name, a dtype of {', '.join(STATE_DTYPES)} and a shape "
                    f"of positive ints (at most {MAX_STATE_ELEMENTS} elements), found {state!r:.200}"
                )
    return problems


def check_offgraph_manifest(manifest: Any) -> list[str]:
    problems = _check_contract(manifest, OFFGRAPH_KV)
    if problems:
        return problems
    problems = check_offgraph_metadata(manifest["metadata"])
    if problems:
        return problems
    return check_offgraph_methods(manifest) + check_backend(manifest) + check_bindings(manifest)


def check_manifest(manifest: Any) -> list[str]:
    """The checks of whichever contract the manifest declares."""
    problems = check_envelope(manifest)
    if problems:
        return problems
    name = manifest["contract"]["name"]
    if name == OFFGRAPH_KV:
        return check_offgraph_manifest(manifest)
    if name in (INGRAPH_KV, HF_STATIC):
        return check_single_sequence_manifest(manifest, name)
    return [f"contract.name: unknown contract {name!r} (known: {', '.join(CONTRACTS)})"]


def require(problems: list[str], what: str) -> None:
    if problems:
        listing = "\n  ".join(problems)
        raise PackageError(f"{what}:\n  {listing}")
