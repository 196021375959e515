"""ExportSpec: everything one export needs, built from defaults, a recipe in
configs/, CLI flags and `--set key=value` overrides (in that order of
precedence, last wins), and validated in one place."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvexport.contract import schemes
from kvexport.contract.errors import SpecError
from kvexport.contract.manifest import CONTRACTS, DEFAULT_BACKEND, DEVICES, DTYPES, INGRAPH_KV, OFFGRAPH_KV
from kvexport.exporter.memory import parse_size
from kvexport.partitioners.registry import backend_ids, get_backend

DEFAULT_FORWARD_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class ExportSpec:
    model: str = ""
    output: str = ""
    use_offgraph_kv_cache: bool = False
    contract: str = ""  # offgraph_kv (with the flag), else ingraph_kv unless hf_static is asked for
    forward_sizes: tuple[int, ...] = DEFAULT_FORWARD_SIZES
    max_step_tokens: int = 4096
    max_cells: int = 65536
    max_context_len: int = 0  # 0: the model's native context
    dtype: str = "fp32"
    qlinear: str = ""  # 8w | 4w | gguf | 8da4w
    qlinear_group_size: int = 0  # 0: 32 for the 4-bit schemes, per channel for 8w
    qlinear_algorithm: str = "minmax"  # minmax | hqq: how a group's scale and offset are chosen
    qlinear_keep_8w: str = ""  # 4w: comma-separated module patterns (or sensitive:FRACTION) kept at 8 bits
    qembedding: str = ""  # 8w
    qact: str = ""  # none | int8 | int8x2 | int16 | int8-peak: a packed linear's activations kept float, rounded to int8 per block of 32, that plus its rounding error rounded alike, rounded to int16 per block, or int8 plus that error on each row's peak blocks; "": each linear's by its codes' width (schemes.QACT_BY_BITS) where the backend has the kernels
    min_prefill_chunk: int = 1
    backend: str = DEFAULT_BACKEND
    device: str = "cpu"  # aoti: the device the methods are compiled for
    compile_workers: int = 0  # aoti: parallel compile processes (0: one per core, at most one per method)
    row_kernel: str = "auto"  # aoti on x86: fp32 and bf16 products over few rows on kvexport's kernel: auto (measured) | on | off
    packed_kernel: str = "on"  # aoti on x86: products by packed 4/8-bit weights over few rows on kvexport's kernel: on | off
    overwrite: bool = False
    verify: bool = True  # store reference tokens and check the package reproduces them before it is written
    verify_tokens: int = 8  # greedy tokens per probe
    max_memory: str = ""  # a budget for the export's private memory, e.g. "4GB": refused before any work when over
    # filled in by the CLI for provenance, not a recipe key
    command: list[str] = field(default_factory=list, metadata={"recipe": False})

    @classmethod
    def recipe_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("recipe", True)]

    def recipe(self) -> dict[str, Any]:
        """The effective recipe, as stored in the manifest."""
        out = {k: getattr(self, k) for k in self.recipe_keys()}
        out["forward_sizes"] = list(self.forward_sizes)
        return out

    def validate(self) -> "ExportSpec":
        if not self.model:
            raise SpecError("no model given: pass a model directory, a .gguf file, or a built-in name")
        if not self.output:
            raise SpecError("no output given: pass -o PKG")
        self.forward_sizes = parse_forward_sizes(self.forward_sizes)
        if self.use_offgraph_kv_cache:
            if self.contract not in ("", OFFGRAPH_KV):
                raise SpecError(f"usage: --use-offgraph-kv-cache exports the offgraph_kv contract; drop it to export --contract {self.contract}")
            self.contract = OFFGRAPH_KV
        elif not self.contract:
            self.contract = INGRAPH_KV
        if self.contract not in CONTRACTS:
            raise SpecError(f"--contract must be one of {', '.join(CONTRACTS)}, got {self.contract!r}")
        for key in ("max_step_tokens", "max_cells"):
            value = getattr(self, key)
            if not _is_int(value) or value <= 0:
                raise SpecError(f"--{_flag(key)} must be a positive integer, got {value!r}")
        if not _is_int(self.max_context_len) or self.max_context_len < 0:
            raise SpecError(f"--max-context-len must be >= 0 (0 keeps the model's), got {self.max_context_len!r}")
        widest = max(self.forward_sizes)
        if self.contract == OFFGRAPH_KV and self.max_step_tokens <= widest:
            raise SpecError(
                f"--max-step-tokens {self.max_step_tokens} must be wider than the widest forward size {widest} "
                f"(forward_others covers {widest + 1}..max-step-tokens)"
            )
        if self.contract == OFFGRAPH_KV and self.max_cells <= self.max_step_tokens:
            raise SpecError(
                f"--max-cells {self.max_cells} must be above --max-step-tokens {self.max_step_tokens} "
                f"(one cell is the scratch cell padding writes)"
            )
        if self.dtype not in DTYPES:
            raise SpecError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if (why := schemes.check(self.qlinear, self.qembedding, self.qlinear_group_size, self.qlinear_algorithm,
                                 self.qlinear_keep_8w, self.qact)) is not None:
            raise SpecError(why)
        group = self.qlinear_group_size
        if not _is_int(group) or group < 0 or (group and group & (group - 1)):
            raise SpecError(f"--qlinear-group-size must be a positive power of two, got {group!r}")
        chunk = self.min_prefill_chunk
        if not _is_int(chunk) or not 1 <= chunk <= self.max_step_tokens:
            raise SpecError(f"--min-prefill-chunk must be in 1..--max-step-tokens ({self.max_step_tokens}), got {chunk!r}")
        backend = get_backend(self.backend)
        if self.device not in DEVICES:
            raise SpecError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device not in backend.devices:
            able = [b for b in backend_ids() if self.device in get_backend(b).devices]
            raise SpecError(
                f"--device {self.device} is not one --backend {self.backend} compiles for ({', '.join(backend.devices)}); "
                f"backends for {self.device}: {', '.join(able) or 'none'}"
            )
        if not isinstance(self.verify, bool):
            raise SpecError(f"verify must be true or false, got {self.verify!r}")
        if not _is_int(self.verify_tokens) or not 1 <= self.verify_tokens <= 256:
            raise SpecError(f"--verify-tokens must be in 1..256, got {self.verify_tokens!r}")
        if self.max_memory:
            parse_size(self.max_memory)
        if not _is_int(self.compile_workers) or self.compile_workers < 0:
            raise SpecError(f"--compile-workers must be >= 0 (0: one per core), got {self.compile_workers!r}")
        for other in backend_ids():  # each backend checks the values of the options it owns, chosen or not
            get_backend(other).check_spec(self)
        return self


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(key: str) -> str:
    return key.replace("_", "-")


def parse_forward_sizes(value: Any) -> tuple[int, ...]:
    """'1,2,4' or [1, 2, 4] -> (1, 2, 4); rejects zero, negatives,
    duplicates and non-integers, naming the culprit."""
    items = value.split(",") if isinstance(value, str) else list(value)
    if not items or items == [""]:
        raise SpecError("--forward-sizes is empty; give sizes like 1,2,4,8")
    sizes = []
    for item in items:
        text = item.strip() if isinstance(item, str) else item
        try:
            if isinstance(text, bool):
                raise ValueError
            size = int(text) if isinstance(text, str) else text
            if not _is_int(size):
                raise ValueError
        except ValueError:
            raise SpecError(f"--forward-sizes: {item!r} is not an integer (expected e.g. 1,2,4,8)") from None
        if size <= 0:
            raise SpecError(f"--forward-sizes: {size} is not a positive size")
        if size in sizes:
            raise SpecError(f"--forward-sizes: {size} is listed twice")
        sizes.append(size)
    return tuple(sorted(sizes))


def find_recipe(name_or_path: str) -> Path:
    """A recipe by path, or by name among the recipes shipped in configs/."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = importlib.resources.files("kvexport.configs")
    for candidate in (name_or_path, f"{name_or_path}.toml", Path(name_or_path).name):
        entry = shipped / candidate
        if entry.is_file():
            return Path(str(entry))
    names = sorted(p.name for p in shipped.iterdir() if p.name.endswith(".toml"))
    raise SpecError(f"recipe {name_or_path!r} not found (shipped recipes: {', '.join(names) or 'none'})")


def load_recipe(name_or_path: str) -> dict[str, Any]:
    path = find_recipe(name_or_path)
    try:
        data = _parse_toml(path.read_text(), str(path))
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: not valid TOML ({e})") from e
    known = set(ExportSpec.recipe_keys())
    for key, value in data.items():
        if key not in known:
            raise SpecError(f"{path}: unknown key {key!r} (known keys: {', '.join(sorted(known))})")
        check_value(key, value, f"{path}: {key} = {_toml(value)}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """'key=value' with a TOML value; a bare word is taken as a string,
    which only a string key accepts."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise SpecError(f"--set {text!r:.100}: expected key=value")
    if key not in ExportSpec.recipe_keys():
        raise SpecError(f"--set {text!r:.100}: unknown key {key!r:.60} (known keys: {', '.join(sorted(ExportSpec.recipe_keys()))})")
    try:
        value = _parse_toml(f"v = {raw.strip()}", f"--set {key}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    check_value(key, value, f"--set {text:.100}")
    return key, value


def _parse_toml(text: str, where: str) -> dict[str, Any]:
    """tomllib recurses once per nesting level, so a value nested thousands
    deep exhausts the interpreter's stack: a clear error, not a crash."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise SpecError(f"{where}: nested too deep for a recipe value (a list of sizes nests once)") from None


# what a recipe value of each ExportSpec field type must be, and how to say so
_ACCEPTS: dict[Any, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (_is_int, "an integer"),
    str: (lambda v: isinstance(v, str), "a string"),
    tuple: (lambda v: isinstance(v, (str, list)), 'a list of sizes like [1, 2, 4] or a string like "1,2,4"'),
}


def check_value(key: str, value: Any, where: str) -> None:
    """A recipe or --set value must have its field's type: TOML true/false
    are the only booleans (a bare `no` is the string "no", which is truthy),
    and an integer is never a bool or a float."""
    hint = typing.get_type_hints(ExportSpec)[key]
    accepts, expected = _ACCEPTS[typing.get_origin(hint) or hint]
    if not accepts(value):
        raise SpecError(f"{where}: expected {expected}")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, (str, list)) else repr(value)


def build_spec(
    recipe: str | None = None,
    flags: dict[str, Any] | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    command: list[str] | None = None,
) -> ExportSpec:
    values: dict[str, Any] = {}
    if recipe:
        values.update(load_recipe(recipe))
    values.update(flags or {})
    for text in overrides:
        key, value = parse_override(text)
        values[key] = value
    spec = ExportSpec(**values, command=list(command or []))
    return spec.validate()  # parses forward_sizes, as every other value, in one place
