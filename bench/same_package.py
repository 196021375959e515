"""Are two packages the same export? Compares the manifests (ignoring the
creation time, the output path and the command line that named it, and the
checksums of program files) and the bytes of every file the manifest lists.
Prints JSON; exit 0 when the same.

    python bench/same_package.py PKG_A PKG_B [--ignore-node-metadata]

With --ignore-node-metadata, programs whose graphs are equal once each
node's metadata is dropped count as the same, and are listed apart: that
metadata (`nn_module_stack` names the exporter's Python module of each
traced class) is never read when a package loads.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

VARIES = ("created_utc", "command")  # provenance entries that name the time or the output


def comparable(manifest: dict) -> dict:
    manifest = json.loads(json.dumps(manifest))
    provenance = manifest.get("provenance", {})
    for key in VARIES:
        provenance.pop(key, None)
    provenance.get("recipe", {}).pop("output", None)
    return manifest


def without_node_metadata(path: Path) -> dict:
    program = json.loads(gzip.decompress(path.read_bytes()))
    for node in program["graph_module"]["graph"]["nodes"]:
        node["metadata"] = {}
    return program


def differences(a: Path, b: Path, ignore_node_metadata: bool) -> tuple[list[str], list[str]]:
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    out, metadata_only = [], []
    ca, cb = comparable(ma), comparable(mb)
    for key in sorted(set(ca) | set(cb)):
        if key != "files" and ca.get(key) != cb.get(key):
            out.append(f"manifest.{key} differs")
    if set(ma.get("files", {})) != set(mb.get("files", {})):
        out.append("manifest.files: the packages list different files")
    for rel in sorted(set(ma.get("files", {})) & set(mb.get("files", {}))):
        if (a / rel).read_bytes() == (b / rel).read_bytes():
            continue
        if ignore_node_metadata and rel.endswith(".json.gz") and without_node_metadata(a / rel) == without_node_metadata(b / rel):
            metadata_only.append(rel)
        else:
            out.append(f"{rel}: bytes differ")
    return out, metadata_only


def main() -> int:
    a, b = Path(sys.argv[1]), Path(sys.argv[2])
    found, metadata_only = differences(a, b, "--ignore-node-metadata" in sys.argv[3:])
    result = {"a": str(a), "b": str(b), "same": not found, "differences": found, "node_metadata_only": metadata_only}
    print(json.dumps(result, indent=1))
    return 0 if not found else 1


if __name__ == "__main__":
    sys.exit(main())
