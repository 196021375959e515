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
from typing import Any, Callable

from kvexport.contract.errors import PackageError
from kvexport.contract.program_check import dotted_name

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
DEVICES = ("cpu", "cuda")
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

    @property
    def cell_values(self) -> int:
        """Values one cell holds over every layer's k and v pools."""
        return sum(2 * h * d for h, d in zip(self.kv_heads, self.head_dims))








# --------------------------------------------------------------------------
# Checks. Each returns a list of violations, every one naming its key or method.


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_list(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(v) for v in value)


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


def bounded(hi: int, lo: int = 1) -> tuple[str, Any]:
    return (f"int in {lo}..{hi}", lambda v: is_int(v) and lo <= v <= hi)


def bounded_list(hi: int, lo: int = 1, max_len: int = MAX_LAYERS) -> tuple[str, Any]:
    return (
        f"list of at most {max_len} ints in {lo}..{hi}",
        lambda v: int_list(v) and len(v) <= max_len and all(lo <= x <= hi for x in v),
    )




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
    if not (isinstance(contract, dict) and isinstance(contract.get("name"), str) and is_int(contract.get("version"))):
        problems.append('contract: expected {"name": str, "version": int}')
    for key in ("metadata", "methods", "files"):
        if not isinstance(manifest.get(key), dict):
            problems.append(f"{key}: missing or not an object")
    return problems






def same_spec(found: dict, expected: dict) -> bool:
    keys = ("name", "dtype", "shape", "role")
    return all(found.get(k) == expected.get(k) for k in keys)




def check_method(name: str, entry: Any, kind: str, expected: tuple[list, list]) -> list[str]:
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
            if not isinstance(f, dict) or not same_spec(f, w):
                label = f.get("name") if isinstance(f, dict) else i
                problems.append(f"methods.{name}.{side}[{i}] ({label}): expected {fmt_spec(w)}, found {fmt_spec(f)}")
    return problems


def fmt_spec(spec: Any) -> str:
    if not isinstance(spec, dict):
        return repr(spec)
    return f"{spec.get('name')} {spec.get('dtype')} {format_shape(spec.get('shape'))}"


def format_shape(shape: Any) -> str:
    if not isinstance(shape, list):
        return repr(shape)
    parts = [str(d) if not isinstance(d, dict) else f"{d.get('name')}[{d.get('min')}..{d.get('max')}]" for d in shape]
    return "[" + ", ".join(parts) + "]"




def check_types(metadata: dict, table: dict) -> list[str]:
    problems = []
    for key, (kind, ok) in table.items():
        if key not in metadata:
            problems.append(f"metadata.{key}: missing")
        elif not ok(metadata[key]):
            problems.append(f"metadata.{key}: expected {kind}, found {metadata[key]!r}")
    return problems






BACKEND_ID = re.compile(r"[a-z][a-z0-9_]{0,31}")
# the backend an export uses unless told otherwise, and the one that made a
# package without a backend entry (the first packages had none)
DEFAULT_BACKEND = "portable"


def check_contract(manifest: Any, name: str) -> list[str]:
    """The envelope, and the contract name and version a contract's check expects."""
    problems = check_envelope(manifest)
    if problems:
        return problems
    contract = manifest["contract"]
    if contract["name"] != name:
        return [f"contract.name: expected {name!r}, found {contract['name']!r}"]
    if contract["version"] != CONTRACTS[name]:
        return [f"contract.version: {name} version {contract['version']} is not supported (this kvexport reads {CONTRACTS[name]})"]
    return []


def compiled_target(manifest: dict) -> dict | None:
    """The target a package's native code was compiled for, or None for a
    package of stored programs alone. A backend that compiles declares it in
    its manifest entry (`backend.target`); the runtime loads such a package
    only when trusted, whatever the backend is called."""
    backend = manifest.get("backend")
    return backend.get("target") if isinstance(backend, dict) and "target" in backend else None


def check_backend(manifest: dict) -> list[str]:
    """The optional `backend` entry: which lowering made the programs and,
    for compiled ones, the target they need. A package holds compiled code
    exactly when its backend entry declares a target, and then every method
    has its compiled file."""
    backend = manifest.get("backend", {"id": DEFAULT_BACKEND})
    if not isinstance(backend, dict) or not (isinstance(backend.get("id"), str) and BACKEND_ID.fullmatch(backend["id"])):
        return [f"backend: expected {{\"id\": a backend name like portable or aoti}}, found {backend!r:.200}"]
    if compiled_target(manifest) is None:
        return [
            f"methods.{name}.compiled: only a package whose backend declares a compile target holds compiled code "
            f"(backend {backend['id']!r} declares none)"
            for name, entry in manifest["methods"].items()
            if isinstance(entry, dict) and "compiled" in entry
        ]
    problems = []
    target = backend["target"]
    if not isinstance(target, dict) or target.get("device") not in DEVICES or not isinstance(target.get("torch"), str):
        problems.append("backend.target: expected the compile target (device, torch, ...)")
    for name, entry in manifest["methods"].items():
        if isinstance(entry, dict) and not isinstance(entry.get("compiled"), str):
            problems.append(f"methods.{name}.compiled: a package with a compile target needs every method's compiled file")
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
    if not isinstance(aliases, dict) or not all(dotted_name(k) and dotted_name(v) for k, v in aliases.items()):
        problems.append("weights.aliases: expected an object of tensor names (dotted names like model.norm.weight)")
    for name, entry in manifest["methods"].items():
        if not isinstance(entry, dict):
            continue  # named by the contract's method check
        names = entry.get("weights")
        if not isinstance(names, dict) or not all(
            isinstance(names.get(k), list) and all(map(dotted_name, names[k]))
            for k in BINDING_KINDS
            if k in names or k != "state"  # the runtime reads the first three; state only where it allocates some
        ):
            problems.append(
                f"methods.{name}.weights: expected lists of tensor names ({', '.join(BINDING_KINDS[:3])}, and state if any), "
                "each a dotted name like model.norm.weight"
            )
            continue
        bound_state = set(names.get("state", []))
        for i, state in enumerate(entry.get("state", [])) if isinstance(entry.get("state", []), list) else [(0, None)]:
            if not (
                isinstance(state, dict)
                and state.get("name") in bound_state
                and state.get("dtype") in STATE_DTYPES
                and int_list(state.get("shape"))
                and all(0 < d <= MAX_CONTEXT for d in state["shape"])
                and math.prod(state["shape"]) <= MAX_STATE_ELEMENTS
            ):
                problems.append(
                    f"methods.{name}.state[{i}]: expected a bound name, a dtype of {', '.join(STATE_DTYPES)} and a shape "
                    f"of positive ints (at most {MAX_STATE_ELEMENTS} elements), found {state!r:.200}"
                )
    return problems




# ------------------------------------------------------------------ registry
ContractCheck = Callable[[dict], list]
_CHECKS: dict[tuple[str, int], ContractCheck] = {}


def register_contract(name: str, version: int, check: ContractCheck) -> None:
    """The one registry of contract checks: the exporter, `load` and
    `validate` all check a manifest with what is registered here."""
    key = (name, version)
    if key in _CHECKS and _CHECKS[key] is not check:
        raise ValueError(f"a check for {name} v{version} is already registered")
    _CHECKS[key] = check


def registered_contracts() -> list[tuple[str, int]]:
    return sorted(_CHECKS)


def contract_check(manifest: Any) -> ContractCheck:
    """The check of the contract the manifest declares; refuses a manifest
    without a valid envelope, or with a contract nobody registered."""
    require(check_envelope(manifest), "not a valid kvexport package")
    name, version = manifest["contract"]["name"], manifest["contract"]["version"]
    known = sorted({n for n, _ in _CHECKS})
    if name not in known:
        raise PackageError(f"contract.name: unknown contract {name!r}; this kvexport knows {', '.join(known)}")
    if (name, version) not in _CHECKS:
        versions = sorted(v for n, v in _CHECKS if n == name)
        raise PackageError(f"contract.version: {name} version {version} is not supported (supported: {versions})")
    return _CHECKS[(name, version)]


def check_manifest(manifest: Any) -> list[str]:
    """Every violation of the contract the manifest declares."""
    try:
        return contract_check(manifest)(manifest)
    except PackageError as e:
        return [str(e)]


def require(problems: list[str], what: str) -> None:
    if problems:
        listing = "\n  ".join(problems)
        raise PackageError(f"{what}:\n  {listing}")
