"""Reference tokens: export stores the model's own greedy tokens on probe
prompts, refuses a package whose runtime does not reproduce them, and
`kvexport verify` reruns them from the package alone; a package whose
weights were changed and whose checksums were fixed up validates, but does
not verify."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from helpers import export_tiny
from kvexport.cli.main import _check_package, main
from kvexport.contract.errors import KvexportError
from kvexport.contract.package import sha256_file
from kvexport.contract.validate import validate_package
from kvexport.passes.base import Pass


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_export_stores_probes_that_the_package_reproduces(tiny_package):
    package = tiny_package("tiny-llama")
    reference = json.loads((package / "manifest.json").read_text())["reference"]
    assert [p["name"] for p in reference["probes"]] == ["chat", "wide", "short"] == reference["batch"]
    wide = next(p for p in reference["probes"] if p["name"] == "wide")
    assert len(wide["prompt"]) > 4  # wider than the widest static method (TINY_LAYOUT: 1, 4)
    assert all(len(p["tokens"]) == reference["steps"] == 8 for p in reference["probes"])
    result = run("verify", package)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("verified: 3 probes") and "alone and batched" in result.output


def test_changed_weights_with_fixed_checksums_validate_but_do_not_verify(tmp_path, tiny_package):
    package = tmp_path / "pkg"
    shutil.copytree(tiny_package("tiny-llama"), package)
    weights = package / "weights.safetensors"
    tensors = load_file(weights)
    name = next(k for k in sorted(tensors) if "mlp" in k and k.endswith("weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, weights, metadata={"format": "pt"})
    manifest = json.loads((package / "manifest.json").read_text())
    manifest["files"]["weights.safetensors"] = {"sha256": sha256_file(weights), "bytes": weights.stat().st_size}
    (package / "manifest.json").write_text(json.dumps(manifest))
    assert validate_package(package).ok
    result = run("verify", package, "--json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["ok"] is False and report["differences"][0].startswith("probe chat (alone), step 0")


class BreakAnAdd(Pass):
    """Turns the first add of the forward methods into a subtract: a backend
    that miscompiles."""

    name = "break_an_add"

    def call(self, graph_module):
        for node in graph_module.graph.nodes:
            if node.target is torch.ops.aten.add.Tensor:
                node.target = torch.ops.aten.sub.Tensor
                return graph_module, True
        return graph_module, False


def test_export_refuses_a_package_that_does_not_reproduce_its_model(tmp_path):
    out = tmp_path / "pkg"
    with pytest.raises(KvexportError, match=r"the exported package differs from its reference: probe \w+ \(alone\), step \d+: .*it was not written"):
        export_tiny("tiny-llama", out, forward_sizes="1,4", max_step_tokens=16, check_package=_check_package,
                    transform_passes=[BreakAnAdd()])
    assert not out.exists()


def test_quantized_reference_records_its_agreement_with_float(tmp_path):
    path = export_tiny("tiny-llama", tmp_path / "q", forward_sizes="1,4", max_step_tokens=16, qlinear="8w",
                       check_package=_check_package).path
    reference = json.loads((path / "manifest.json").read_text())["reference"]
    assert 0.0 <= reference["fp32_agreement"] <= 1.0
    refused = run("verify", path, "--against", "tiny-llama")
    assert refused.exit_code == 1 and "quantized" in refused.output and "Traceback" not in refused.output


def test_no_verify_stores_nothing_and_verify_says_so(tmp_path):
    path = export_tiny("tiny-qwen2", tmp_path / "plain", forward_sizes="1,4", max_step_tokens=16, verify=False).path
    assert "reference" not in json.loads((path / "manifest.json").read_text())
    result = run("verify", path)
    assert result.exit_code == 1 and "holds no reference tokens" in result.output and "--against" in result.output
    against = run("verify", path, "--against", "tiny-qwen2")
    assert against.exit_code == 0 and "tiny-qwen2 run by its own Hugging Face code" in against.output


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["probes"][0].update(tokens=r["probes"][0]["tokens"][:2]), "reference.probes[0].tokens"),
    (lambda r: r.update(batch=["nobody"]), "reference.batch"),
    (lambda r: r["probes"][1].update(prompt=[1, -2]), "reference.probes[1].prompt"),
])
def test_a_malformed_reference_is_named(tmp_path, tiny_package, edit, message):
    package = tmp_path / "pkg"
    shutil.copytree(tiny_package("tiny-llama"), package)
    manifest = json.loads((package / "manifest.json").read_text())
    edit(manifest["reference"])
    (package / "manifest.json").write_text(json.dumps(manifest))
    report = validate_package(package)
    assert not report.ok and any(message in v for v in report.violations)
