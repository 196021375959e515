"""Files the export writes outside its package (`--report FILE`, `--dump-graphs
DIR`), written so that no symlink planted at those paths is followed: a link
at FILE, at DIR or inside DIR would otherwise let whoever can write there
overwrite any file the user can. Every last step is taken relative to an
open directory with O_NOFOLLOW, so nothing can be swapped in between a check
and the write."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path
from typing import Iterator

import torch

from kvexport.contract.errors import ExportError

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def write_file(path: Path, text: str) -> None:
    """Writes `text` to `path` beside it and renames it into place: a link at
    `path` is replaced, never written through. `path`'s folder is the
    caller's choice and is followed like any path given on the command line."""
    path = Path(path)
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ExportError(f"{path}: cannot write it ({e.strerror or e}); pass a file in an existing folder") from None
    try:
        write_in(folder, path.name, text, path)
    finally:
        os.close(folder)


def write_in(folder: int, name: str, text: str, shown: Path) -> None:
    """`name` inside the open directory `folder`, through a fresh temporary
    file (O_EXCL | O_NOFOLLOW: never an existing file or link)."""
    partial = f".{name}.{secrets.token_hex(6)}.partial"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=folder)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(partial, name, src_dir_fd=folder, dst_dir_fd=folder)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(partial, dir_fd=folder)
        raise ExportError(f"{shown}: cannot write it ({e.strerror or e})") from None


@contextlib.contextmanager
def open_directory(path: Path, parent: int | None = None) -> Iterator[int]:
    """A directory, created when missing, opened without following a link:
    a symlink there is refused, named (relative to `parent` when given)."""
    where = str(path) if parent is None else path.name
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(where, 0o755, dir_fd=parent)
        fd = os.open(where, _DIRECTORY, dir_fd=parent)
    except OSError as e:
        reason = "a symbolic link or not a directory" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror or e
        raise ExportError(
            f"{path}: cannot write graphs there ({reason}); --dump-graphs writes only into real directories: "
            "pass a new path"
        ) from None
    try:
        yield fd
    finally:
        os.close(fd)


class GraphDump:
    """Writes each method's graph after each step, when asked to:
    DIR/<method>/<n>-<step>.txt."""

    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory) if directory else None
        self.count = 0

    def __call__(self, step: str, programs: dict[str, torch.export.ExportedProgram | torch.fx.GraphModule]) -> None:
        if self.directory is None:
            return
        self.count += 1
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        with open_directory(self.directory) as root:
            for name, program in programs.items():
                with open_directory(self.directory / name, parent=root) as folder:
                    if isinstance(program, torch.fx.GraphModule):  # a view made for the dump (compile passes)
                        text = program.print_readable(print_output=False)
                    else:
                        text = f"{program.graph_signature}\n\n{program.graph_module.print_readable(print_output=False)}"
                    write_in(folder, f"{self.count}-{step}.txt", text, self.directory / name)
