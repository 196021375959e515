"""A GGUF file's header walked with every count and length checked against
the bytes left in the file, before gguf's GGUFReader (or transformers,
which uses it) reads it.

The reader trusts the header: it sizes its arrays from a string length or
an array count before it looks at the file's size, so a 178-byte file
that claims a 2^40-byte string drives it past 8 GiB. Here nothing is
allocated from a count: fixed-size runs are skipped by seeking, and only
the short fields (a key, a tensor's name) are read.

Layout (GGUF v2 and v3; every integer in the file's byte order):
    magic "GGUF", u32 version, u64 tensor count, u64 key-value count
    key-value: string key, u32 value type, value
        string: u64 length, bytes; array: u32 element type, u64 count, elements
    tensor info: string name, u32 n_dims, u64 dims[n_dims], u32 type, u64 offset
    padding to `general.alignment` (default 32), then the tensors' data
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

from kvexport.contract.errors import ModelError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 used 32-bit counts; gguf-py reads v2 and v3
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, UINT32 = 8, 9, 4
# value type -> struct code of its fixed-size scalar (STRING and ARRAY are walked)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
SHORT_FIELD_BYTES = 1 << 16  # a key or a tensor name is read; neither is near this long in a real file


class _Cursor:
    """A position in the file whose every read or skip is first checked
    against the bytes left, so a claimed length costs nothing until it fits."""

    def __init__(self, f, size: int, where: str):
        self.f, self.size, self.where = f, size, where
        self.order = "<"

    def left(self) -> int:
        return self.size - self.f.tell()

    def need(self, n: int, field: str) -> None:
        if n > self.left():
            raise ModelError(
                f"{self.where}: {field}: {n} bytes claimed, only {self.left()} left in the file; "
                f"the GGUF file is damaged or crafted: download it again"
            )

    def read(self, n: int, field: str) -> bytes:
        self.need(n, field)
        return self.f.read(n)

    def skip(self, n: int, field: str) -> None:
        self.need(n, field)
        self.f.seek(n, os.SEEK_CUR)

    def scalar(self, code: str, field: str):
        return struct.unpack(self.order + code, self.read(struct.calcsize(code), field))[0]

    def string(self, field: str, keep: bool) -> str | None:
        n = self.scalar("Q", f"{field} (its length)")
        if not keep:
            self.skip(n, field)
            return None
        if n > SHORT_FIELD_BYTES:
            raise ModelError(f"{self.where}: {field} is {n} bytes long; GGUF names are short (at most {SHORT_FIELD_BYTES})")
        return self.read(n, field).decode("utf-8", errors="replace")


def check_gguf_header(path: Path) -> None:
    """Raises ModelError naming the file and the field whose count or length
    does not fit in the file; returns when the whole header (and every
    tensor's data range) lies inside it."""
    path = Path(path)
    where = f"GGUF file {path.name}"
    try:
        with open(path, "rb") as f:
            cursor = _Cursor(f, os.fstat(f.fileno()).st_size, where)
            tensors, kvs = _preamble(cursor)
            alignment = DEFAULT_ALIGNMENT
            for i in range(kvs):
                key, value = _key_value(cursor, i)
                if key == "general.alignment":
                    alignment = value
            infos = [_tensor_info(cursor, i) for i in range(tensors)]
            data_start = -(-f.tell() // alignment) * alignment
            _check_data(cursor, infos, data_start)
    except OSError as e:
        raise ModelError(f"{where}: cannot read it ({e.strerror or e})") from None


def _preamble(cursor: _Cursor) -> tuple[int, int]:
    if cursor.read(4, "the magic") != MAGIC:
        raise ModelError(f"{cursor.where}: not a GGUF file (it does not start with {MAGIC!r})")
    raw = cursor.read(4, "the version")
    version = struct.unpack("<I", raw)[0]
    if version & 0xFFFF == 0:  # written on a big-endian machine
        cursor.order, version = ">", struct.unpack(">I", raw)[0]
    if version not in VERSIONS:
        raise ModelError(f"{cursor.where}: GGUF version {version}; kvexport reads versions {', '.join(map(str, VERSIONS))}")
    tensors = cursor.scalar("Q", "the tensor count")
    kvs = cursor.scalar("Q", "the key-value count")
    # the least a tensor info (name length, 1 dim, type, offset) and a key-value (key length, type, 1 byte) take
    cursor.need(tensors * 32 + kvs * 13, f"{tensors} tensor infos and {kvs} key-values")
    return tensors, kvs


def _key_value(cursor: _Cursor, index: int) -> tuple[str, object]:
    key = cursor.string(f"key-value #{index}", keep=True)
    kind = cursor.scalar("I", f"key {key!r:.80} (its type)")
    if key == "general.alignment":
        if kind != UINT32:
            raise ModelError(f"{cursor.where}: general.alignment has type {kind}, not uint32")
        value = cursor.scalar("I", key)
        if value == 0 or value & (value - 1) or value > 1 << 20:
            raise ModelError(f"{cursor.where}: general.alignment {value} is not a power of two up to 1 MiB")
        return key, value
    _skip_value(cursor, kind, f"key {key!r:.80}", nested=False)
    return key, None


def _skip_value(cursor: _Cursor, kind: int, field: str, nested: bool) -> None:
    if kind in SCALARS:
        cursor.skip(struct.calcsize(SCALARS[kind]), field)
    elif kind == STRING:
        cursor.string(field, keep=False)
    elif kind == ARRAY and not nested:
        element = cursor.scalar("I", f"{field} (its element type)")
        count = cursor.scalar("Q", f"{field} (its element count)")
        if element in SCALARS:
            cursor.skip(count * struct.calcsize(SCALARS[element]), f"{field}: {count} elements")
        elif element == STRING:
            cursor.need(count * 8, f"{field}: {count} strings")  # each one's length, at least
            for i in range(count):
                cursor.string(f"{field}[{i}]", keep=False)
        else:
            _skip_value(cursor, element, f"{field} (its elements)", nested=True)  # refuses it
    else:
        what = "an array of arrays, which gguf readers do not take" if kind == ARRAY else f"of type {kind}, which GGUF does not define"
        raise ModelError(f"{cursor.where}: {field} is {what}")


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, list[int], int, int]:
    name = cursor.string(f"tensor #{index} (its name)", keep=True)
    field = f"tensor {name!r:.80}"
    n_dims = cursor.scalar("I", f"{field} (its dim count)")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ModelError(f"{cursor.where}: tensor {name!r:.80} has {n_dims} dims; GGUF tensors have 1 to {MAX_DIMS}")
    dims = [cursor.scalar("Q", f"{field} (its dims)") for _ in range(n_dims)]
    kind = cursor.scalar("I", f"{field} (its type)")
    offset = cursor.scalar("Q", f"{field} (its offset)")
    return name, dims, kind, offset


def _check_data(cursor: _Cursor, infos: list, data_start: int) -> None:
    """Each tensor's bytes, from its type's block size, lie inside the file."""
    from gguf.constants import GGML_QUANT_SIZES  # only the table of block sizes

    data_bytes = cursor.size - data_start
    for name, dims, kind, offset in infos:
        if kind not in GGML_QUANT_SIZES:
            raise ModelError(f"{cursor.where}: tensor {name!r:.80} has type {kind}, which gguf does not know")
        block, block_bytes = GGML_QUANT_SIZES[kind]
        values = math.prod(dims)
        if values % block:
            raise ModelError(f"{cursor.where}: tensor {name!r:.80}: {values} values are not whole blocks of {block}")
        nbytes = values // block * block_bytes
        if offset + nbytes > data_bytes:
            raise ModelError(
                f"{cursor.where}: tensor {name!r:.80} claims bytes {offset}..{offset + nbytes} of the data, "
                f"which holds {max(data_bytes, 0)}; the GGUF file is damaged or crafted: download it again"
            )
