"""The manifest's top-level sections besides metadata and methods, as typed
objects: each serializes to the JSON the manifest holds and parses back from
it, naming every key it refuses. The exporter writes them with `to_json`,
and every contract's check reads them with `parse`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvexport.contract import schemes
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
        for key, names in (("qlinear", schemes.QLINEAR), ("qembedding", schemes.QEMBEDDING)):
            _need(value.get(key) is None or value[key] in names, f"quantization.{key}", f"one of {', '.join(names)} or null",
                  value.get(key))
        group = value.get("qlinear_group_size")
        _need(group is None or (is_int(group) and group > 0), "quantization.qlinear_group_size", "a size or null", group)
        coverage = value.get("coverage", [])
        _need(isinstance(coverage, list) and all(isinstance(row, dict) for row in coverage),
              "quantization.coverage", "a list of rows", coverage)
        return cls(value.get("qlinear"), group, value.get("qembedding"), coverage)


MAX_PROBES, MAX_STEPS, MAX_PROMPT = 16, 1024, 65536


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


@dataclass(frozen=True)
class ReferenceSection:
    """Greedy tokens of the source model on probe prompts (exporter/golden.py),
    which the package must reproduce alone and batched (runtime/verify.py).
    Each probe: name, prompt ids, `steps` greedy tokens, the reference's
    top-2 logit margin at each step, and the first step's best logits as
    [id, logit] pairs. `batch` names the probes run together."""

    steps: int
    tie_margin: float
    logits_atol: float
    logits_rtol: float
    probes: list = field(default_factory=list)
    batch: list = field(default_factory=list)
    fp32_agreement: float | None = None

    def to_json(self) -> dict:
        out = {"steps": self.steps, "tie_margin": self.tie_margin, "logits_atol": self.logits_atol,
               "logits_rtol": self.logits_rtol, "probes": list(self.probes), "batch": list(self.batch)}
        if self.fp32_agreement is not None:
            out["fp32_agreement"] = self.fp32_agreement
        return out

    @classmethod
    def parse(cls, value: Any) -> "ReferenceSection | None":
        if value is None:
            return None
        _need(isinstance(value, dict), "reference", "an object", value)
        steps = value.get("steps")
        _need(is_int(steps) and 1 <= steps <= MAX_STEPS, "reference.steps", f"an int in 1..{MAX_STEPS}", steps)
        for key in ("tie_margin", "logits_atol", "logits_rtol"):
            _need(_number(value.get(key)) and value[key] >= 0, f"reference.{key}", "a number >= 0", value.get(key))
        probes = value.get("probes")
        _need(isinstance(probes, list) and 1 <= len(probes) <= MAX_PROBES, "reference.probes", f"a list of 1..{MAX_PROBES} probes", probes)
        names = []
        for i, probe in enumerate(probes):
            where = f"reference.probes[{i}]"
            _need(isinstance(probe, dict), where, "an object", probe)
            name = probe.get("name")
            _need(isinstance(name, str) and 0 < len(name) <= 64 and name not in names, f"{where}.name", "a new name", name)
            names.append(name)
            prompt, tokens, margins, top = (probe.get(k) for k in ("prompt", "tokens", "margins", "top"))
            _need(isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPT and all(is_int(t) and t >= 0 for t in prompt),
                  f"{where}.prompt", "token ids", prompt)
            _need(isinstance(tokens, list) and len(tokens) == steps and all(is_int(t) and t >= 0 for t in tokens),
                  f"{where}.tokens", f"{steps} token ids", tokens)
            _need(isinstance(margins, list) and len(margins) == steps and all(_number(m) and m >= 0 for m in margins),
                  f"{where}.margins", f"{steps} numbers >= 0", margins)
            _need(isinstance(top, list) and 0 < len(top) <= 16 and all(
                isinstance(pair, list) and len(pair) == 2 and is_int(pair[0]) and pair[0] >= 0 and _number(pair[1]) for pair in top),
                f"{where}.top", "[id, logit] pairs", top)
        batch = value.get("batch", [])
        _need(isinstance(batch, list) and all(b in names for b in batch) and len(set(batch)) == len(batch),
              "reference.batch", "names of probes", batch)
        agreement = value.get("fp32_agreement")
        _need(agreement is None or (_number(agreement) and 0 <= agreement <= 1), "reference.fp32_agreement", "a share in 0..1", agreement)
        return cls(steps, value["tie_margin"], value["logits_atol"], value["logits_rtol"], probes, batch, agreement)


SECTIONS = {
    "contract": ContractRef.parse,
    "weights": WeightsSection.parse,
    "tokenizer": TokenizerSection.parse,
    "backend": BackendSection.parse,
    "quantization": QuantizationSection.parse,
    "reference": ReferenceSection.parse,
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
