"""How a package's files are read: each one opened once, relative to the
package's folder and never through a link, and used from the bytes or the
descriptor it was hashed from. A file renamed into the package after it
was hashed is never read: what runs is what was hashed.

Programs are small (kB to MB gzip): their compressed bytes are read once,
hashed and kept; they inflate under an output cap and a ratio cap, and
their JSON's values are counted in the raw bytes before any object is
built, so a small file cannot exhaust the machine."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import stat
import zlib
from pathlib import Path
from typing import Any, Callable

from kvexport.contract.errors import PackageError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted after the listing must not hang; it is refused below
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

# Measured on exported programs: ~1.1 kB and ~60 JSON values a graph node,
# ~90 nodes a llama-like layer, gzip at 14-25x (a layer's ~100 kB of JSON is
# wider than deflate's 32 kB window, so the ratio does not grow with depth).
# A 30-layer SmolLM2 forward: ~2,700 nodes, ~3 MB, ~170 k values.
MAX_PROGRAM_BYTES = 128 << 20  # room for ~1,300 such layers (the manifest's cap is 1,024)
MAX_PROGRAM_VALUES = 8 << 20  # ~1,500 layers; json.loads builds ~100 bytes a value at worst
MAX_INFLATE_RATIO = 128  # 5x the most a real program reaches; a gzip bomb reaches ~1,000
MIN_INFLATE_CAP = 1 << 20  # a tiny program may inflate this far whatever its ratio
HASH_READ_BYTES = 16 << 20  # hashlib releases the GIL on reads this large: ~1.2 GB/s a core here


def sha256_file(path: Path) -> str:
    """The file's sha256, hashed whole on every call. No digest is
    remembered between runs: a memo keyed by the file's stat passed a file
    changed through a shared mapping (its ctime does not move) and trusted
    whoever could write the cache. 2 GB take ~1.6 s of CPU here (1.3 GB/s)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return sha256_fd(fd)
    finally:
        os.close(fd)


def sha256_fd(fd: int, sink: Callable[[memoryview], Any] | None = None) -> str:
    """The sha256 of what an open descriptor holds, read from its start with
    pread; `sink` sees every block hashed (a copy is written from them)."""
    digest = hashlib.sha256()
    buf = bytearray(HASH_READ_BYTES)
    view = memoryview(buf)
    offset = 0
    while got := os.preadv(fd, [buf], offset):
        digest.update(view[:got])
        if sink is not None:
            sink(view[:got])
        offset += got
    return digest.hexdigest()


MAX_NAME_BYTES, MAX_PATH_BYTES = 255, 1024  # Linux allows 255 and 4096; a package's own paths are short


def confined_problem(rel: Any) -> str | None:
    """Why `rel` is not a plain relative path inside a package, or None."""
    if not isinstance(rel, str) or not rel:
        return "not a relative path string"
    if "\\" in rel or "\0" in rel or rel.startswith("/") or os.path.isabs(rel):
        return "an absolute path or odd characters; package paths are relative, with /"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "has an empty, '.' or '..' part; package paths stay inside the package"
    try:
        encoded = os.fsencode(rel)
    except UnicodeError:
        return "not a file name this system can encode"
    if len(encoded) > MAX_PATH_BYTES or any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
        return f"longer than a file system allows ({MAX_NAME_BYTES} bytes a name, {MAX_PATH_BYTES} in all)"
    return None


def resolves_inside(root: Path, path: Path) -> bool:
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(path)]) == real_root


def open_inside(root: Path, rel: str) -> int:
    """A descriptor of the regular file `rel` under `root`. Each folder on
    the way is opened relative to the one before with O_NOFOLLOW, so a link
    planted since the package was listed is refused, never followed.
    Raises OSError (ELOOP for a link, EINVAL for a special file)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the package path itself is the caller's
    try:
        *folders, name = rel.split("/")
        for folder in folders:
            inner = os.open(folder, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
        file_fd = os.open(name, _FILE_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise OSError(errno.EINVAL, "not a regular file")
    os.set_blocking(file_fd, True)
    return file_fd


def open_problem(error: OSError) -> str:
    """What an OSError from open_inside means for a package file."""
    if error.errno == errno.ENOENT:
        return "missing from the package"
    if error.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a symlink (or under one); a package holds no links"
    if error.errno == errno.EINVAL:
        return "not a regular file"
    return f"cannot be read ({error.strerror or error})"


def read_fd(fd: int, limit: int) -> bytes:
    """At most `limit` + 1 bytes from the descriptor's start (one more than
    allowed says the file is too large without reading all of it)."""
    out = bytearray()
    while len(out) <= limit:
        block = os.pread(fd, min(16 << 20, limit + 1 - len(out)), len(out))
        if not block:
            break
        out += block
    return bytes(out)


def map_fd(fd: int, size: int) -> mmap.mmap:
    """A private mapping of the descriptor: writes through it (a program
    writing into a weight) go to private copies of the pages, never to the
    file, and the mapping stays valid when the descriptor closes."""
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def others_can_write(st: os.stat_result) -> str | None:
    """Who besides this user could write the file in place, or None: its
    group or everyone (mode bits), or an owner who is neither this user nor
    root (an owner can always give itself write access)."""
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {stat.S_IMODE(st.st_mode):04o}"
    if st.st_uid not in (os.getuid(), 0):
        return f"owner uid {st.st_uid}"
    return None


def read_private(fd: int, size: int) -> mmap.mmap:
    """The descriptor's bytes copied into anonymous memory, which no write
    to the file can change afterwards (a private file mapping shows the
    file's later writes in every page not yet copied), on transparent huge
    pages where the kernel offers them (asked for before the copy touches a
    page: a page is huge or not when it is first written)."""
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    advise_huge_pages(memory)
    view = memoryview(memory)
    try:
        done = 0
        while done < size:
            got = os.preadv(fd, [view[done : done + (64 << 20)]], done)
            if got == 0:
                raise OSError(errno.EIO, "the file shrank while it was read")
            done += got
    except BaseException:
        view.release()
        memory.close()
        raise
    view.release()
    return memory


def advise_huge_pages(memory: mmap.mmap) -> None:
    """Asks the kernel to back `memory` with transparent huge pages (2 MB on
    x86): a stream through the weights then misses the TLB once in 2 MB
    instead of once in 4 KB. Where the kernel or Python cannot (no THP,
    another OS), the memory works the same on small pages."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


def available_memory() -> int | None:
    """The kernel's MemAvailable in bytes, or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def sha256_buffer(buffer) -> str:
    """A buffer's sha256 in 16 MB slices (hashlib releases the GIL for each)."""
    digest = hashlib.sha256()
    view = memoryview(buffer)
    for start in range(0, len(view), 16 << 20):
        digest.update(view[start : start + (16 << 20)])
    view.release()
    return digest.hexdigest()


def inflate_program(data: bytes, where: str) -> bytes:
    """A gzip program's JSON, inflated in steps that stop as soon as it
    passes MAX_PROGRAM_BYTES or MAX_INFLATE_RATIO times its compressed size:
    a bomb is refused after at most that much work, not after all of it."""
    limit = min(MAX_PROGRAM_BYTES, max(MAX_INFLATE_RATIO * len(data), MIN_INFLATE_CAP))
    out = bytearray()
    view, pos = memoryview(data), 0
    try:
        while pos < len(data):  # gzip allows several members end to end
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            while not inflater.eof:
                # fed in slices: what a member leaves over is copied, so the
                # copies stay small however many members a file holds
                feed = view[pos : pos + _INFLATE_FEED]
                block = inflater.decompress(feed, limit + 1 - len(out))
                used = len(feed) - len(inflater.unconsumed_tail)
                if not block and not used:
                    raise PackageError(f"{where}: the gzip stream is truncated; the file is damaged")
                pos += used
                out += block
                if len(out) > limit:
                    raise PackageError(
                        f"{where}: unpacks to more than {limit} bytes ({len(data)} compressed; a program may unpack to "
                        f"{MAX_INFLATE_RATIO}x its size and at most {MAX_PROGRAM_BYTES} bytes): a gzip bomb, not a kvexport program"
                    )
            pos -= len(inflater.unused_data)
    except zlib.error as e:
        raise PackageError(f"{where}: not a gzip file ({e})") from None
    check_json_counts(out, where)
    return bytes(out)


_INFLATE_FEED = 1 << 16


def check_json_counts(text: bytes | bytearray, where: str) -> None:
    """Bounds the objects json.loads would build, from the raw bytes: every
    value but the first follows a ',' or opens a container, so these counts
    bound them (strings holding the characters only make it stricter)."""
    values = text.count(b",") + text.count(b"[") + text.count(b"{")
    if values > MAX_PROGRAM_VALUES:
        raise PackageError(
            f"{where}: holds about {values} JSON values, more than a program has (at most {MAX_PROGRAM_VALUES}); "
            f"not a kvexport program"
        )
