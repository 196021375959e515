"""The three contracts: offgraph_kv, ingraph_kv and hf_static, through
export, validate, inspect and generate; contract selection; the allocator
hook; the single-sequence capacity preflight."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from helpers import export_tiny, hf_greedy, prompt_of
from kvexport.cli.main import main
from kvexport.exporter.sources.models import load_model
from kvexport.runtime import IOManager, PackageError, generate, load, register_io_manager
from kvexport.contract.errors import CapacityError, SpecError
from kvexport.contract.validate import validate_package

SINGLE = ("ingraph_kv", "hf_static")


# the single-sequence contracts' tiny layout (test_fuzz_packages.py shares these packages)
SINGLE_SEQUENCE = dict(use_offgraph_kv_cache=False, max_step_tokens=16, max_context_len=128)


@pytest.fixture(scope="module")
def package(tiny_package):
    def get(contract: str, model: str = "tiny-llama"):
        if contract == "offgraph_kv":
            return tiny_package(model)
        return tiny_package(model, contract=contract, **SINGLE_SEQUENCE)

    return get


@pytest.mark.parametrize("contract", SINGLE)
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_greedy_parity(package, contract, model):
    runtime = load(package(contract, model))
    hf = load_model(model).model
    prompts = [prompt_of(5, seed=1), prompt_of(40, seed=2)]  # 40 > max step 16: chunked prefill
    assert generate(runtime, prompts, 32) == [hf_greedy(hf, p, 32) for p in prompts]


@pytest.mark.parametrize("contract", SINGLE)
def test_manifest_and_validate(package, contract):
    path = package(contract)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["contract"] == {"name": contract, "version": 1}
    assert set(manifest["methods"]) == {"forward"}
    forward = manifest["methods"]["forward"]
    assert [i["name"] for i in forward["inputs"][:2]] == ["tokens", "input_pos"]
    assert forward["outputs"][0]["shape"] == [1, 1031]
    md = manifest["metadata"]
    if contract == "ingraph_kv":
        assert md["use_kv_cache"] is True and md["enable_dynamic_shape"] is True and md["get_max_context_len"] == 128
        assert len(forward["inputs"]) == 2 and len(forward["state"]) == 4  # the cache is in the program
    else:
        caches = forward["inputs"][2:]
        assert [c["shape"] for c in caches] == [[1, 2, 128, 16]] * 4  # HF static layout
    assert md["get_max_seq_len"] == 16 and md["get_eos_ids"] == [2] and md["get_bos_id"] == 1
    # no cache byte is stored: the weights file holds the model alone
    offgraph = json.loads((package("offgraph_kv") / "manifest.json").read_text())
    assert manifest["files"]["weights.safetensors"]["bytes"] == offgraph["files"]["weights.safetensors"]["bytes"]
    assert validate_package(path).ok


@pytest.mark.parametrize(
    "contract,edit,message",
    [
        ("ingraph_kv", lambda m: m["metadata"].update(use_kv_cache=False), "metadata.use_kv_cache: expected true"),
        ("ingraph_kv", lambda m: m["metadata"].update(get_max_seq_len=500), "metadata.get_max_seq_len: 500 exceeds get_max_context_len=128"),
        ("hf_static", lambda m: m["methods"]["forward"]["inputs"][3].update(shape=[1, 2, 64, 16]), "methods.forward.inputs[3] (kv.0.v)"),
        ("hf_static", lambda m: m["metadata"].update(get_kv_heads=[2]), "metadata.get_kv_heads: has 1 entries, get_n_layers is 2"),
        ("hf_static", lambda m: m["methods"].update(sample=m["methods"]["forward"]), "exactly one method"),
        ("ingraph_kv", lambda m: m["contract"].update(version=3), "contract.version: ingraph_kv version 3 is not supported"),
    ],
)
def test_rules_per_contract(tmp_path, package, contract, edit, message):
    target = tmp_path / "pkg"
    shutil.copytree(package(contract), target)
    manifest = json.loads((target / "manifest.json").read_text())
    edit(manifest)
    (target / "manifest.json").write_text(json.dumps(manifest))
    report = validate_package(target)
    assert any(message in v for v in report.violations), report.violations
    with pytest.raises(PackageError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load(target)


class CountingAllocator:
    """Hands out tagged tensors and remembers them."""

    def __init__(self):
        self.handed: dict[int, str] = {}

    def __call__(self, shape, dtype, device):
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.handed[tensor.data_ptr()] = f"{tuple(shape)} {dtype}"
        return tensor


# cuda_graphs on the CPU: the graphs' fixed buffers (runtime/step_graphs.py) come from the allocator too
@pytest.mark.parametrize("contract, options", [("offgraph_kv", {}), ("offgraph_kv", {"cuda_graphs": True}),
                                               *[(c, {}) for c in SINGLE]], ids=["offgraph_kv", "offgraph_kv-graphs", *SINGLE])
def test_every_cache_and_io_buffer_comes_from_the_allocator(package, contract, options):
    allocator = CountingAllocator()
    runtime = load(package(contract), allocator=allocator, **options)
    fed = []
    original = runtime.package.method

    def method(name):
        program = original(name)

        def call(*args):
            fed.extend(a.data_ptr() for a in args)
            return program(*args)

        return call

    runtime.package.method = method
    out = generate(runtime, [prompt_of(20, seed=3)], 6)
    assert len(out[0]) >= 1
    forwards = [p for p in fed]
    assert forwards and all(ptr in allocator.handed for ptr in forwards)  # inputs, pools and caches alike
    if contract == "offgraph_kv":
        caches = runtime.cache.pools
    elif contract == "hf_static":
        caches = runtime.caches
    else:
        caches = runtime.state_buffers
    assert caches and all(c.data_ptr() in allocator.handed for c in caches)


@pytest.mark.parametrize("contract", SINGLE)
def test_capacity_preflight(package, contract):
    runtime = load(package(contract))
    runtime.step(prompt_of(100, seed=4))
    caches = [c.clone() for c in (runtime.caches or runtime.state_buffers)]
    with pytest.raises(CapacityError, match="past the context of 128"):
        runtime.step(prompt_of(29, seed=5))
    assert runtime.position == 100
    assert all(torch.equal(a, b) for a, b in zip(caches, runtime.caches or runtime.state_buffers))
    with pytest.raises(CapacityError, match="context of 128"):
        generate(runtime, [prompt_of(100, seed=6)], 29)


def test_offgraph_flag_with_another_contract_is_a_usage_error(tmp_path):
    with pytest.raises(SpecError, match="usage: --use-offgraph-kv-cache"):
        export_tiny("tiny-llama", tmp_path / "p", contract="hf_static")
    result = CliRunner().invoke(main, ["export", "tiny-llama", "-o", str(tmp_path / "p"), "--use-offgraph-kv-cache", "--contract", "hf_static"])
    assert result.exit_code == 1 and "usage: --use-offgraph-kv-cache" in result.stderr


@pytest.mark.parametrize("contract", SINGLE)
def test_cli_end_to_end(tmp_path, contract):
    out = tmp_path / "pkg"
    args = ["export", "tiny-qwen2", "-o", str(out), "--max-step-tokens", "8", "--max-context-len", "64"]
    if contract == "hf_static":
        args += ["--contract", "hf_static"]
    runner = CliRunner()
    assert runner.invoke(main, args).exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["contract"]["name"] == contract
    assert runner.invoke(main, ["validate", str(out)]).exit_code == 0
    assert contract in runner.invoke(main, ["inspect", str(out)]).stdout
    result = runner.invoke(main, ["generate", str(out), "--prompt-ids", "5,6,7", "--prompt-ids", "9,10", "--max-new-tokens", "6", "--json"])
    assert result.exit_code == 0, result.output
    outputs = json.loads(result.stdout)["outputs"]
    hf = load_model("tiny-qwen2").model
    assert [o["generated_ids"] for o in outputs] == [hf_greedy(hf, [5, 6, 7], 6), hf_greedy(hf, [9, 10], 6)]


def test_a_third_party_contract_can_register(tmp_path, package):
    @register_io_manager("toy_contract", 1)
    class ToyManager(IOManager):
        @staticmethod
        def check_manifest(manifest):
            return [] if manifest["metadata"].get("answer") == 42 else ["metadata.answer: expected 42"]

    target = tmp_path / "pkg"
    shutil.copytree(package("ingraph_kv"), target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["contract"] = {"name": "toy_contract", "version": 1}
    manifest["metadata"]["answer"] = 42
    (target / "manifest.json").write_text(json.dumps(manifest))
    assert isinstance(load(target), ToyManager)
    manifest["contract"]["version"] = 2
    (target / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match="toy_contract version 2 is not supported"):
        load(target)


def test_single_sequence_runtimes_refuse_offgraph_options(package):
    from kvexport.runtime import RuntimeRefusal

    with pytest.raises(RuntimeRefusal, match="take no max_cells option"):
        load(package("hf_static"), max_cells=64)
