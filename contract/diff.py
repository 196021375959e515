"""What differs between two packages, for a CI job or a reviewer: the
contract, every method's I/O, step width and bindings, the metadata, the
compiled target, the quantization, the provenance, each weight tensor (name,
dtype, shape and a digest of its bytes) and every other file by digest.

Reads only the manifests and the bytes of the files: no program is rebuilt,
no native code is loaded, and every path stays inside its package.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvexport.contract.display import escape
from kvexport.contract.errors import PackageError
from kvexport.contract.package import PackageReader, sha256_file
from kvexport.contract.validate import weights_layout

MISSING = "(absent)"
# compared file by file below, or tensor by tensor
_BY_CONTENT = ("files",)


@dataclass(frozen=True)
class Difference:
    where: str  # a manifest path (methods.forward_8.step_width), weights/<tensor> or files/<path>
    a: Any
    b: Any


def diff_packages(a: Path, b: Path) -> list[Difference]:
    ra, rb = PackageReader(a), PackageReader(b)
    out: list[Difference] = []
    ma = {k: v for k, v in ra.manifest.items() if k not in _BY_CONTENT}
    mb = {k: v for k, v in rb.manifest.items() if k not in _BY_CONTENT}
    try:
        _walk("", ma, mb, out)
    except RecursionError:
        raise PackageError(f"{a} or {b}: a manifest nested deeper than any package's") from None
    out += _weights(ra, rb)
    out += _files(ra, rb)
    return out


def _walk(where: str, a: Any, b: Any, out: list[Difference]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            _walk(f"{where}.{key}" if where else str(key), a.get(key, MISSING), b.get(key, MISSING), out)
    elif a != b:
        out.append(Difference(where, a, b))


def _weights(ra: PackageReader, rb: PackageReader) -> list[Difference]:
    la, lb = _tensor_digests(ra), _tensor_digests(rb)
    return [Difference(f"weights/{name}", la.get(name, MISSING), lb.get(name, MISSING))
            for name in sorted(set(la) | set(lb)) if la.get(name) != lb.get(name)]


def _tensor_digests(reader: PackageReader) -> dict[str, str]:
    """tensor -> "dtype[shape] sha256:<first 16 hex digits of its bytes>"."""
    out = {}
    with open(reader.weights_path, "rb") as f:
        for name, (dtype, shape, (begin, end)) in sorted(weights_layout(reader).items(), key=lambda kv: kv[1][2]):
            f.seek(begin)
            digest, left = hashlib.sha256(), end - begin
            while left:
                chunk = f.read(min(left, 1 << 22))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
            out[name] = f"{dtype}{list(shape)} sha256:{digest.hexdigest()[:16]}"
    return out


def _files(ra: PackageReader, rb: PackageReader) -> list[Difference]:
    """Every file but the weights (compared by tensor) and the manifest, by
    the digest of its bytes as they are on disk."""
    skip = {ra.manifest.get("weights", {}).get("file"), rb.manifest.get("weights", {}).get("file")}
    fa, fb = _file_digests(ra, skip), _file_digests(rb, skip)
    return [Difference(f"files/{rel}", fa.get(rel, MISSING), fb.get(rel, MISSING))
            for rel in sorted(set(fa) | set(fb)) if fa.get(rel) != fb.get(rel)]


def _file_digests(reader: PackageReader, skip: set) -> dict[str, str]:
    files = reader.manifest.get("files", {})
    names = files if isinstance(files, dict) else {}
    return {rel: "sha256:" + sha256_file(reader.file(rel))[:16] for rel in names if rel not in skip}


def render(a: Path, b: Path, differences: list[Difference], limit: int = 200) -> str:
    if not differences:
        return escape(f"same: {a} and {b} hold the same contract, methods, metadata, weights and files")
    lines = [escape(f"{len(differences)} difference(s) between {a} (a) and {b} (b):")]
    for d in differences[:limit]:
        lines.append(f"  {escape(d.where)}: {_short(d.a)} -> {_short(d.b)}")
    if len(differences) > limit:
        lines.append(f"  ... {len(differences) - limit} more (--json lists them all)")
    return "\n".join(lines)


def _short(value: Any, width: int = 100) -> str:
    text = escape(value if isinstance(value, str) else repr(value))  # a package's string, shown
    return text if len(text) <= width else text[: width - 3] + "..."
