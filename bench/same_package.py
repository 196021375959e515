"""Are two packages the same export? Compares the manifests (ignoring the
creation time, the output path and the command line that named it) and the
bytes of every file the manifest lists. Prints JSON; exit 0 when the same.

    python bench/same_package.py PKG_A PKG_B
"""

from __future__ import annotations

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


def differences(a: Path, b: Path) -> list[str]:
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    out = []
    ca, cb = comparable(ma), comparable(mb)
    for key in sorted(set(ca) | set(cb)):
        if ca.get(key) != cb.get(key):
            out.append(f"manifest.{key} differs")
    for rel in sorted(set(ma.get("files", {})) | set(mb.get("files", {}))):
        if (a / rel).read_bytes() != (b / rel).read_bytes():
            out.append(f"{rel}: bytes differ")
    return out


def main() -> int:
    a, b = Path(sys.argv[1]), Path(sys.argv[2])
    found = differences(a, b)
    print(json.dumps({"a": str(a), "b": str(b), "same": not found, "differences": found}, indent=1))
    return 0 if not found else 1


if __name__ == "__main__":
    sys.exit(main())
