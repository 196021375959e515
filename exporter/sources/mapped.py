"""Which of the model's tensors are still the source checkpoint's bytes.

transformers maps a safetensors checkpoint into memory when the dtype needs
no conversion: a parameter's storage is then a window on the file. The
writer copies such a tensor straight from the file (pread), so exporting a
model larger than memory never holds it, and its pages never become this
process's private memory. A tensor counts as the file's bytes only when
its address lies in a mapping of that file with no page written since
(smaps' Anonymous is 0: a page of a private file mapping that is written
to becomes an anonymous copy, and no longer matches the file; Private_Dirty
would also count file pages not yet flushed to disk) at exactly the offset where the file's header
puts a tensor of the same dtype and shape. Elsewhere (no /proc, converted
or quantized tensors, anything modified) the tensor is written from memory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvexport.contract.safetensors_io import TensorRange, read_header

_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ ([0-9a-f]+) \S+ \d+\s*(.*)$")


@dataclass
class _Window:
    start: int
    end: int
    offset: int  # the file offset at `start`
    path: str
    dirty: bool = False


def source_ranges(tensors: dict[str, torch.Tensor], files: list[Path]) -> dict[str, TensorRange]:
    """{name: the range of a source file that holds exactly that tensor}."""
    if not files or not os.path.exists("/proc/self/smaps"):
        return {}
    by_offset: dict[str, dict[int, TensorRange]] = {}
    for path in files:
        try:
            ranges, _ = read_header(path)
        except (OSError, ValueError):
            continue
        by_offset[os.path.realpath(path)] = {r.offset: r for r in ranges.values()}
    windows = _clean_windows(set(by_offset))
    out = {}
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            continue
        pointer = tensor.data_ptr()
        for window in windows:
            if window.start <= pointer < window.end:
                found = by_offset[window.path].get(pointer - window.start + window.offset)
                if (found is not None and found.dtype == tensor.dtype and found.shape == tuple(tensor.shape)
                        and pointer + found.nbytes <= window.end):
                    out[name] = found
                break
    return out


def _clean_windows(paths: set[str]) -> list[_Window]:
    """This process's mappings of `paths`, adjacent ones of one file joined,
    each marked dirty when any page of it was written (copied on write)."""
    windows: list[_Window] = []
    current: _Window | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            match = _MAPPING.match(line)
            if match:
                start, end, offset, path = match.groups()
                current = _Window(int(start, 16), int(end, 16), int(offset, 16), path) if path in paths else None
                if current is not None:
                    windows.append(current)
            elif current is not None and line.startswith("Anonymous:") and int(line.split()[1]) > 0:
                current.dirty = True
    joined: list[_Window] = []
    for window in sorted(windows, key=lambda w: w.start):
        last = joined[-1] if joined else None
        if (last is not None and last.path == window.path and last.end == window.start
                and last.offset + (last.end - last.start) == window.offset):
            last.end, last.dirty = window.end, last.dirty or window.dirty
        else:
            joined.append(window)
    return [w for w in joined if not w.dirty]
