"""The trust store: which packages' native code this user agrees to run.

An aoti package holds compiled code; its checksums prove the files match the
manifest, not who made them. Trust is therefore given to a manifest digest
(sha256 of manifest.json's bytes): the manifest lists every file's sha256 and
the loader verifies them before native code loads, so the digest covers the
whole package. The store is one JSON file, keyed by digest:

    $KVEXPORT_TRUST_DIR/trusted.json, else $XDG_CONFIG_HOME/kvexport/trusted.json,
    else ~/.config/kvexport/trusted.json
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator

from kvexport.contract import manifest as mf
from kvexport.contract.errors import PackageError, TrustStoreError
from kvexport.contract.package import MANIFEST, PackageReader

log = logging.getLogger(__name__)

TRUST_DIR_ENV = "KVEXPORT_TRUST_DIR"
STORE_FILE = "trusted.json"
STORE_FORMAT = "kvexport.trust"


def manifest_digest(manifest_bytes: bytes) -> str:
    return hashlib.sha256(manifest_bytes).hexdigest()


def package_digest(path: str | Path) -> str:
    return manifest_digest(PackageReader(path).manifest_bytes)


def holds_native_code(manifest: dict) -> bool:
    methods = manifest.get("methods", {})
    return isinstance(methods, dict) and any(isinstance(e, dict) and "compiled" in e for e in methods.values())


def trust_dir() -> Path:
    if os.environ.get(TRUST_DIR_ENV):
        return Path(os.environ[TRUST_DIR_ENV])
    xdg = os.environ.get("XDG_CONFIG_HOME")
    # the XDG spec says to ignore a relative XDG_CONFIG_HOME
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "kvexport"


def store_path() -> Path:
    return trust_dir() / STORE_FILE


def _read_store(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise TrustStoreError(f"{path}: cannot read the trust store ({e}); fix or remove it") from e
    if not isinstance(data, dict) or data.get("format") != STORE_FORMAT or not isinstance(data.get("trusted"), dict):
        raise TrustStoreError(f"{path}: not a kvexport trust store; fix or remove it")
    return data["trusted"]


def _write_store(path: Path, trusted: dict[str, dict]) -> None:
    """Atomic: a reader sees the old store or the new one, never half of one."""
    text = json.dumps({"format": STORE_FORMAT, "version": 1, "trusted": trusted}, indent=1, sort_keys=True) + "\n"
    # mkstemp creates the file 0600, and os.replace keeps that mode
    fd, tmp = tempfile.mkstemp(prefix=f".{STORE_FILE}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked_store() -> Iterator[Path]:
    """Serializes read-modify-write, so two exports finishing at once both
    land in the store."""
    path = store_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = os.open(path.with_name(STORE_FILE + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise TrustStoreError(f"{path.parent}: cannot open the trust store ({e}); set ${TRUST_DIR_ENV} to a writable directory") from e
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(lock)  # closing releases the lock


def is_trusted(digest: str) -> bool:
    return digest in _read_store(store_path())


def record(digest: str, package: Path) -> None:
    """Trusts `digest`; the path and time are for a human reading the store."""
    with _locked_store() as path:
        trusted = _read_store(path)
        trusted[digest] = {"path": str(Path(package).absolute()), "added_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        try:
            _write_store(path, trusted)
        except OSError as e:
            raise TrustStoreError(f"{path}: cannot write the trust store ({e})") from e


def forget(digest: str) -> bool:
    """Stops trusting `digest`; False when it was not trusted."""
    with _locked_store() as path:
        trusted = _read_store(path)
        if trusted.pop(digest, None) is None:
            return False
        try:
            _write_store(path, trusted)
        except OSError as e:
            raise TrustStoreError(f"{path}: cannot write the trust store ({e})") from e
        return True


def trust_package(path: str | Path) -> str:
    """`kvexport trust`: records a package's digest once its files match its
    manifest (a damaged package is never trusted). Returns the digest."""
    reader = PackageReader(path)
    mf.require(reader.verify_checksums(), f"{reader.path}: the package is damaged; not trusting it")
    digest = manifest_digest(reader.manifest_bytes)
    record(digest, reader.path)
    return digest


def untrust_package(path: str | Path) -> tuple[str, bool]:
    digest = package_digest(path)
    return digest, forget(digest)


def trust_exported(package: Path) -> str:
    """The exporter's hook: a package this user just compiled on this machine
    is trusted. A store that cannot be written does not fail the export: the
    package is whole, and loading it says how to trust it."""
    digest = manifest_digest((package / MANIFEST).read_bytes())
    try:
        record(digest, package)
    except TrustStoreError as e:
        log.warning("%s; the package is not trusted yet: run kvexport trust %s", e, package)
    return digest


def check_expected_digest(reader: PackageReader, expect_digest: str | None) -> None:
    """A pin (`--expect-digest`) refuses any other package, compiled or not."""
    if expect_digest is None:
        return
    digest = manifest_digest(reader.manifest_bytes)
    if expect_digest.strip().lower() != digest:
        raise PackageError(
            f"{reader.path}: manifest digest {digest} is not the expected {expect_digest.strip()}; "
            f"this is not the package that was pinned, refusing to load it"
        )


def require_native_code_trusted(reader: PackageReader, trust_native_code: bool) -> None:
    """Refuses a package with compiled code unless this user trusts it."""
    if trust_native_code or not holds_native_code(reader.manifest):
        return
    digest = manifest_digest(reader.manifest_bytes)
    if is_trusted(digest):
        return
    raise PackageError(
        f"{reader.path}: this package holds native code compiled by someone else (manifest digest {digest}), "
        f"which runs with your permissions; run it only if you trust where it came from: "
        f"`kvexport trust {reader.path}` to trust it from now on, `--trust-native-code` (load(..., trust_native_code=True)) "
        f"for one run, or `--expect-digest DIGEST` (load(..., expect_digest=...)) with the digest its publisher gave you"
    )
