"""`kvexport validate`: one broken package per rule, each message checked."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from kvexport.cli.main import main
from kvexport.contract.package import sha256_file
from kvexport.contract.validate import validate_package


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_a_good_package_passes(tiny_package):
    result = run("validate", str(tiny_package("tiny-llama")))
    assert result.exit_code == 0
    assert result.stdout.strip().endswith("their specs, step widths and the weights they bind)")
    assert len(result.stdout.strip().splitlines()) == 1
    info = json.loads(run("validate", str(tiny_package("tiny-qwen2")), "--json").stdout)
    assert info["ok"] is True and info["violations"] == []


def broken(tmp_path, source, edit_manifest=None, edit_files=None):
    target = tmp_path / "pkg"
    shutil.copytree(source, target)
    manifest = json.loads((target / "manifest.json").read_text())
    if edit_files:
        edit_files(target, manifest)
    if edit_manifest:
        edit_manifest(manifest)
    (target / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
    return target


def refresh_checksum(target, manifest, rel):
    manifest["files"][rel] = {"sha256": sha256_file(target / rel), "bytes": (target / rel).stat().st_size}


def swap_programs(target, manifest):
    shutil.copy(target / "programs/forward_4.json.gz", target / "programs/forward_1.json.gz")
    refresh_checksum(target, manifest, "programs/forward_1.json.gz")


def corrupt_weights(target, manifest):
    with open(target / "weights.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x01" * 8)


def others_not_wider(m):
    for spec in m["methods"]["forward_others"]["inputs"]:
        for dim in spec["shape"]:
            if isinstance(dim, dict) and dim["name"] == "T":
                dim.update(min=2, max=4)
    m["metadata"]["get_max_seq_len"] = 4


RULES = [
    (dict(edit_manifest=lambda m: m["contract"].update(version=7)), "contract.version: offgraph_kv version 7 is not supported"),
    (dict(edit_manifest=lambda m: m.update(format_version=9)), "format_version"),
    (dict(edit_files=corrupt_weights), "files.weights.safetensors: checksum differs"),
    (dict(edit_files=lambda t, m: (t / "programs" / "stray.bin").write_bytes(b"x")), "files.programs/stray.bin: in the package but not in the manifest"),
    (dict(edit_manifest=lambda m: m["methods"].update(forward_x=m["methods"]["forward_1"])), "methods.forward_x: not a contract method name"),
    (dict(edit_manifest=lambda m: m["methods"].pop("sample")), "methods.sample_argmax: only allowed together with sample"),
    (dict(edit_manifest=lambda m: m["methods"]["forward_1"]["inputs"][0].update(dtype="int32")), "methods.forward_1.inputs[0] (tokens): expected tokens int64 [1, 1]"),
    (dict(edit_manifest=lambda m: m["methods"]["forward_4"]["inputs"][1].update(shape=[3])), "methods.forward_4.inputs[1] (input_pos): expected input_pos int64 [4]"),
    (dict(edit_manifest=others_not_wider), "methods.forward_others: T up to 4 is not wider than forward_4"),
    (dict(edit_manifest=lambda m: m["metadata"].update(get_vocab_size=1000)), "methods.forward_1.outputs[0] (logits): expected logits float32 [1, 1000]"),
    (dict(edit_manifest=lambda m: m["metadata"].update(get_head_dims=[16])), "metadata.get_head_dims: has 1 entries, get_n_caches is 2"),
    (dict(edit_manifest=lambda m: m["metadata"].update(get_offgraph_kv_max_cells=20)), "metadata.get_offgraph_kv_max_cells: 20 must be above the widest step get_max_seq_len=24"),
    (dict(edit_manifest=lambda m: m["metadata"].update(get_min_prefill_chunk=30)), "metadata.get_min_prefill_chunk: 30 exceeds get_max_seq_len=24"),
    (dict(edit_manifest=lambda m: m["metadata"].update(forward_sizes=[1, 2, 4])), "metadata.forward_sizes: [1, 2, 4] does not match the methods [1, 4]"),
    (dict(edit_manifest=lambda m: m["methods"]["forward_4"].update(step_width="1-0")), "methods.forward_4.step_width: step width '1-0' is malformed"),
    (dict(edit_manifest=lambda m: m["methods"]["forward_4"].update(step_width="12:0")), "methods.forward_4.step_width: step width '12:0': input 12 does not exist; the program takes 9 inputs"),
    (dict(edit_manifest=lambda m: m["methods"]["forward_others"].update(step_width="7:0")), "methods.forward_others.step_width: step width '7:0': input 7 (state_4) does not feed the positions; positions come from input 1 (input_pos)"),
    (dict(edit_manifest=lambda m: m["methods"]["forward_others"].update(step_width="1:1")), "methods.forward_others.step_width: step width '1:1': dim 1 is not the step"),
    (dict(edit_files=swap_programs), "methods.forward_1.inputs[0] (tokens): dim 1 is 4 in the program, the manifest says 1"),
]


@pytest.mark.parametrize("change,message", RULES, ids=[r[1][:40] for r in RULES])
def test_each_rule(tmp_path, tiny_package, change, message):
    target = broken(tmp_path, tiny_package("tiny-llama"), **change)
    report = validate_package(target)
    assert not report.ok
    assert any(message in v for v in report.violations), report.violations
    result = run("validate", str(target))
    assert result.exit_code == 1
    assert message in result.stderr


def test_every_violation_is_listed(tmp_path, tiny_package):
    def two(target, manifest):
        corrupt_weights(target, manifest)
        manifest["methods"]["forward_4"]["step_width"] = "x"

    report = validate_package(broken(tmp_path, tiny_package("tiny-llama"), edit_files=two))
    assert any("checksum" in v for v in report.violations)
    assert any("forward_4.step_width" in v for v in report.violations)
    info = json.loads(run("validate", str(tmp_path / "pkg"), "--json").stdout)
    assert info["ok"] is False and len(info["violations"]) >= 2


def test_not_a_package(tmp_path):
    result = run("validate", str(tmp_path))
    assert result.exit_code == 1
    assert "manifest.json is missing" in result.stderr
