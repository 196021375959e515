"""What `kvexport inspect` shows: read from the manifest and file sizes only,
so no program is ever loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvexport.runtime.manifest import format_shape
from kvexport.runtime.package import PackageReader


def _io(specs: list[dict]) -> list[dict[str, Any]]:
    return [{"name": s.get("name"), "dtype": s.get("dtype"), "shape": s.get("shape"), "role": s.get("role")} for s in specs]


def describe(path: Path) -> dict[str, Any]:
    reader = PackageReader(path)
    m = reader.manifest
    files = m.get("files", {})
    weights_name = m.get("weights", {}).get("file")
    weights_bytes = files.get(weights_name, {}).get("bytes", 0)
    total = reader.total_bytes()
    return {
        "path": str(reader.path),
        "contract": m.get("contract"),
        "metadata": m.get("metadata", {}),
        "methods": {
            name: {
                "kind": entry.get("kind"),
                "inputs": _io(entry.get("inputs", [])),
                "outputs": _io(entry.get("outputs", [])),
                "step_width": entry.get("step_width"),
                "state": entry.get("state", []),
            }
            for name, entry in m.get("methods", {}).items()
        },
        "sizes": {
            "package_bytes": total,
            "weights_bytes": weights_bytes,
            "package_over_weights": round(total / weights_bytes, 4) if weights_bytes else None,
            "files": {rel: entry.get("bytes") for rel, entry in files.items()},
        },
        "tokenizer": m.get("tokenizer"),
        "backend": m.get("backend", {"id": "portable"}),
        "quantization": m.get("quantization"),
        "provenance": m.get("provenance", {}),
    }


def _method_order(name: str) -> tuple:
    if name.startswith("forward_") and name[8:].isdigit():
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
    return "\n".join(lines)
