"""Packages are data: what a hostile package (checksums fixed up to match)
can and cannot make validate, inspect and load do."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from helpers import prompt_of
from kvexport.cli.main import main
from kvexport.runtime import generate, load
from kvexport.contract.errors import PackageError
from kvexport.contract.package import sha256_file
from kvexport.contract.program_check import UnsafeProgram, check_target, parse_sym_expr
from kvexport.contract.validate import validate_package

CANARY = "kvexport-canary"


def copy(tmp_path, tiny_package, name="pkg"):
    target = tmp_path / name
    shutil.copytree(tiny_package("tiny-llama"), target)
    return target


def manifest_of(pkg):
    return json.loads((pkg / "manifest.json").read_text())


def save_manifest(pkg, manifest):
    (pkg / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))


def fix_checksums(pkg):
    """What an attacker does after editing files: the package's own
    checksums then match again."""
    manifest = manifest_of(pkg)
    for rel in manifest["files"]:
        path = pkg / rel
        if path.is_file() and not path.is_symlink():
            manifest["files"][rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    save_manifest(pkg, manifest)


def edit_program(pkg, method, edit):
    path = pkg / "programs" / f"{method}.json.gz"
    program = json.loads(gzip.decompress(path.read_bytes()))
    edit(program)
    path.write_bytes(gzip.compress(json.dumps(program).encode()))
    fix_checksums(pkg)


def expr_strs(program):
    stack = [program]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("expr_str"), str):
                yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def run_all_methods(pkg, **options):
    rt = load(pkg, **options)
    for name in rt.package.manifest["methods"]:
        rt.package.method(name)
    return generate(rt, [prompt_of(30, 1)], max_new_tokens=3)  # 30 tokens: forward_others runs


# ------------------------------------------------------------- expressions
def test_expression_injection_never_runs(tmp_path, tiny_package):
    """The attack from the issue: Python inside a symbolic size. Before, it
    validated as ok, generated normal tokens and ran the command."""
    pkg = copy(tmp_path, tiny_package)
    canary = tmp_path / CANARY
    payload = f"Mul(Integer(16), __import__('os').system('touch {canary}'))"

    def inject(program):
        next(iter(expr_strs(program)))["expr_str"] = payload

    edit_program(pkg, "forward_others", inject)
    report = validate_package(pkg)
    assert not report.ok
    assert any("methods.forward_others.program" in v and "__import__" in v for v in report.violations), report.violations
    with pytest.raises(PackageError, match="forward_others"):
        run_all_methods(pkg)
    result = CliRunner().invoke(main, ["generate", str(pkg), "--prompt-ids", ",".join(map(str, prompt_of(30, 1)))])
    assert result.exit_code == 1 and "internal error" not in result.output
    assert not canary.exists()


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "Symbol('s1').__class__",
        "Symbol('s1', positive=__import__('os'))",
        "Integer(1.5)",
        "Symbol('s1; import os')",
        "lambda: 0",
        "Add(" * 2000 + "Integer(1)" + ")" * 2000,
        "Integer(1) + Integer(2)",
        "eval('1')",
    ],
)
def test_the_expression_grammar_refuses(text):
    with pytest.raises(UnsafeProgram):
        parse_sym_expr(text)


def test_expressions_sympy_would_spend_seconds_on_are_refused_before_it_sees_them(tmp_path, tiny_package):
    """Found in review: sympy compares Min and Max arguments pairwise; 280
    symbols in one Max took 25 s to build (40, which fit the 4096 characters
    an expression may have, about 2 s), and a program may hold many."""
    wide = "Max(" + ", ".join(f"Symbol('s{i}', positive=True, integer=True)" for i in range(40)) + ")"
    t0 = time.perf_counter()
    with pytest.raises(UnsafeProgram, match="40 symbols and integers"):
        parse_sym_expr(wide)
    nested = "Max(" + ", ".join(f"Min(Symbol('s{i}'), Symbol('t{i}'))" for i in range(7)) + ")"
    with pytest.raises(UnsafeProgram, match="14 symbols"):
        parse_sym_expr(nested)
    assert time.perf_counter() - t0 < 1
    pkg = copy(tmp_path, tiny_package)

    def many(program):
        for i, item in enumerate(expr_strs(program)):
            item["expr_str"] = f"Add(Symbol('s{i}', positive=True, integer=True), Integer(1))"

    edit_program(pkg, "forward_others", many)
    report = validate_package(pkg)
    assert any("distinct symbolic expressions (at most" in v for v in report.violations), report.violations


def test_the_expression_grammar_builds_what_torch_writes():
    s27 = "Symbol('s27', positive=True, integer=True)"
    assert str(parse_sym_expr(f"Mul(Integer(16), {s27})")) == "16*s27"
    assert str(parse_sym_expr(f"Min(Integer(16), Mul(Integer(2), {s27}))")) == "Min(16, 2*s27)"
    assert str(parse_sym_expr(f"FloorDiv({s27}, Integer(-2))")) == "(s27//(-2))"
    assert parse_sym_expr(s27).name == "s27"


def test_deserializer_never_calls_sympify_on_package_text(tiny_package, monkeypatch):
    """Defence in depth: even past the allowlist, loading builds the
    expressions itself."""
    import sympy

    calls = []
    real = sympy.sympify
    monkeypatch.setattr(sympy, "sympify", lambda *a, **k: calls.append(a) or real(*a, **k))
    rt = load(tiny_package("tiny-llama"))
    rt.package.method("forward_others")
    assert not [a for a in calls if isinstance(a[0], str)]


# ----------------------------------------------------------------- targets
@pytest.mark.parametrize(
    "target",
    ["torch.ops.aten.from_file.default", "torch.ops.higher_order.cond", "builtins.eval", "torch.os.system", "torch.load", "#ext"],
)
def test_node_targets_outside_the_allowlist_are_refused(tmp_path, tiny_package, target):
    pkg = copy(tmp_path, tiny_package)

    def retarget(program):
        program["graph_module"]["graph"]["nodes"][0]["target"] = target

    edit_program(pkg, "forward_1", retarget)
    report = validate_package(pkg)
    assert any("methods.forward_1.program" in v and target in v for v in report.violations), report.violations
    with pytest.raises(PackageError, match=f"forward_1.*{target[:10]}"):
        load(pkg).package.method("forward_1")


def test_allowed_targets():
    assert check_target("torch.ops.aten.mm.default") is None
    assert check_target("_operator.getitem") is None
    assert check_target("torch.ops.aten.set_.source_Storage") is not None
    assert check_target("torch.ops.aten.mm") is not None


# ------------------------------------------------------------------- paths
@pytest.mark.parametrize("bad", ["/etc/hostname", "../outside.safetensors", "programs/../../outside", "a\\b", ""])
def test_paths_that_leave_the_package_are_refused(tmp_path, tiny_package, bad):
    pkg = copy(tmp_path, tiny_package)
    (tmp_path / "outside.safetensors").write_bytes((pkg / "weights.safetensors").read_bytes())
    manifest = manifest_of(pkg)
    manifest["weights"]["file"] = bad
    manifest["files"][bad] = manifest["files"]["weights.safetensors"]
    save_manifest(pkg, manifest)
    report = validate_package(pkg)
    assert any(repr(bad) in v for v in report.violations), report.violations
    with pytest.raises(PackageError):
        load(pkg)


def test_no_oracle_for_files_outside(tmp_path, tiny_package):
    """Whether a file outside exists must not change the answer."""
    answers = []
    for target in ("../../etc/hostname", "../../no/such/file"):
        pkg = copy(tmp_path, tiny_package, name=f"pkg{len(answers)}")
        manifest = manifest_of(pkg)
        manifest["files"][target] = {"sha256": "0" * 64, "bytes": 1}
        save_manifest(pkg, manifest)
        answers.append([v.replace(target, "X") for v in validate_package(pkg).violations])
    assert answers[0] == answers[1] and answers[0]


def test_symlinks_in_a_package_are_refused(tmp_path, tiny_package):
    pkg = copy(tmp_path, tiny_package)
    outside = tmp_path / "weights-elsewhere.safetensors"
    shutil.move(pkg / "weights.safetensors", outside)
    os.symlink(outside, pkg / "weights.safetensors")  # same bytes, so the checksum matches
    report = validate_package(pkg)
    assert any("weights.safetensors: a symlink" in v for v in report.violations), report.violations
    with pytest.raises(PackageError, match="symlink"):
        load(pkg)
    with pytest.raises(PackageError, match="symlink"):
        load(pkg, verify=False)


def test_a_fifo_in_a_package_never_hangs(tmp_path, tiny_package):
    pkg = copy(tmp_path, tiny_package)
    os.mkfifo(pkg / "programs" / "pipe")
    report = validate_package(pkg)
    assert any("programs/pipe: not a regular file" in v for v in report.violations), report.violations


# ------------------------------------------------------ what validate checks
def test_validate_compares_dynamic_ranges_with_the_graph(tmp_path, tiny_package):
    """The manifest claims a wider forward_others than was exported."""
    pkg = copy(tmp_path, tiny_package)
    manifest = manifest_of(pkg)
    for spec in manifest["methods"]["forward_others"]["inputs"] + manifest["methods"]["forward_others"]["outputs"]:
        for dim in spec["shape"]:
            if isinstance(dim, dict) and dim["name"] in ("T", "K"):
                dim["max"] = 200
    manifest["metadata"]["get_max_seq_len"] = 200
    save_manifest(pkg, manifest)
    report = validate_package(pkg)
    assert any("ranges over" in v and "the manifest says" in v and "200" in v for v in report.violations), report.violations


@pytest.mark.parametrize(
    "key, value",
    [("get_offgraph_kv_max_cells", 2**62), ("get_vocab_size", 2**40), ("get_max_context_len", 2**40), ("get_n_caches", 10**6)],
)
def test_sizes_are_capped_before_anything_is_allocated(tmp_path, tiny_package, key, value):
    pkg = copy(tmp_path, tiny_package)
    manifest = manifest_of(pkg)
    manifest["metadata"][key] = value
    save_manifest(pkg, manifest)
    report = validate_package(pkg)
    assert any(f"metadata.{key}: expected int in 1.." in v for v in report.violations), report.violations
    with pytest.raises(PackageError, match=key):
        load(pkg)


def test_validate_checks_the_weights_against_the_bindings(tmp_path, tiny_package):
    pkg = copy(tmp_path, tiny_package)
    tensors = load_file(pkg / "weights.safetensors")
    name = next(k for k in tensors if k.endswith("o_proj.weight"))
    tensors[name] = tensors[name][:-1].clone()
    dropped = next(k for k in tensors if k.endswith("down_proj.weight"))
    del tensors[dropped]
    save_file(tensors, pkg / "weights.safetensors")
    fix_checksums(pkg)
    report = validate_package(pkg)
    assert any(name in v and "the weights file holds" in v for v in report.violations), report.violations
    assert any(dropped in v and "is not in the weights file" in v for v in report.violations), report.violations


@pytest.mark.parametrize(
    "content",
    [b"not gzip", gzip.compress(b"{not json", mtime=0), gzip.compress(b"[1, 2]", mtime=0),
     gzip.compress(b'{"graph_module": 3}', mtime=0), gzip.compress(b"[" * 100000 + b"]" * 100000, mtime=0)],
    ids=["not gzip", "not json", "a list", "no graph", "deep nesting"],
)
def test_malformed_programs_are_listed_not_raised(tmp_path, tiny_package, content):
    pkg = copy(tmp_path, tiny_package)
    (pkg / "programs/forward_4.json.gz").write_bytes(content)
    fix_checksums(pkg)
    report = validate_package(pkg)
    assert any(v.startswith("methods.forward_4.program") for v in report.violations), report.violations
    with pytest.raises(PackageError, match="forward_4"):
        load(pkg).package.method("forward_4")


@pytest.mark.parametrize("content", ["[1, 2]", "{", '"text"', "null", "[" * 100000])
def test_inspect_and_validate_refuse_a_malformed_manifest_clearly(tmp_path, tiny_package, content):
    pkg = copy(tmp_path, tiny_package)
    (pkg / "manifest.json").write_text(content)
    for command in ("inspect", "validate"):
        result = CliRunner().invoke(main, [command, str(pkg)])
        assert result.exit_code == 1, (command, result.output)
        assert "internal error" not in result.output and "manifest.json" in result.output


# -------------------------------------------------------------------- pools
def test_pools_are_zeroed_whatever_the_allocator_returns(tiny_package):
    def nan_allocator(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device) if dtype.is_floating_point else torch.full(shape, -7, dtype=dtype, device=device)

    pkg = tiny_package("tiny-llama")
    prompts = [prompt_of(13, 3), prompt_of(5, 4)]
    expected = generate(load(pkg), prompts, max_new_tokens=6)
    assert generate(load(pkg, allocator=nan_allocator), prompts, max_new_tokens=6) == expected


def test_a_wrong_allocator_is_named(tiny_package):
    from kvexport.contract.errors import RuntimeRefusal

    with pytest.raises(RuntimeRefusal, match="the allocator returned"):
        load(tiny_package("tiny-llama"), allocator=lambda shape, dtype, device: torch.zeros(1))
