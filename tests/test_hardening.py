"""Export-side hardening: racing exports, stale partial directories, a bad
-o found before tracing, strictly typed recipe values, and inputs that used
to end in "internal error" (a broken model directory, non-int token ids)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from helpers import export_tiny
from kvexport.cli.main import main
from kvexport.exporter import pipeline
from kvexport.exporter.sources.models import load_model
from kvexport.exporter.spec import build_spec, parse_override
from kvexport.runtime import load
from kvexport.contract import package as pk
from kvexport.contract.errors import ExportError, ModelError, RuntimeRefusal, SpecError
from kvexport.runtime.offgraph import StepEntry, check_token_ids
from kvexport.contract.package import PackageWriter, check_output, remove_stale
from kvexport.runtime.single_sequence import IngraphKVManager

SMALL = ["--use-offgraph-kv-cache", "--forward-sizes", "1,2", "--max-step-tokens", "8", "--max-cells", "64"]
MANIFEST = {"format": "kvexport.package"}


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def expect_cli_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def writer_with(target, text: str, overwrite: bool = False) -> PackageWriter:
    writer = PackageWriter(target, overwrite=overwrite)
    writer.weights_path.write_text(text)
    return writer


def hidden(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------ races
def test_racing_exports_to_a_new_path_one_wins(tmp_path):
    target = tmp_path / "pkg"
    with writer_with(target, "first") as first, writer_with(target, "second") as second:
        first.commit(MANIFEST)
        with pytest.raises(ExportError, match="another export wrote .*pkg while this one ran"):
            second.commit(MANIFEST)
    assert (target / pk.WEIGHTS).read_text() == "first"
    assert hidden(tmp_path) == []  # the loser's partial directory is gone


def test_racing_overwrites_the_last_wins(tmp_path):
    target = tmp_path / "pkg"
    with writer_with(target, "old") as old:
        old.commit(MANIFEST)
    with writer_with(target, "a", overwrite=True) as a, writer_with(target, "b", overwrite=True) as b:
        a.commit(MANIFEST)
        b.commit(MANIFEST)
    assert (target / pk.WEIGHTS).read_text() == "b"
    assert hidden(tmp_path) == []  # no backup left behind


def test_overwrite_checks_again_at_commit(tmp_path):
    target = tmp_path / "pkg"
    with writer_with(target, "new", overwrite=True) as writer:
        target.mkdir()
        (target / "notes.txt").write_text("mine")  # someone put their work there meanwhile
        with pytest.raises(ExportError, match="not a kvexport package"):
            writer.commit(MANIFEST)
    assert (target / "notes.txt").read_text() == "mine"
    assert hidden(tmp_path) == []


# --------------------------------------------------------- stale partials
def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def fake_leftover(folder, name: str, age_s: float):
    path = folder / name
    (path / "programs").mkdir(parents=True)
    (path / "weights.safetensors").write_bytes(b"\0" * 64)
    then = time.time() - age_s
    for p in (path / "programs", path):
        os.utime(p, (then, then))
    return path


def test_stale_partials_of_dead_writers_are_removed(tmp_path, caplog):
    dead = dead_pid()
    stale = [fake_leftover(tmp_path, f".pkg.partial-{dead}-abcd1234", 600), fake_leftover(tmp_path, f".pkg.old-{dead}", 600)]
    kept = [
        fake_leftover(tmp_path, f".pkg.partial-{os.getpid()}-live0000", 600),  # its writer runs
        fake_leftover(tmp_path, f".pkg.partial-{dead}-fresh000", 5),  # too young to judge
        fake_leftover(tmp_path, f".other.partial-{dead}-abcd1234", 600),  # another target's
    ]
    with caplog.at_level(logging.INFO, logger="kvexport.contract.package"):
        with writer_with(tmp_path / "pkg", "w") as writer:
            writer.commit(MANIFEST)
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept)
    assert all(str(p) in caplog.text for p in stale) and "no longer running" in caplog.text


def test_partial_directory_names_its_writer(tmp_path):
    with PackageWriter(tmp_path / "pkg") as writer:
        assert writer.root.name.startswith(f".pkg.partial-{os.getpid()}-")
        assert remove_stale(tmp_path / "pkg", min_age=0) == []  # our own, alive


# ------------------------------------------------------------- bad -o early
@pytest.fixture
def no_model_loading(monkeypatch):
    """An -o error must come before the model is loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before -o was checked")

    monkeypatch.setattr(pipeline, "load_model", refuse)


def test_symlink_output_is_refused(tmp_path, no_model_loading):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    with pytest.raises(ExportError, match=f"link is a symlink to real; pass -o {tmp_path / 'real'}"):
        export_tiny("tiny-llama", tmp_path / "link", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


@pytest.mark.parametrize(
    "make,output,fragment",
    [
        (lambda d: (d / "afile").write_text("x"), "afile/pkg", "afile is a file, not a directory"),
        (lambda d: (d / "afile").write_text("x"), "afile/sub/pkg", "afile is a file, not a directory"),
        (lambda d: (d / "afile").write_text("x"), "afile", "afile is a file, not a kvexport package"),
        (lambda d: (d / "pkg").mkdir() or (d / "pkg" / "x").write_text("x"), "pkg", "not a kvexport package"),
        (lambda d: (d / "pkg").mkdir() or (d / "pkg" / "manifest.json").write_text(json.dumps(MANIFEST)), "pkg", "already exists"),
    ],
)
def test_bad_output_fails_before_loading(tmp_path, no_model_loading, make, output, fragment):
    make(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ExportError, match=fragment):
        export_tiny("tiny-llama", tmp_path / output)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_unwritable_output_directory(tmp_path, monkeypatch, no_model_loading):
    monkeypatch.setattr(pk.os, "access", lambda path, mode: False)
    with pytest.raises(ExportError, match="is not writable; choose an -o in a directory you can write to"):
        export_tiny("tiny-llama", tmp_path / "pkg")


def test_mkdtemp_failure_is_named(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pk.tempfile, "mkdtemp", denied)
    with pytest.raises(ExportError, match="cannot write .*pkg: Permission denied"):
        PackageWriter(tmp_path / "pkg")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_for_real(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(ExportError, match="ro is not writable"):
        check_output(tmp_path / "ro" / "pkg")


@pytest.mark.parametrize(
    "make,output,fragment",
    [
        (lambda d: (d / "link").symlink_to("elsewhere"), "link", "is a symlink to elsewhere; pass -o"),
        (lambda d: (d / "afile").write_text("x"), "afile/pkg", "is a file, not a directory"),
    ],
)
def test_cli_output_errors(tmp_path, make, output, fragment):
    make(tmp_path)
    expect_cli_error(run("export", "tiny-llama", "-o", str(tmp_path / output), "--overwrite", *SMALL), fragment)
    assert hidden(tmp_path) == []  # no `.link.old-*` left behind


# ---------------------------------------------------------- typed recipes
@pytest.mark.parametrize(
    "text,message",
    [
        ("overwrite=no", "--set overwrite=no: expected true or false"),
        ("overwrite=True", "--set overwrite=True: expected true or false"),
        ("overwrite=1", "--set overwrite=1: expected true or false"),
        ("use_offgraph_kv_cache=maybe", "--set use_offgraph_kv_cache=maybe: expected true or false"),
        ("max_cells=1.5", "--set max_cells=1.5: expected an integer"),
        ("max_cells=true", "--set max_cells=true: expected an integer"),
        ('max_cells="5"', '--set max_cells="5": expected an integer'),
        ("dtype=1", "--set dtype=1: expected a string"),
        ("forward_sizes=4", "--set forward_sizes=4: expected a list of sizes"),
    ],
)
def test_set_values_have_their_keys_type(text, message):
    with pytest.raises(SpecError) as info:
        parse_override(text)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "text,value",
    [("overwrite=true", True), ("max_cells=5", 5), ("dtype=bf16", "bf16"), ("forward_sizes=1,2", "1,2"), ("forward_sizes=[1, 2]", [1, 2])],
)
def test_set_values_of_the_right_type(text, value):
    assert parse_override(text)[1] == value


@pytest.mark.parametrize(
    "line,message",
    [
        ('overwrite = "yes"', 'overwrite = "yes": expected true or false'),
        ("use_offgraph_kv_cache = 1", "use_offgraph_kv_cache = 1: expected true or false"),
        ("max_cells = 1.0", "max_cells = 1.0: expected an integer"),
        ("max_step_tokens = false", "max_step_tokens = false: expected an integer"),
        ("dtype = 16", "dtype = 16: expected a string"),
    ],
)
def test_recipe_values_have_their_keys_type(tmp_path, line, message):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'model = "tiny-llama"\n{line}\n')
    with pytest.raises(SpecError) as info:
        build_spec(str(recipe), {"output": str(tmp_path / "pkg")})
    assert str(info.value) == f"{recipe}: {message}"


def test_set_overwrite_no_keeps_the_package(tmp_path):
    target = tmp_path / "pkg"
    target.mkdir()
    (target / "manifest.json").write_text(json.dumps(MANIFEST))
    expect_cli_error(run("export", "tiny-llama", "-o", str(target), "--set", "overwrite=no", *SMALL), "expected true or false")
    assert json.loads((target / "manifest.json").read_text()) == MANIFEST


# ------------------------------------------------------ broken model dirs
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    load_model("tiny-llama").model.save_pretrained(str(path))
    return path


def broken_model(tmp_path, source, edit):
    target = tmp_path / "model"
    shutil.copytree(source, target)
    edit(target)
    return target


def edit_config(**changes):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        config = {k: v for k, v in config.items() if v is not None}
        (path / "config.json").write_text(json.dumps(config))

    return edit


def truncate(path):
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


@pytest.mark.parametrize(
    "edit,fragment",
    [
        (edit_config(model_type="nosuchmodel"), "config.json: model_type 'nosuchmodel' is unknown"),
        (edit_config(architectures=None), 'config.json: no "architectures" list; add "architectures": ["LlamaForCausalLM"]'),
        (edit_config(architectures=[]), 'no "architectures" list'),
        (truncate, "model.safetensors: not a readable safetensors file"),
    ],
)
def test_broken_model_directory_is_named(tmp_path, model_dir, edit, fragment):
    path = broken_model(tmp_path, model_dir, edit)
    with pytest.raises(ModelError) as info:
        load_model(str(path))
    assert fragment.replace("; add", ", which names the model class; add") in str(info.value)
    assert str(path) in str(info.value)
    expect_cli_error(run("export", str(path), "-o", str(tmp_path / "pkg"), *SMALL), str(path))


# ---------------------------------------------------------------- tokens
@pytest.mark.parametrize("tokens", [[True, 2], [1, False], [None], [1.0], None, "12", [torch.tensor(True)]])
def test_token_ids_must_be_ints(tokens):
    with pytest.raises(RuntimeRefusal, match="token ids must be"):
        check_token_ids(tokens, 100, "test")


def test_token_ids_that_are_ints(tmp_path):
    import numpy as np

    check_token_ids([1, np.int64(2), torch.tensor(3)], 100, "test")


@pytest.mark.parametrize("tokens", [[True, 2], None, [None]])
def test_offgraph_step_refuses_non_int_tokens(tiny_package, tokens):
    runtime = load(tiny_package("tiny-llama"))
    session = runtime.new_session()
    with pytest.raises(RuntimeRefusal, match="token ids must be"):
        runtime.step([StepEntry(session, tokens)])
    assert session.length == 0


@pytest.mark.parametrize("tokens", [[True, 2], None, [None]])
def test_single_sequence_refuses_non_int_tokens(tokens):
    manager = object.__new__(IngraphKVManager)  # check() reads only these; no package needed
    manager.vocab_size, manager.position, manager.context = 100, 0, 32
    with pytest.raises(RuntimeRefusal, match="token ids must be"):
        manager.check(tokens)
