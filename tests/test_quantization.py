"""Weight quantization on both backends: tokens equal the same
model quantized eagerly, batching holds, the coverage report names every
linear and embedding, weights are stored as plain tensors and a package runs
without torchao or pickle."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from helpers import export_tiny, hf_greedy, prompt_of
from kvexport.cli.main import main
from kvexport.exporter.sources.models import load_model
from kvexport.exporter.quantization.quantize import quantize_model
from kvexport.runtime import generate, load
from kvexport.contract import schemes
from kvexport.contract.errors import SpecError
from kvexport.contract.validate import validate_package

SCHEMES = ("8w", "4w", "8da4w")


@pytest.fixture(scope="module")
def quantized(tiny_package):
    def get(model: str, scheme: str, backend: str = "portable", **extra):
        return tiny_package(model, backend, qlinear=scheme, qembedding="8w", **extra)

    return get


# aoti: 4w and 8da4w only (a compiled quantized package takes a minute to
# build); the 4w package's LM head, tied to the 8w embedding, runs the same
# 8-bit product an 8w linear does
@pytest.mark.parametrize(
    "model,backend,scheme",
    [(m, "portable", s) for s in SCHEMES for m in ("tiny-llama", "tiny-qwen2")]
    + [pytest.param("tiny-llama", "aoti", s, marks=pytest.mark.compile) for s in ("4w", "8da4w")],
)
def test_tokens_equal_the_eagerly_quantized_model(quantized, model, scheme, backend):
    """(On aoti for x86 the 4w package takes rounded activations by default,
    each linear's by its codes' width: the eager model is quantized as its
    coverage says.)"""
    package = quantized(model, scheme, backend)
    coverage = json.loads((package / "manifest.json").read_text())["quantization"]["coverage"]
    qact = schemes.BY_WIDTH if any(r.get("activations") in schemes.ROUNDED for r in coverage) else "none"
    eager = load_model(model).model
    quantize_model(eager, scheme, 0, "8w", qact=qact)
    runtime = load(package)
    prompts = [prompt_of(5, seed=1), prompt_of(30, seed=2)]  # one static method's width, and past forward_others'
    want = [hf_greedy(eager, p, 16) for p in prompts]
    assert [generate(runtime, [p], 16)[0] for p in prompts] == want  # alone
    assert generate(runtime, prompts, 16) == want  # batched


def test_coverage_names_every_linear_and_embedding(quantized):
    path = quantized("tiny-qwen2", "4w")
    manifest = json.loads((path / "manifest.json").read_text())
    rows = manifest["quantization"]["coverage"]
    model = load_model("tiny-qwen2").model
    modules = {n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    assert {r["module"] for r in rows} == modules
    assert all(r["scheme"] or r["skipped"] for r in rows)  # nothing skipped silently
    assert {r["scheme"] for r in rows if r["kind"] == "linear" and not r.get("shared_with")} == {"4w"}
    assert [r["scheme"] for r in rows if r["kind"] == "embedding"] == ["8w"]
    shared = {r["module"]: r for r in json.loads((quantized("tiny-llama", "4w") / "manifest.json").read_text())["quantization"]["coverage"]}
    assert shared["lm_head"]["scheme"] == "8w" and shared["lm_head"]["shared_with"] == "model.embed_tokens"
    assert validate_package(path).ok
    assert "quantization: qlinear 4w" in CliRunner().invoke(main, ["inspect", str(path)]).stdout


def test_tied_weights_are_shared_only_as_one_int8_table():
    def rows(qlinear, qembedding):
        model = load_model("tiny-llama").model
        return {r["module"]: r for r in quantize_model(model, qlinear, 0, qembedding)}, model

    alone, model = rows("8w", "")  # the table stays fp32: so does its head
    assert "tied with model.embed_tokens.weight" in alone["lm_head"]["skipped"]
    assert alone["model.embed_tokens"]["skipped"].startswith("no --qembedding")
    for qlinear in ("8w", "4w"):
        both, model = rows(qlinear, "8w")
        assert model.lm_head.words is model.model.embed_tokens.words  # one set of codes
        assert both["lm_head"]["scheme"] == "8w" and both["lm_head"]["shared_with"] == "model.embed_tokens"
        assert both["lm_head"]["granularity"] == both["model.embed_tokens"]["granularity"] == "per row"
        assert {r["scheme"] for m, r in both.items() if m != "lm_head" and r["kind"] == "linear"} == {qlinear}


def test_width_not_divisible_by_the_group_is_reported(tmp_path):
    result = export_tiny("tiny-qwen2", tmp_path / "pkg", qlinear="4w", qlinear_group_size=128)
    rows = json.loads((result.path / "manifest.json").read_text())["quantization"]["coverage"]
    linears = [r for r in rows if r["kind"] == "linear"]
    assert all(r["skipped"] and "not divisible by the group size 128" in r["skipped"] for r in linears if r["shape"][1] % 128)


def test_quantized_weights_are_stored_plain_once(quantized, tiny_package):
    path = quantized("tiny-llama", "8w")
    manifest = json.loads((path / "manifest.json").read_text())
    rows = {r["module"]: r for r in manifest["quantization"]["coverage"]}
    with safe_open(str(path / "weights.safetensors"), "pt") as f:
        stored = set(f.keys())
        for row in rows.values():
            assert f.get_tensor(row["stored"]["words"]).dtype == torch.int32  # codes packed 4 to a word
            assert f.get_tensor(row["stored"]["scale"]).dtype == torch.float32
    assert rows["lm_head"]["stored"] == rows["model.embed_tokens"]["stored"]  # the tied head is the table
    assert not any(name.startswith("lm_head.") for name in stored)  # stored once, the head's names are aliases
    assert {a for a in manifest["weights"]["aliases"] if a.startswith("lm_head.")}
    fp32 = json.loads((tiny_package("tiny-llama") / "manifest.json").read_text())["files"]["weights.safetensors"]["bytes"]
    assert manifest["files"]["weights.safetensors"]["bytes"] < 0.3 * fp32


RUN_WITHOUT_TORCHAO_OR_PICKLE = """
import pickle, sys, torch
sys.modules["torchao"] = None  # importing it fails
from kvexport.runtime import generate, load
def refuse(*args, **kwargs):
    raise AssertionError("unpickling")
class Refused(pickle.Unpickler):
    __init__ = refuse
pickle.load = pickle.loads = torch.load = refuse
pickle.Unpickler = Refused
print(generate(load(sys.argv[1]), [[5, 6, 7, 8]], 4, stop_at_eos=False)[0])
"""


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_package_runs_without_torchao_or_pickle(quantized, scheme):
    eager = load_model("tiny-llama").model
    quantize_model(eager, scheme, 0, "8w")
    run = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_TORCHAO_OR_PICKLE, str(quantized("tiny-llama", scheme))],
        capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == hf_greedy(eager, [5, 6, 7, 8], 4)


def test_min_prefill_chunk(quantized):
    path = quantized("tiny-llama", "8w", min_prefill_chunk=4)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["metadata"]["get_min_prefill_chunk"] == 4
    assert manifest["methods"]["forward_others"]["inputs"][2]["shape"][0] == {"name": "K", "min": 4, "max": 24}
    assert validate_package(path).ok
    eager = load_model("tiny-llama").model
    quantize_model(eager, "8w", 0, "8w")
    prompt = prompt_of(20, seed=9)  # one selected row in forward_others: padded to 4
    assert generate(load(path), [prompt], 8) == [hf_greedy(eager, prompt, 8)]


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(qlinear="3w"), "--qlinear must be one of 8w, 4w, gguf, 8da4w"),
        (dict(qlinear="4w", qlinear_group_size=24), "--qlinear-group-size must be a positive power of two"),
        (dict(qlinear="4w", qlinear_group_size=-32), "--qlinear-group-size must be a positive power of two"),
        (dict(qembedding="4w"), "--qembedding must be 8w"),
        (dict(min_prefill_chunk=0), "--min-prefill-chunk must be in 1..--max-step-tokens"),
    ],
)
def test_bad_quantization_flags(tmp_path, flags, message):
    with pytest.raises(SpecError, match=message):
        export_tiny("tiny-llama", tmp_path / "pkg", **flags)


