"""The package's file layout. PackageWriter and PackageReader are the only code
that knows where things live inside a package directory:

    manifest.json               sorted JSON, readable without torch
    weights.safetensors         every tensor the programs need, once
    programs/<method>.json.gz   torch.export graphs without weights
    programs/<method>.aoti.pt2  AOTInductor-compiled methods (aoti backend), no weights
    tokenizer/                  tokenizer files and chat template, if any
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from kvexport.contract.confined_io import (  # noqa: F401  (sha256_file, confined_problem: others import them from here)
    MAX_PROGRAM_BYTES, available_memory, confined_problem, inflate_program, map_fd, open_inside, open_problem,
    others_can_write, read_fd, read_private, resolves_inside,
    sha256_buffer, sha256_fd, sha256_file,
)
from kvexport.contract.errors import ExportError, PackageError

MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
# how a runtime may hold the weights file: a private mapping of it, a copy in
# private memory, or the copy where it takes at most AUTO_PRIVATE_SHARE of the
# memory available and the mapping otherwise (PackageReader.map_file's `hold`;
# runtime.load's `weights`)
WEIGHTS_MEMORY = ("mapped", "private", "auto")
AUTO_PRIVATE_SHARE = 0.5  # the rest is left to the KV pools, the activations and other processes
PROGRAMS_DIR = "programs"
TOKENIZER_DIR = "tokenizer"

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """kvexport's cache: KVEXPORT_CACHE_DIR, else $XDG_CACHE_HOME/kvexport or ~/.cache/kvexport."""
    root = os.environ.get("KVEXPORT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvexport"
    )
    return Path(root)


def program_path(method: str, compiled: bool = False) -> str:
    return f"{PROGRAMS_DIR}/{method}.aoti.pt2" if compiled else f"{PROGRAMS_DIR}/{method}.json.gz"


def dump_manifest(manifest: dict) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


class PackageWriter:
    """Builds a package in a hidden sibling directory, `.PKG.partial-PID-*`;
    `commit` moves it into place with one rename, so PKG never holds half a
    package. Use as a context manager: leaving the block by an exception
    (Ctrl-C included) removes the partial directory. A writer killed outright
    leaves it behind; the next writer to the same PKG removes it."""

    def __init__(self, target: Path, overwrite: bool = False):
        self.target = Path(target).absolute()
        self.overwrite = overwrite
        check_output(self.target, overwrite)
        _make_parent(self.target)
        remove_stale(self.target)
        try:
            self.root = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.partial-{os.getpid()}-", dir=self.target.parent))
        except OSError as e:
            raise _unwritable(self.target, e) from None
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

    def commit(self, manifest: dict, check: Callable[[Path], None] | None = None) -> None:
        """Writes the manifest, runs `check` on the finished package while it
        is still the partial directory (it raises to refuse it: nothing is
        placed), then places it with one rename."""
        manifest = dict(manifest)
        _apply_umask(self.root)
        manifest["files"] = {
            p.relative_to(self.root).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in self.files()
        }
        (self.root / MANIFEST).write_text(dump_manifest(manifest))  # created with the umask's mode
        if check is not None:
            check(self.root)
        if self.overwrite:
            self._replace()
        else:
            self._place()
        self.committed = True

    def _place(self) -> None:
        """Without --overwrite nothing is moved aside: a rename onto a
        non-empty directory fails atomically, so of two exports racing to one
        new PKG exactly one wins and the other fails with nothing lost."""
        try:
            os.rename(self.root, self.target)
        except OSError as e:
            if e.errno in _TAKEN:
                raise _raced(self.target) from None
            raise _unwritable(self.target, e) from None

    def _replace(self) -> None:
        """Moves the old package aside, renames the new one in, then removes
        the old one; what is at PKG is checked again, since another export
        may have written it since the writer was created."""
        check_output(self.target, overwrite=True)
        backup = None
        if self.target.exists():
            backup = self.target.with_name(f".{self.target.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                os.rename(self.target, backup)
            except OSError as e:
                raise _unwritable(self.target, e) from None
        try:
            self._place()
        except BaseException:
            if backup is not None:
                _restore(backup, self.target)
            raise
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


def check_output(target: Path, overwrite: bool = False) -> None:
    """Refuses an output path no package can be written to, naming it and
    the fix. The exporter calls it before loading the model, so a bad -o
    fails in a second, not after the tracing; the writer calls it again."""
    target = Path(target).absolute()
    if target.is_symlink():
        # the commit renames onto PKG, which would replace the link itself
        raise ExportError(f"{target} is a symlink to {os.readlink(target)}; pass -o {target.resolve()}")
    _check_parent(target)
    if target.is_file():
        raise ExportError(f"{target} is a file, not a kvexport package; choose another -o")
    if target.exists() and not _replaceable(target):
        raise ExportError(
            f"{target} is not a kvexport package (no kvexport manifest.json); --overwrite only replaces packages: "
            f"choose another -o"
        )
    if target.exists() and not overwrite:
        raise ExportError(f"{target} already exists; remove it or pass --overwrite")


def _check_parent(target: Path) -> None:
    """The nearest existing folder above PKG must be a directory we can
    write in (the missing ones between are created)."""
    ancestor = target.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ExportError(f"{ancestor} is a file, not a directory, so {target} cannot be created; choose another -o")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {target}: {ancestor} is not writable; choose an -o in a directory you can write to")


def _make_parent(target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ExportError(f"a file is in the way of {target.parent}; choose another -o") from None
    except OSError as e:
        raise _unwritable(target, e) from None


def _unwritable(target: Path, error: OSError) -> ExportError:
    return ExportError(
        f"cannot write {target}: {error.strerror or error} in {target.parent}; "
        f"choose an -o in a directory you can write to"
    )


def _raced(target: Path) -> ExportError:
    return ExportError(
        f"another export wrote {target} while this one ran; this one's package was discarded and nothing was "
        f"replaced: export again with --overwrite to replace it, or choose another -o"
    )


# what rename(2) says when something already took the target's place
_TAKEN = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)


def _restore(backup: Path, target: Path) -> None:
    try:
        os.rename(backup, target)  # put the old package back
    except OSError:
        # another export's package is at PKG now; both were asked to replace the old one
        log.warning("%s: another export replaced it meanwhile; removing the old package moved aside to %s", target, backup)
        shutil.rmtree(backup, ignore_errors=True)


STALE_AGE_S = 60.0
_STALE = r"\.{name}\.(?:partial-(\d+)-[^/]+|old-(\d+)(?:-[0-9a-f]+)?)"


def remove_stale(target: Path, min_age: float = STALE_AGE_S) -> list[Path]:
    """Removes what writers of PKG killed outright (kill -9, power loss) left
    beside it: partial directories (a full copy of the weights each) and
    backups whose process is gone and that nothing touched for `min_age`
    seconds. The age spares a writer in another PID namespace or on another
    host sharing the folder, which looks dead from here. Returns what it
    removed."""
    target = Path(target).absolute()
    pattern = re.compile(_STALE.format(name=re.escape(target.name)))
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    removed = []
    for path in entries:
        match = pattern.fullmatch(path.name)
        if match is None:
            continue
        pid = int(match[1] or match[2])
        age = _idle_seconds(path)
        if age is None or age < min_age or _alive(pid):
            continue
        _remove(path)
        log.info("removed %s, left %.0f s ago by export process %d, which is no longer running", path, age, pid)
        removed.append(path)
    return removed


def _idle_seconds(path: Path) -> float | None:
    """Seconds since a file last landed in `path` or its subfolders one level
    down (programs/, tokenizer/), where a live writer adds them."""
    try:
        below = [] if path.is_symlink() else [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
        newest = max(p.lstat().st_mtime for p in [path, *below])
    except OSError:
        return None
    return time.time() - newest


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except (OverflowError, OSError):
        return False
    return True


def _remove(path: Path) -> None:
    if path.is_symlink():  # an old kvexport moved a symlink at PKG aside
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _apply_umask(root: Path) -> None:
    """mkdtemp makes a private directory; give the package the modes any
    other file the user writes gets."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        mode = (0o777 if path.is_dir() else 0o666) & ~umask
        if path.stat().st_mode & 0o777 != mode:  # a chmod changes the file's ctime: only where needed
            os.chmod(path, mode)


class PackageReader:
    """Reads a package directory. Never unpickles anything, and never reads
    outside the package: every path the manifest names is relative, has no
    `..`, and leads through no symlink; the package holds only directories
    and regular files (a FIFO would hang a read, a link would leave)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.is_dir():
            raise PackageError(f"{self.path}: no such package directory")
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file() or manifest_path.is_symlink():
            raise PackageError(f"{self.path}: not a kvexport package ({MANIFEST} is missing)")
        self.layout_problems = _layout_problems(self.path)
        self._held: dict[str, bytes] = {}  # files read once, kept as hashed (programs)
        self.holding: dict[str, str] = {}  # files map_file gave: "mapped" or "private" (copied)
        self.manifest_bytes = self.read_file(MANIFEST, MANIFEST, MAX_MANIFEST_BYTES)
        try:
            self.manifest: dict[str, Any] = json.loads(self.manifest_bytes)
        except (ValueError, RecursionError) as e:
            raise PackageError(f"{manifest_path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(self.manifest, dict):
            raise PackageError(f"{manifest_path}: not a JSON object (found a {type(self.manifest).__name__})")

    def file(self, rel: Any, what: str = "file") -> Path:
        """The package path `rel` names, refused unless it stays inside."""
        problem = self.path_problem(rel)
        if problem is not None:
            raise PackageError(f"{self.path}: {what} {rel!r:.200}: {problem}")
        return self.path / rel

    def path_problem(self, rel: Any) -> str | None:
        """Why `rel` may not be read, or None: it must be relative, stay
        inside, and lead through no link or special file."""
        problem = confined_problem(rel)
        if problem is not None:
            return problem
        parts = rel.split("/")
        for prefix in ("/".join(parts[: i + 1]) for i in range(len(parts))):
            if prefix in self.layout_problems:
                return self.layout_problems[prefix]
        return None if resolves_inside(self.path, self.path / rel) else "resolves outside the package"

    def referenced_files(self) -> list[str]:
        """Every file the manifest points at (weights, programs, compiled)."""
        refs = [self.weights_file]
        methods = self.manifest.get("methods")
        for entry in methods.values() if isinstance(methods, dict) else ():
            if isinstance(entry, dict):
                refs += [entry[k] for k in ("program", "compiled") if k in entry]
        return refs

    def verify_checksums(self, only: list[str] | None = None, skip: tuple[str, ...] = ()) -> list[str]:
        """Compares files against the manifest; returns the mismatches. A
        file the manifest points at must be listed (and so checked). A path
        that would leave the package is refused before anything touches it,
        so the answer never tells whether a file outside exists. Programs
        are hashed from the bytes program_json later parses; the files in
        `skip` are hashed by their user as they are read (map_file,
        copy_file), so no file is hashed by path and used by another."""
        files = self.manifest.get("files")
        if not isinstance(files, dict):
            return ["files: missing from the manifest"]
        problems = sorted(f"files.{rel}: {why}" for rel, why in self.layout_problems.items())
        for rel in self.referenced_files():
            if (why := confined_problem(rel)) is not None:
                problems.append(f"{rel!r:.200}: {why}")
            elif rel not in files:
                problems.append(f"files.{rel}: the manifest uses it but lists no checksum for it")
        for rel in sorted(files):
            if only is not None and rel not in only:
                continue
            if (why := self.path_problem(rel)) is not None:
                if rel not in self.layout_problems:  # those are listed above
                    problems.append(f"files.{rel!r:.200}: {why}")
                continue
            if rel not in skip:
                problems += self._file_problems(rel)
        listed = set(files)
        for rel in _package_files(self.path):
            if rel != MANIFEST and rel not in listed:
                problems.append(f"files.{rel}: in the package but not in the manifest")
        return problems

    def _file_problems(self, rel: str) -> list[str]:
        """The listed file `rel` against its manifest entry: held files
        (programs) from their kept bytes, the rest from one descriptor."""
        try:
            if rel in self.program_files():
                data = self.held(rel)
                size, digest = len(data), hashlib.sha256(data).hexdigest()
            else:
                fd = self.open_file(rel)
                try:
                    size, digest = os.fstat(fd).st_size, sha256_fd(fd)
                finally:
                    os.close(fd)
        except PackageError as e:
            return [str(e)]
        return self._digest_problems(rel, size, digest)

    def _digest_problems(self, rel: str, size: int, digest: str) -> list[str]:
        entry = self.manifest["files"].get(rel)
        if not isinstance(entry, dict) or size != entry.get("bytes"):
            return [f"files.{rel}: size differs from the manifest"]
        if digest != entry.get("sha256"):
            return [f"files.{rel}: checksum differs from the manifest"]
        return []

    def require_digest(self, rel: str, size: int, digest: str) -> None:
        """Raises unless a file read as `size` bytes hashing to `digest` is
        the one the manifest lists."""
        files = self.manifest.get("files")
        if not isinstance(files, dict) or rel not in files:
            raise PackageError(f"{self.path}: files.{rel}: the manifest uses it but lists no checksum for it")
        problems = self._digest_problems(rel, size, digest)
        if problems:
            raise PackageError(f"{self.path}: the package is damaged: {problems[0]}")

    def open_file(self, rel: str, what: str | None = None) -> int:
        """A descriptor of the package file `rel`, opened without following
        any link; the caller closes it."""
        self.file(rel, what or f"files.{rel}")
        try:
            return open_inside(self.path, rel)
        except OSError as e:
            if what is None:  # as verify_checksums lists its problems
                raise PackageError(f"files.{rel}: {open_problem(e)}") from None
            raise PackageError(f"{self.path}: {what}: {rel} is {open_problem(e)}") from None

    def read_file(self, rel: str, what: str | None, limit: int) -> bytes:
        """The whole of a file that may hold at most `limit` bytes, read from one descriptor."""
        fd = self.open_file(rel, what)
        try:
            data = read_fd(fd, limit)
        except OSError as e:
            raise PackageError(f"{self.path}: {what or 'files'}: cannot read {rel} ({e.strerror or e})") from None
        finally:
            os.close(fd)
        if len(data) > limit:
            raise PackageError(f"{self.path}: {what or 'files'}: {rel} is more than {limit} bytes, more than a package holds there")
        return data

    def held(self, rel: str) -> bytes:
        """A program file's bytes, read once and kept: the checksum and the
        parse see the same bytes, whatever is renamed into the folder later."""
        if rel not in self._held:
            self._held[rel] = self.read_file(rel, None, MAX_PROGRAM_BYTES)
        return self._held[rel]

    def program_files(self) -> set[str]:
        methods = self.manifest.get("methods")
        entries = methods.values() if isinstance(methods, dict) else ()
        return {e["program"] for e in entries if isinstance(e, dict) and isinstance(e.get("program"), str)}

    def hold_programs(self) -> None:
        """Reads every program now (a no-op for those verify_checksums read):
        a method built minutes later parses these bytes, not the folder's."""
        for rel in sorted(self.program_files()):
            self.held(rel)

    def program_json(self, method: str) -> bytes:
        rel = self.manifest["methods"][method]["program"]
        self.file(rel, f"methods.{method}.program")
        return inflate_program(self.held(rel), f"methods.{method}.program ({rel})")

    def map_file(self, rel: str, what: str, verify: bool = True, hold: str = "mapped") -> mmap.mmap:
        """A private mapping of `rel`, hashed from the mapping itself (not
        from the path) when `verify`. With `hold` "private" ("auto": where
        the file takes at most AUTO_PRIVATE_SHARE of the memory available),
        and for a file that someone else could write in place (after its
        hash, into pages not yet read), the file is copied into anonymous
        memory instead (on huge pages where the kernel has them), where it
        fits. `self.holding[rel]` says which it became."""
        if hold not in WEIGHTS_MEMORY:
            raise ValueError(f"hold={hold!r}: one of {', '.join(WEIGHTS_MEMORY)}")
        fd = self.open_file(rel, what)
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size == 0:
                raise PackageError(f"{self.path}: {what}: {rel} is empty")
            writer = others_can_write(st)
            free = available_memory()
            private = hold == "private"
            if hold == "auto":
                private = free is not None and size <= AUTO_PRIVATE_SHARE * free
                log.info("%s: %s (%.0f MB) %s (--weights auto; %s available)", self.path, rel, size / 2**20,
                         "copied into private memory" if private else "mapped from the file",
                         "unknown memory" if free is None else f"{free / 2**30:.1f} GiB")
            if writer is None and not private:
                mapping = map_fd(fd, size)
            else:
                if free is not None and size > free:
                    why = (f"can be written by others ({writer}), who could change it after its checksum is taken"
                           if writer is not None else "was asked for in private memory")
                    fixes = []
                    if private:  # a copy either way: only the mapping fits
                        fixes.append("map it from the file instead (--weights mapped)")
                    if writer is not None:
                        fixes.append("make it writable by you alone (chmod go-w)" if private else
                                     "make it writable by you alone (chmod go-w), or copy the package")
                    fix = " and ".join(fixes)
                    raise PackageError(f"{self.path}: {what}: {rel} {why}, and its {size / 2**30:.1f} GiB do not fit in "
                                       f"the {free / 2**30:.1f} GiB of memory available to copy it: {fix}")
                if writer is not None:
                    log.info("%s: %s can be written by others (%s): reading it into private memory", self.path, rel,
                             writer)
                mapping = read_private(fd, size)
            self.holding[rel] = "mapped" if writer is None and not private else "private"
        except OSError as e:
            raise PackageError(f"{self.path}: {what}: cannot map {rel} ({e.strerror or e})") from None
        finally:
            os.close(fd)
        if verify:
            self.require_digest(rel, size, sha256_buffer(mapping))
        return mapping

    def copy_file(self, rel: str, folder: Path, what: str) -> Path:
        """Copies `rel` into `folder` (which only this user can write),
        hashing the bytes as they are copied, and returns the copy once they
        match the manifest: the copy is what was hashed."""
        copy = Path(folder) / Path(rel).name
        fd = self.open_file(rel, what)
        try:
            with open(copy, "xb") as out:
                digest = sha256_fd(fd, out.write)
                size = out.tell()
        except OSError as e:
            raise PackageError(f"{self.path}: {what}: cannot copy {rel} ({e.strerror or e})") from None
        finally:
            os.close(fd)
        self.require_digest(rel, size, digest)
        return copy

    @property
    def weights_file(self) -> Any:
        """The weights' path in the package, as the manifest gives it (unchecked)."""
        weights = self.manifest.get("weights")
        return weights.get("file", WEIGHTS) if isinstance(weights, dict) else WEIGHTS

    @property
    def weights_path(self) -> Path:
        return self.file(self.weights_file, "weights.file")

    @property
    def tokenizer_dir(self) -> Path | None:
        tok = self.manifest.get("tokenizer")
        if not tok:
            return None
        rel = tok.get("dir") if isinstance(tok, dict) else tok
        path = self.file(rel, "tokenizer.dir")
        if not path.is_dir():
            raise PackageError(f"{self.path}: tokenizer.dir {rel!r:.200}: not a directory in the package")
        return path

    def total_bytes(self) -> int:
        return sum((self.path / rel).stat().st_size for rel in _package_files(self.path))


MAX_MANIFEST_BYTES = 64 << 20


MAX_DEPTH = 8  # a package's folders nest two deep (programs/, tokenizer/)


def _walk(root: Path, problems: dict[str, str]):
    """os.walk without following links, that descends at most MAX_DEPTH
    folders: os.walk recurses once per level, so a chain of thousands of
    folders would end in a RecursionError. A folder past it is a problem."""
    for folder, dirs, names in os.walk(root, followlinks=False):
        if len(Path(folder).relative_to(root).parts) >= MAX_DEPTH:
            for name in dirs:
                problems[(Path(folder) / name).relative_to(root).as_posix()] = (
                    f"nested deeper than {MAX_DEPTH} folders; a package's folders nest two deep"
                )
            dirs[:] = []
        yield folder, dirs, names


def _package_files(root: Path) -> list[str]:
    """Relative paths of the package's regular files, without following links."""
    out = []
    for folder, dirs, names in _walk(root, {}):
        for name in names:
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                out.append(path.relative_to(root).as_posix())
    return sorted(out)


def _layout_problems(root: Path) -> dict[str, str]:
    """Every entry of the package that is not a directory or regular file."""
    problems: dict[str, str] = {}
    for folder, dirs, names in _walk(root, problems):
        for name in dirs + names:
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                problems[rel] = "a symlink; a package holds no links"
            elif not (path.is_dir() or path.is_file()):
                problems[rel] = "not a regular file"
    return problems
