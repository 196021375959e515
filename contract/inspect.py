"""What `kvexport inspect` shows: read from the manifest and file sizes only,
so no program is ever loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvexport.contract import manifest as mf
from kvexport.contract import schemes
from kvexport.contract.display import escape
from kvexport.contract.errors import PackageError
from kvexport.contract.manifest import format_shape
from kvexport.contract.package import WEIGHTS, PackageReader


def _get(container: dict, key: str, kind: type, default: Any, where: str) -> Any:
    """container[key], which must be a `kind` (never a bool) when present;
    JSON null reads as absent. A package is untrusted: anything else is
    refused with the key named, not shown half-rendered."""
    value = container.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool):
        raise PackageError(f"{where}{key}: expected {kind.__name__}, found {value!r:.80}")
    return value


def _io(specs: list, where: str) -> list[dict[str, Any]]:
    out = []
    for i, s in enumerate(specs):
        if not isinstance(s, dict):
            raise PackageError(f"{where}[{i}]: expected an object, found {s!r:.80}")
        out.append({"name": s.get("name"), "dtype": s.get("dtype"), "shape": s.get("shape"), "role": s.get("role")})
    return out


def _method(name: str, entry: Any) -> dict[str, Any]:
    where = f"methods.{name}."
    if not isinstance(entry, dict):
        raise PackageError(f"methods.{name}: expected an object, found {entry!r:.80}")
    return {
        "kind": entry.get("kind"),
        "inputs": _io(_get(entry, "inputs", list, [], where), where + "inputs"),
        "outputs": _io(_get(entry, "outputs", list, [], where), where + "outputs"),
        "step_width": entry.get("step_width"),
        "state": _io(_get(entry, "state", list, [], where), where + "state"),
    }


def _provenance(m: dict) -> dict[str, Any]:
    prov = _get(m, "provenance", dict, {}, "")
    source = _get(prov, "source", dict, {}, "provenance.")
    files = _get(source, "files", dict, {}, "provenance.source.")
    for name, digest in files.items():
        if not isinstance(digest, str):
            raise PackageError(f"provenance.source.files.{name}: expected a sha256 string, found {digest!r:.80}")
    command = _get(prov, "command", list, [], "provenance.")
    if not all(isinstance(arg, str) for arg in command):
        raise PackageError("provenance.command: expected a list of strings")
    tools = _get(prov, "tools", dict, {}, "provenance.")
    return {**prov, "source": {**source, "files": files}, "command": command, "tools": tools}


def _quantization(m: dict) -> dict[str, Any] | None:
    quant = _get(m, "quantization", dict, None, "")
    if quant is None:
        return None
    coverage = _get(quant, "coverage", list, [], "quantization.")
    if not all(isinstance(r, dict) for r in coverage):
        raise PackageError("quantization.coverage: expected a list of objects")
    return {**quant, "coverage": coverage}


def describe(path: Path) -> dict[str, Any]:
    reader = PackageReader(path)
    m = reader.manifest
    mf.require(mf.check_envelope(m), f"{reader.path}: not a kvexport package")
    files = m["files"]
    sizes = {}
    for rel, entry in files.items():
        size = _get(entry, "bytes", int, None, f"files.{rel}.") if isinstance(entry, dict) else None
        if size is not None and not 0 <= size < 1 << 63:
            raise PackageError(f"files.{rel}.bytes: {str(size)[:40]} is not a file size")
        sizes[rel] = size
    weights_name = _get(_get(m, "weights", dict, {}, ""), "file", str, WEIGHTS, "weights.")
    weights_bytes = sizes.get(weights_name) or 0
    total = reader.total_bytes()
    backend = _get(m, "backend", dict, {"id": mf.DEFAULT_BACKEND}, "")
    backend = {**backend, "target": _get(backend, "target", dict, None, "backend.")}
    return {
        "path": str(reader.path),
        "contract": m["contract"],
        "metadata": m["metadata"],
        "methods": {name: _method(name, entry) for name, entry in m["methods"].items()},
        "sizes": {
            "package_bytes": total,
            "weights_bytes": weights_bytes,
            "package_over_weights": round(total / weights_bytes, 4) if weights_bytes > 0 else None,
            "files": sizes,
        },
        "tokenizer": _get(m, "tokenizer", dict, None, ""),
        "backend": backend,
        "quantization": _quantization(m),
        "provenance": _provenance(m),
    }


def _method_order(name: str) -> tuple:
    if name.startswith("forward_") and name[8:].isascii() and name[8:].isdigit():
        return (0, int(name[8:]))
    return (1 if name == "forward_others" else 2, name)


def render(info: dict[str, Any]) -> str:
    lines = []
    contract = info["contract"] or {}
    sizes = info["sizes"]
    ratio = sizes["package_over_weights"]
    lines.append(
        f"{info['path']}: {contract.get('name')} v{contract.get('version')}, {len(info['methods'])} methods, "
        f"{sizes['package_bytes'] / 1e6:.1f} MB ({ratio} x the weights' {sizes['weights_bytes'] / 1e6:.1f} MB)"
    )
    backend = info.get("backend") or {}
    target = backend.get("target")
    lines.append(f"backend: {backend.get('id')}" + (f" (compiled for {', '.join(f'{k} {v}' for k, v in sorted(target.items()))})" if target else ""))
    lines.append("methods:")
    state_note = None
    for name in sorted(info["methods"], key=_method_order):
        entry = info["methods"][name]
        public = [s for s in entry["inputs"] if not str(s["role"]).startswith("kv_")]
        state = [s for s in entry["inputs"] if str(s["role"]).startswith("kv_")]
        ins = ", ".join(f"{s['name']} {format_shape(s['shape'])}" for s in public)
        outs = ", ".join(f"{s['name']} {s['dtype']} {format_shape(s['shape'])}" for s in entry["outputs"])
        extra = f"  step_width {entry['step_width']}" if entry.get("step_width") else ""
        lines.append(f"  {name:15} ({ins}) -> {outs}{extra}")
        if state and state_note is None:
            pools = [s for s in state if s["role"] in ("kv_k", "kv_v")]
            rest = [s for s in state if s["role"] not in ("kv_k", "kv_v")]
            state_note = (
                f"  + state: {len(pools)} pools like {pools[0]['name']} {pools[0]['dtype']} {format_shape(pools[0]['shape'])}"
                if pools
                else "  + state:"
            ) + "".join(f", {s['name']} {s['dtype']} {format_shape(s['shape'])}" for s in rest)
    if state_note:
        lines.append(state_note)
    for name, entry in info["methods"].items():
        buffers = entry.get("state") or []
        if buffers:
            first = buffers[0]
            lines.append(
                f"  + {name} keeps its cache in {len(buffers)} buffers like {first['name']} {first['dtype']} "
                f"{format_shape(first['shape'])}, allocated by the runtime (no cache byte in the package)"
            )
    quant = info.get("quantization")
    if quant:
        rows = quant.get("coverage", [])
        done = sum(1 for r in rows if r.get("scheme"))
        lines.append(f"quantization: qlinear {quant.get('qlinear')}, group {quant.get('qlinear_group_size') or 'default'}, "
                     f"qembedding {quant.get('qembedding')}: {done} of {len(rows)} linears and embeddings quantized")
        int8 = [r for r in rows if isinstance(r.get("activations"), str)]
        if int8:
            taking = sum(1 for r in int8 if r["activations"] in schemes.ROUNDED)
            named = schemes.rounding_named([r["activations"] for r in int8])
            how = f"--qact {named}" if named in schemes.QACT else "each by its codes' width"
            lines.append(f"  {named} activations on {taking} of {len(int8)} quantized linears ({how})")
        for r in rows:
            if not r.get("scheme"):
                lines.append(f"  skipped {r.get('module')}: {r.get('skipped')}")
            elif r.get("shared_with"):
                lines.append(f"  {r.get('module')} shares the int8 per-row weight of {r['shared_with']} (tied)")
    lines.append("metadata:")
    for key, value in sorted(info["metadata"].items()):
        lines.append(f"  {key:28} {value}")
    tok = info.get("tokenizer")
    lines.append(f"tokenizer: {'yes' + (', chat template' if tok.get('chat_template') else '') if tok else 'none (token ids only)'}")
    prov = info["provenance"]
    source = prov.get("source", {})
    lines.append("provenance:")
    lines.append(f"  source: {source.get('builtin') or source.get('gguf') or source.get('path')}")
    for name, digest in sorted(source.get("files", {}).items()):
        lines.append(f"    {name}  sha256 {digest[:16]}...")
    tools = prov.get("tools", {})
    lines.append("  tools: " + ", ".join(f"{k} {v}" for k, v in sorted(tools.items())))
    if prov.get("command"):
        lines.append(f"  command: {' '.join(prov['command'])}")
    if prov.get("created_utc"):
        lines.append(f"  created: {prov['created_utc']}")
    return "\n".join(map(escape, lines))  # every line shows package strings
