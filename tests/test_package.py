"""The package on disk: manifest, one copy of the weights, no pickle, atomic
writes, and the loader's refusals."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

from helpers import export_tiny, prompt_of
from kvexport.exporter import pipeline
from kvexport.runtime import PackageError, generate, load
from kvexport.contract.errors import ExportError
from kvexport.contract.package import sha256_file

METADATA_KEYS = {
    "get_max_context_len", "get_max_seq_len", "get_vocab_size", "get_logits_to_keep_mode", "get_n_caches",
    "get_kv_heads", "get_head_dims", "get_windows", "get_offgraph_kv_max_cells", "get_min_prefill_chunk",
    "bos_id", "eos_ids", "dtype", "forward_sizes",
}


def read_manifest(path):
    return json.loads((path / "manifest.json").read_text())


def test_manifest_holds_the_contract(tiny_package):
    path = tiny_package("tiny-llama")
    text = (path / "manifest.json").read_text()
    manifest = json.loads(text)
    assert text == json.dumps(manifest, indent=1, sort_keys=True) + "\n"  # sorted JSON
    assert manifest["contract"] == {"name": "offgraph_kv", "version": 1}
    md = manifest["metadata"]
    assert METADATA_KEYS <= set(md)
    assert md["get_logits_to_keep_mode"] == 2 and md["get_n_caches"] == 2 and md["get_vocab_size"] == 1031
    assert set(manifest["methods"]) == {"forward_1", "forward_4", "forward_others", "sample", "sample_argmax"}
    for name, entry in manifest["methods"].items():
        if name.startswith("forward"):
            assert entry["step_width"] == "1:0"
            assert [i["name"] for i in entry["inputs"][:3]] == ["tokens", "input_pos", "logits_to_keep"]
    others = manifest["methods"]["forward_others"]["inputs"][0]["shape"][1]
    assert others == {"name": "T", "min": 5, "max": 24}
    prov = manifest["provenance"]
    assert prov["source"]["builtin"] == "tiny-llama" and prov["tools"]["torch"].startswith("2.")
    assert prov["recipe"]["forward_sizes"] == [1, 4]
    for rel, entry in manifest["files"].items():  # checksums of every file
        assert sha256_file(path / rel) == entry["sha256"]
    assert {"weights.safetensors", "programs/forward_1.json.gz"} <= set(manifest["files"])


def test_tied_weights_stored_once(tiny_package):
    manifest = read_manifest(tiny_package("tiny-llama"))
    assert manifest["weights"]["aliases"] == {"lm_head.weight": "decoder.embed_tokens.weight"}
    assert read_manifest(tiny_package("tiny-qwen2"))["weights"]["aliases"] == {}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_weights_are_mapped_from_the_package_file(tiny_package):
    """Every weight tensor lies in a mapping of the package's weights file
    (page cache, shared between processes), not in private memory."""
    runtime = load(tiny_package("tiny-llama"))
    weights = str(runtime.package.reader.weights_path.resolve())
    spans = []
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == weights:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    assert spans, "the weights file is not mapped"
    for name, tensor in runtime.package.tensors.items():
        ptr = tensor.data_ptr()
        assert any(start <= ptr < end for start, end in spans), name


def test_one_copy_of_the_weights_in_memory(tiny_package):
    runtime = load(tiny_package("tiny-llama"))
    storages = {t.untyped_storage().data_ptr() for t in runtime.package.tensors.values()}
    for name in runtime.package.manifest["methods"]:
        if not name.startswith("forward"):
            continue
        program = runtime.package.method(name)
        for tensor in list(program.parameters()) + list(program.buffers()):
            assert tensor.untyped_storage().data_ptr() in storages, name


def test_loading_never_unpickles(tiny_package, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling during load")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    runtime = load(tiny_package("tiny-qwen2"))
    assert len(generate(runtime, [prompt_of(12, seed=1)], 4)[0]) == 4


def test_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
    original = pipeline.torch_compat.graph_to_json
    calls = []

    def interrupt_late(program):
        calls.append(1)
        if len(calls) == 3:  # while programs are being written
            raise KeyboardInterrupt
        return original(program)

    monkeypatch.setattr(pipeline.torch_compat, "graph_to_json", interrupt_late)
    with pytest.raises(KeyboardInterrupt):
        export_tiny("tiny-llama", tmp_path / "pkg")
    assert list(tmp_path.iterdir()) == []


def test_failed_export_keeps_the_old_package(tmp_path, tiny_package, monkeypatch):
    target = tmp_path / "pkg"
    shutil.copytree(tiny_package("tiny-llama"), target)
    before = sorted(p.name for p in target.rglob("*"))

    def fail(plans, progress):
        raise ExportError("tracing forward_1 failed: boom")

    monkeypatch.setattr(pipeline, "trace_methods", fail)
    with pytest.raises(ExportError):
        export_tiny("tiny-llama", target, overwrite=True)
    assert sorted(p.name for p in target.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir()] == ["pkg"]


def test_existing_output_needs_overwrite(tmp_path):
    (tmp_path / "pkg").mkdir()
    with pytest.raises(ExportError, match="--overwrite"):
        export_tiny("tiny-llama", tmp_path / "pkg")


def broken_copy(tmp_path, source, edit):
    target = tmp_path / "broken"
    shutil.copytree(source, target)
    manifest = read_manifest(target)
    edit(manifest)
    (target / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
    return target


@pytest.mark.parametrize(
    "edit,key",
    [
        (lambda m: m["contract"].update(name="paged_kv"), "contract.name"),
        (lambda m: m["contract"].update(version=2), "contract.version"),
        (lambda m: m["metadata"].pop("get_vocab_size"), "metadata.get_vocab_size: missing"),
        (lambda m: m["metadata"].update(get_n_caches="2"), "metadata.get_n_caches: expected int in 1..1024"),
        (lambda m: m["metadata"].update(get_kv_heads=[2]), "metadata.get_kv_heads: has 1 entries"),
        (lambda m: m["metadata"].update(get_vocab_size=1000), "logits"),
        (lambda m: m["metadata"].update(get_offgraph_kv_max_cells=24), "metadata.get_offgraph_kv_max_cells"),
        (lambda m: m["metadata"].update(get_windows=[0, -1]), "metadata.get_windows"),
        (lambda m: m["metadata"].update(get_n_caches=3, get_kv_heads=[1024] * 3, get_head_dims=[4096] * 3, get_windows=[0] * 3),
         "metadata: a cell of 25165824 values"),
        (lambda m: m["methods"].pop("forward_4"), "metadata.forward_sizes"),
        (lambda m: m["methods"].update(forward_0=m["methods"]["forward_1"]), "methods.forward_0"),
        (lambda m: m.pop("metadata"), "metadata: missing"),
    ],
)
def test_load_refuses_bad_metadata_naming_the_key(tmp_path, tiny_package, edit, key):
    path = broken_copy(tmp_path, tiny_package("tiny-llama"), edit)
    with pytest.raises(PackageError, match=key.replace("[", r"\[").replace(".", r"\.")):
        load(path)


def test_load_refuses_damaged_files(tmp_path, tiny_package):
    target = tmp_path / "pkg"
    shutil.copytree(tiny_package("tiny-llama"), target)
    with open(target / "programs" / "forward_4.json.gz", "r+b") as f:
        f.seek(40)
        f.write(b"\0\0\0\0")
    with pytest.raises(PackageError, match="programs/forward_4.json.gz: checksum"):
        load(target)


def test_load_refuses_non_packages(tmp_path):
    with pytest.raises(PackageError, match="no such package"):
        load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackageError, match="manifest.json is missing"):
        load(tmp_path / "empty")


def test_export_is_deterministic_in_names_and_graphs(tmp_path, tiny_package):
    again = export_tiny("tiny-llama", tmp_path / "again").path
    first, second = read_manifest(tiny_package("tiny-llama")), read_manifest(again)
    assert first["methods"] == second["methods"]
    assert first["weights"] == second["weights"]
    for rel in first["files"]:
        assert first["files"][rel]["sha256"] == second["files"][rel]["sha256"], rel


def test_re_export_is_byte_identical(tmp_path, monkeypatch):
    """Same inputs and recipe, another directory, another time: every file,
    the manifest included, has the same bytes (no output path, no clock)."""
    from kvexport.exporter.spec import build_spec

    def export(out):
        flags = dict(model="tiny-qwen2", output=str(out), use_offgraph_kv_cache=True, forward_sizes="1,4", max_step_tokens=16)
        spec = build_spec(flags=flags, command=["kvexport", "export", "tiny-qwen2", "-o", str(out), "--forward-sizes", "1,4"])
        return pipeline.export_package(spec, progress=lambda message: None).path

    first = export(tmp_path / "a" / "pkg")
    second = export(tmp_path / "elsewhere" / "pkg2")
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for rel in files:
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel
    manifest = read_manifest(first)
    assert "PKG" in manifest["provenance"]["command"] and "created_utc" not in manifest["provenance"]
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    dated = read_manifest(export(tmp_path / "dated"))
    assert dated["provenance"]["created_utc"] == "2023-11-14T22:13:20+00:00"


def test_bf16_package_runs(tmp_path):
    path = export_tiny("tiny-llama", tmp_path / "bf16", dtype="bf16", forward_sizes="1,4").path
    runtime = load(path)
    assert runtime.cache.pools[0].dtype == torch.bfloat16
    out = generate(runtime, [prompt_of(6, seed=3)], 8)[0]
    assert len(out) == 8 or out[-1] in runtime.eos_ids


def test_overwrite_only_replaces_packages(tmp_path):
    keep = tmp_path / "project"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not a kvexport package"):
        export_tiny("tiny-llama", keep, overwrite=True)
    assert (keep / "notes.txt").read_text() == "mine"


def test_min_prefill_chunk_is_optional(tmp_path, tiny_package):
    path = broken_copy(tmp_path, tiny_package("tiny-llama"), lambda m: m["metadata"].pop("get_min_prefill_chunk"))
    assert len(generate(load(path), [prompt_of(30, seed=1)], 3)[0]) >= 1


def test_a_gap_below_forward_others_is_refused(tmp_path, tiny_package):
    def gap(m):
        for spec in m["methods"]["forward_others"]["inputs"]:
            for dim in spec["shape"]:
                if isinstance(dim, dict) and dim["name"] == "T":
                    dim["min"] = 12

    with pytest.raises(PackageError, match="T from 12 leaves widths 5..11 that no method takes"):
        load(broken_copy(tmp_path, tiny_package("tiny-llama"), gap))


def test_unlisted_program_files_are_refused(tmp_path, tiny_package):
    def unlisted(m):
        m["files"].pop("programs/forward_4.json.gz")

    with pytest.raises(PackageError, match="programs/forward_4.json.gz"):
        load(broken_copy(tmp_path, tiny_package("tiny-llama"), unlisted))
