"""The manifest's top-level sections besides metadata and methods, as typed
objects: each serializes to the JSON the manifest holds and parses back from
it, naming every key it refuses. The exporter writes them with `to_json`,
and every contract's check reads them with `parse`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvexport.contract.manifest import is_int


class SectionError(ValueError):
    pass


def _need(ok: bool, where: str, what: str, value: Any) -> None:
    if not ok:
        raise SectionError(f"{where}: expected {what}, found {value!r:.120}")


@dataclass(frozen=True)
class ContractRef:
    name: str
    version: int

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version}

    @classmethod
    def parse(cls, value: Any) -> "ContractRef":
        _need(isinstance(value, dict) and isinstance(value.get("name"), str) and is_int(value.get("version")),
              "contract", '{"name": str, "version": int}', value)
        return cls(value["name"], value["version"])


@dataclass(frozen=True)
class WeightsSection:
    """The one weights file, how many tensors it holds, and the names bound
    to another stored tensor (tied weights are stored once)."""

    file: str
    tensors: int
    aliases: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"file": self.file, "tensors": self.tensors, "aliases": dict(self.aliases)}

    @classmethod
    def parse(cls, value: Any) -> "WeightsSection":
        _need(isinstance(value, dict), "weights", "an object", value)
        _need(isinstance(value.get("file"), str), "weights.file", "a file name", value.get("file"))
        _need(is_int(value.get("tensors")) and value["tensors"] >= 0, "weights.tensors", "a count", value.get("tensors"))
        aliases = value.get("aliases", {})
        _need(isinstance(aliases, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()),
              "weights.aliases", "an object of tensor names", aliases)
        return cls(value["file"], value["tensors"], aliases)


@dataclass(frozen=True)
class TokenizerSection:
    dir: str
    chat_template: bool

    def to_json(self) -> dict:
        return {"dir": self.dir, "chat_template": self.chat_template}

    @classmethod
    def parse(cls, value: Any) -> "TokenizerSection | None":
        if value is None:
            return None
        _need(isinstance(value, dict) and isinstance(value.get("dir"), str), "tokenizer", '{"dir": str, ...} or null', value)
        _need(isinstance(value.get("chat_template", False), bool), "tokenizer.chat_template", "true or false",
              value.get("chat_template"))
        return cls(value["dir"], value.get("chat_template", False))


@dataclass(frozen=True)
class BackendSection:
    """Which lowering made the programs; `extra` holds what the backend adds
    (aoti: the compile target)."""

    id: str
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"id": self.id, **self.extra}

    @classmethod
    def parse(cls, value: Any) -> "BackendSection":
        _need(isinstance(value, dict) and isinstance(value.get("id"), str), "backend", '{"id": str, ...}', value)
        return cls(value["id"], {k: v for k, v in value.items() if k != "id"})


@dataclass(frozen=True)
class QuantizationSection:
    qlinear: str | None
    qlinear_group_size: int | None
    qembedding: str | None
    coverage: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"qlinear": self.qlinear, "qlinear_group_size": self.qlinear_group_size,
                "qembedding": self.qembedding, "coverage": list(self.coverage)}

    @classmethod
    def parse(cls, value: Any) -> "QuantizationSection | None":
        if value is None:
            return None
        _need(isinstance(value, dict), "quantization", "an object", value)
        for key in ("qlinear", "qembedding"):
            _need(value.get(key) is None or isinstance(value[key], str), f"quantization.{key}", "a scheme or null", value.get(key))
        group = value.get("qlinear_group_size")
        _need(group is None or (is_int(group) and group > 0), "quantization.qlinear_group_size", "a size or null", group)
        coverage = value.get("coverage", [])
        _need(isinstance(coverage, list) and all(isinstance(row, dict) for row in coverage),
              "quantization.coverage", "a list of rows", coverage)
        return cls(value.get("qlinear"), group, value.get("qembedding"), coverage)


SECTIONS = {
    "contract": ContractRef.parse,
    "weights": WeightsSection.parse,
    "tokenizer": TokenizerSection.parse,
    "backend": BackendSection.parse,
    "quantization": QuantizationSection.parse,
}


def check_sections(manifest: dict) -> list[str]:
    """Every present section parses; `provenance` is an object when present."""
    problems = []
    for key, parse in SECTIONS.items():
        if key in manifest:
            try:
                parse(manifest[key])
            except SectionError as e:
                problems.append(str(e))
    if not isinstance(manifest.get("provenance", {}), dict):
        problems.append("provenance: expected an object")
    return problems
