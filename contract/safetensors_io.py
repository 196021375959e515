"""Safetensors files written and read one tensor at a time, so a model larger
than memory passes through in bounded memory.

`SafetensorsWriter` knows every name, dtype and shape up front, writes the
header first, then takes the tensors in file order, each from memory or
copied in chunks from a range of another file (converting its dtype on the
way). Its bytes equal `safetensors.torch.save_file`'s for the same tensors:
the same order (wider dtypes first, then by name), the same compact JSON
header padded with spaces to 8 bytes.

`read_header` parses a file's header without mapping or loading it; the
`TensorRange` it gives says where each tensor's bytes lie. `map_tensors`
gives the tensors of a file the runtime mapped (and hashed from that
mapping) as views of it, with the checks the safetensors library makes."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

# safetensors' dtype names, in the order its writer sorts them (first = stored first)
_ORDER = ["U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
          "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "F6_E3M2", "F6_E2M3", "F4", "BOOL"]
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
CHUNK = 64 << 20  # bytes copied (and converted) at a time
MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class TensorRange:
    """Where a tensor's bytes lie in a safetensors file."""

    path: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def read_header(path: str | Path) -> tuple[dict[str, TensorRange], dict[str, str]]:
    """Every tensor's range, and the file's metadata, from its header alone."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        length = _header_length(head, path)
        return parse_header(f.read(length), length, path.stat().st_size, path)


def _header_length(head: bytes, path: Path) -> int:
    (length,) = struct.unpack("<Q", head[:8])
    if length > MAX_HEADER:
        raise ValueError(f"{path}: its header length is larger than safetensors allows (not a safetensors file?)")
    return length


def parse_header(raw: bytes, length: int, size: int, path: Path) -> tuple[dict[str, TensorRange], dict[str, str]]:
    """The ranges a header of `length` bytes (`raw`) gives in a file of
    `size` bytes; each must lie inside the file."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: the header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    ranges = {}
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry ({e})") from None
        nbytes = _numel(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or min(shape, default=0) < 0 or 8 + length + end > size:
            raise ValueError(f"{path}: tensor {name!r} lies outside the file or has the wrong length")
        ranges[name] = TensorRange(path, name, dtype, shape, 8 + length + begin, nbytes)
    return ranges, metadata


def map_tensors(buffer, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buffer` (a mapping of it),
    as views of the buffer: no byte is copied, and every method that binds a
    tensor binds the same memory. The ranges must tile the data, as the
    safetensors library requires."""
    if len(buffer) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    length = _header_length(bytes(buffer[:8]), path)
    if 8 + length > len(buffer):
        raise ValueError(f"{path}: the header runs past the end of the file")
    ranges, _ = parse_header(bytes(buffer[8 : 8 + length]), length, len(buffer), path)
    _check_tiling(ranges.values(), 8 + length, len(buffer), path)
    tensors = {}
    for name, r in ranges.items():
        if r.nbytes == 0:  # frombuffer refuses an empty view
            tensors[name] = torch.empty(r.shape, dtype=r.dtype)
        else:
            tensors[name] = torch.frombuffer(buffer, dtype=r.dtype, count=_numel(r.shape), offset=r.offset).view(r.shape)
    return tensors


def _check_tiling(ranges, start: int, size: int, path: Path) -> None:
    """The tensors' bytes follow each other from the header's end to the
    file's end, with no gap or overlap."""
    end = start
    for r in sorted(ranges, key=lambda r: (r.offset, r.nbytes)):
        if r.offset != end:
            raise ValueError(f"{path}: the tensors' bytes overlap or leave a gap at byte {end}")
        end += r.nbytes
    if end != size:
        raise ValueError(f"{path}: the tensors take {end - start} bytes, the file holds {size - start} after its header")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SafetensorsWriter:
    """Writes `specs` ({name: (dtype, shape)}) as one safetensors file: the
    header on creation, then each tensor through `write(name, source)` in
    the order `names` gives (the file's order). `source` is a tensor or a
    TensorRange of another file. `close` checks every tensor came."""

    def __init__(self, path: str | Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        for name, (dtype, _) in specs.items():
            if dtype not in NAMES:
                raise ValueError(f"{name}: safetensors cannot store {dtype}")
        self.names = sorted(specs, key=lambda n: (_ORDER.index(NAMES[specs[n][0]]), n))
        self.specs = {n: (specs[n][0], tuple(int(d) for d in specs[n][1])) for n in self.names}
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name in self.names:
            dtype, shape = self.specs[name]
            nbytes = _numel(shape) * dtype.itemsize
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        self.data_bytes = offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.file.close()

    def write(self, name: str, source: torch.Tensor | TensorRange | list) -> None:
        """`source`: a tensor, a range of another file, or a list of those
        stacked along the first dim (written one after the other)."""
        if self.next >= len(self.names) or self.names[self.next] != name:
            expected = self.names[self.next] if self.next < len(self.names) else "nothing more"
            raise ValueError(f"safetensors writer: got {name!r}, expected {expected!r}")
        dtype, shape = self.specs[name]
        parts = source if isinstance(source, list) else [source]
        stacked = (sum(p.shape[0] for p in parts), *parts[0].shape[1:]) if parts[0].shape else ()
        if tuple(stacked) != shape or any(tuple(p.shape[1:]) != shape[1:] for p in parts):
            got = [tuple(p.shape) for p in parts] if isinstance(source, list) else tuple(source.shape)
            raise ValueError(f"{name}: shape {got} is not the declared {shape}")
        for part in parts:
            if isinstance(part, TensorRange):
                for chunk in _chunks(part):
                    write_bytes(self.file, chunk.to(dtype))
            else:
                write_bytes(self.file, part.detach().to("cpu", dtype))
        self.next += 1

    def close(self) -> None:
        if self.file.closed:
            return
        missing = self.names[self.next:]
        self.file.close()
        if missing:
            raise ValueError(f"safetensors writer: {len(missing)} tensors never written, first {missing[0]!r}")


def write_bytes(file, tensor: torch.Tensor) -> None:
    """A CPU tensor's bytes, in row-major order, appended to an open file."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel():
        file.write(memoryview(flat.view(torch.uint8).numpy()))


def _chunks(source: TensorRange) -> Iterator[torch.Tensor]:
    """The range's values as 1-d tensors of at most CHUNK bytes, read with
    pread (nothing mapped, so no page of the source stays resident in this
    process), each cut at a whole element."""
    step = max(CHUNK // source.dtype.itemsize, 1) * source.dtype.itemsize
    fd = os.open(source.path, os.O_RDONLY)
    try:
        done = 0
        while done < source.nbytes:
            want = min(step, source.nbytes - done)
            buf = bytearray(want)
            got = os.preadv(fd, [buf], source.offset + done)
            if got != want:
                raise OSError(f"{source.path}: short read of {source.name}")
            yield torch.frombuffer(buf, dtype=source.dtype)
            done += want
    finally:
        os.close(fd)


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor | TensorRange], metadata: dict[str, str] | None = None) -> None:
    """Writes every tensor, one at a time."""
    specs = {}
    for name, t in tensors.items():
        specs[name] = (t.dtype, tuple(t.shape))
    with SafetensorsWriter(path, specs, metadata) as writer:
        for name in writer.names:
            writer.write(name, tensors[name])
