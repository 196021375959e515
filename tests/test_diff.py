"""`kvexport diff`: the same package is the same; each kind of change is
named where it is (a manifest key, a tensor, a file), with exit code 1."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from kvexport.cli.main import main
from kvexport.contract.validate import weights_layout
from kvexport.contract.package import PackageReader


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_a_package_is_the_same_as_its_copy(tmp_path, tiny_package):
    source = tiny_package("tiny-llama")
    shutil.copytree(source, tmp_path / "copy")
    result = run("diff", source, tmp_path / "copy")
    assert result.exit_code == 0 and result.stdout.startswith("same:")
    assert json.loads(run("diff", source, tmp_path / "copy", "--json").stdout) == {"same": True, "differences": []}


def test_changes_are_named_where_they_are(tmp_path, tiny_package):
    source = tiny_package("tiny-llama")
    changed = tmp_path / "changed"
    shutil.copytree(source, changed)
    manifest = json.loads((changed / "manifest.json").read_text())
    manifest["metadata"]["get_max_seq_len"] += 1
    manifest["methods"]["forward_4"]["step_width"] = 8
    (changed / "manifest.json").write_text(json.dumps(manifest))
    layout = weights_layout(PackageReader(changed))
    name = sorted(layout)[0]
    begin = layout[name][2][0]
    with open(changed / "weights.safetensors", "r+b") as f:  # one byte of one tensor
        f.seek(begin)
        byte = f.read(1)
        f.seek(begin)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = run("diff", source, changed, "--json")
    assert result.exit_code == 1
    where = {d["where"]: d for d in json.loads(result.stdout)["differences"]}
    assert set(where) == {"metadata.get_max_seq_len", "methods.forward_4.step_width", f"weights/{name}"}
    assert where["methods.forward_4.step_width"]["b"] == 8
    assert where[f"weights/{name}"]["a"].split(" ")[0] == where[f"weights/{name}"]["b"].split(" ")[0]  # same dtype and shape
    text = run("diff", source, changed).stdout
    assert text.startswith("3 difference(s)") and f"weights/{name}:" in text


def test_methods_and_files_present_in_one_only(tmp_path, tiny_package):
    source = tiny_package("tiny-llama")
    fewer = tmp_path / "fewer"
    shutil.copytree(source, fewer)
    manifest = json.loads((fewer / "manifest.json").read_text())
    program = manifest["methods"].pop("sample")["program"]
    manifest["files"].pop(program)
    (fewer / program).unlink()
    (fewer / "manifest.json").write_text(json.dumps(manifest))
    where = [d["where"] for d in json.loads(run("diff", source, fewer, "--json").stdout)["differences"]]
    assert where == ["methods.sample", f"files/{program}"]


def test_not_a_package_is_a_clear_error(tmp_path, tiny_package):
    result = CliRunner().invoke(main, ["diff", str(tiny_package("tiny-llama")), str(tmp_path)])
    assert result.exit_code == 1 and "not a kvexport package" in result.output and "Traceback" not in result.output
