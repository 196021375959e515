"""The package's file layout. PackageWriter and PackageReader are the only code
that knows where things live inside a package directory:

    manifest.json               sorted JSON, readable without torch
    weights.safetensors         every tensor the programs need, once
    programs/<method>.json.gz   torch.export graphs without weights
    programs/<method>.aoti.pt2  AOTInductor-compiled methods (aoti backend), no weights
    tokenizer/                  tokenizer files and chat template, if any
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from kvexport.runtime.errors import ExportError, PackageError

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
PROGRAMS_DIR = "programs"
TOKENIZER_DIR = "tokenizer"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def program_path(method: str, compiled: bool = False) -> str:
    return f"{PROGRAMS_DIR}/{method}.aoti.pt2" if compiled else f"{PROGRAMS_DIR}/{method}.json.gz"


def dump_manifest(manifest: dict) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


class PackageWriter:
    """Builds a package in a hidden sibling directory; `commit` moves it into
    place with one rename, so PKG never holds half a package. Use as a context
    manager: leaving the block by an exception (Ctrl-C included) removes the
    partial directory."""

    def __init__(self, target: Path, overwrite: bool = False):
        self.target = Path(target).absolute()
        if self.target.exists() and not overwrite:
            raise ExportError(f"{self.target} already exists; remove it or pass --overwrite")
        if self.target.exists() and not _replaceable(self.target):
            raise ExportError(
                f"{self.target} is not a kvexport package (no kvexport manifest.json); --overwrite only replaces packages"
            )
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.partial-", dir=self.target.parent))
        (self.root / PROGRAMS_DIR).mkdir()
        self.committed = False

    def __enter__(self) -> "PackageWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.committed:
            shutil.rmtree(self.root, ignore_errors=True)

    @property
    def weights_path(self) -> Path:
        return self.root / WEIGHTS

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / TOKENIZER_DIR

    def write_program(self, method: str, graph_json: bytes) -> str:
        rel = program_path(method)
        # mtime=0: the same graph gives the same bytes.
        with open(self.root / rel, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write(graph_json)
        return rel

    def files(self) -> Iterator[Path]:
        for path in sorted(self.root.rglob("*")):
            if path.is_file() and path.name != MANIFEST:
                yield path

    def commit(self, manifest: dict) -> None:
        manifest = dict(manifest)
        manifest["files"] = {
            p.relative_to(self.root).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in self.files()
        }
        (self.root / MANIFEST).write_text(dump_manifest(manifest))
        _apply_umask(self.root)
        backup = None
        if self.target.exists():
            backup = self.target.with_name(f".{self.target.name}.old-{os.getpid()}")
            os.rename(self.target, backup)
        try:
            os.rename(self.root, self.target)
        except BaseException:
            if backup is not None:
                os.rename(backup, self.target)  # put the old package back
            raise
        self.committed = True
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)


def _replaceable(path: Path) -> bool:
    """An empty directory, or a kvexport package."""
    if path.is_dir() and not any(path.iterdir()):
        return True
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == "kvexport.package"
    except (OSError, ValueError, AttributeError):
        return False


def _apply_umask(root: Path) -> None:
    """mkdtemp makes a private directory; give the package the modes any
    other file the user writes gets."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for path in root.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


class PackageReader:
    """Reads a package directory. Never unpickles anything."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_dir():
            raise PackageError(f"{self.path}: no such package directory")
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise PackageError(f"{self.path}: not a kvexport package ({MANIFEST} is missing)")
        try:
            self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PackageError(f"{manifest_path}: not valid JSON ({e})") from e

    def file(self, rel: str) -> Path:
        return self.path / rel

    def referenced_files(self) -> list[str]:
        """Every file the manifest points at (weights, programs, compiled)."""
        refs = [self.manifest.get("weights", {}).get("file", WEIGHTS)]
        for entry in self.manifest.get("methods", {}).values():
            if isinstance(entry, dict):
                refs += [entry[k] for k in ("program", "compiled") if isinstance(entry.get(k), str)]
        return refs

    def verify_checksums(self, only: list[str] | None = None) -> list[str]:
        """Compares files against the manifest; returns the mismatches. A
        file the manifest points at must be listed (and so checked)."""
        files = self.manifest.get("files")
        if not isinstance(files, dict):
            return ["files: missing from the manifest"]
        problems = [f"files.{rel}: the manifest uses it but lists no checksum for it" for rel in self.referenced_files() if rel not in files]
        for rel, entry in sorted(files.items()):
            if only is not None and rel not in only:
                continue
            path = self.path / rel
            if not path.is_file():
                problems.append(f"files.{rel}: missing from the package")
            elif not isinstance(entry, dict) or path.stat().st_size != entry.get("bytes"):
                problems.append(f"files.{rel}: size differs from the manifest")
            elif sha256_file(path) != entry.get("sha256"):
                problems.append(f"files.{rel}: checksum differs from the manifest")
        listed = set(files)
        for path in self.path.rglob("*"):
            rel = path.relative_to(self.path).as_posix()
            if path.is_file() and rel != MANIFEST and rel not in listed:
                problems.append(f"files.{rel}: in the package but not in the manifest")
        return problems

    def program_json(self, method: str) -> bytes:
        rel = self.manifest["methods"][method]["program"]
        with gzip.open(self.path / rel, "rb") as f:
            return f.read()

    @property
    def weights_path(self) -> Path:
        return self.path / self.manifest.get("weights", {}).get("file", WEIGHTS)

    @property
    def tokenizer_dir(self) -> Path | None:
        tok = self.manifest.get("tokenizer")
        return self.path / tok["dir"] if tok else None

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
