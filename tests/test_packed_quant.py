"""Packed codes (passes/packed_weights.py) and the quantizers that fill them
(exporter/quantization/quantize.py): round trips, the fused product against the plain
one, GGUF sources kept exactly, mixed 4/8-bit recipes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import export_tiny, hf_greedy, prompt_of
from kvexport.contract.errors import SpecError
from kvexport.exporter.sources.models import load_model
from kvexport.exporter.quantization.gguf_codes import GroupCodes
from kvexport.exporter.quantization.quantize import PackedLinear, packed, quantize_model, quantize_weight
from kvexport.passes.base import run_passes
from kvexport.passes.decompose_custom_ops import DecomposeCustomOpsPass
from kvexport.passes.packed_weights import FusedPackedLinearPass, dequantize_rows, pack, unpack
from kvexport.runtime import generate, load


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [16, 13, 1])
def test_pack_round_trips_and_four_bits_take_half_the_bytes(bits, rows):
    codes = torch.randint(0, 1 << bits, (rows, 64), dtype=torch.uint8)
    words = pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (-(-rows // (32 // bits)), 64)
    assert torch.equal(unpack(words, bits, rows), codes.to(torch.int32))
    if rows == 16:
        assert words.numel() * 4 == rows * 64 * bits // 8


@pytest.mark.parametrize("group", [0, 16])
@pytest.mark.parametrize("bits", [4, 8])
def test_lookups_unpack_the_rows_they_name(bits, group):
    weight = torch.randn(37, 64)
    codes = quantize_weight(weight, bits, group)
    words, scale, offset, lane_bits = packed(codes)
    ids = torch.tensor([[0, 36, 5], [17, 17, 9]])
    got = dequantize_rows(words, scale, offset, lane_bits, ids, torch.float32)
    assert torch.equal(got, codes.dequantize()[ids])


def test_minmax_codes_keep_both_ends_of_every_group():
    weight = torch.randn(8, 128)
    codes = quantize_weight(weight, 4, 32)
    back = codes.dequantize().view(8, 4, 32)
    grouped = weight.view(8, 4, 32)
    step = codes.scale.float()
    assert (back - grouped).abs().amax(-1).le(step * 0.5 + 1e-6).all()  # half a step
    assert codes.scale.dtype == torch.float32 and codes.codes.max() == 15 and codes.codes.min() == 0
    per_row = quantize_weight(weight, 8, 0)
    assert torch.allclose(per_row.dequantize().amin(1), weight.amin(1)) and torch.allclose(per_row.dequantize().amax(1), weight.amax(1))


def test_hqq_codes_are_no_worse_than_minmax_on_outlier_heavy_weights():
    torch.manual_seed(0)
    weight = torch.randn(64, 256) * torch.where(torch.rand(64, 256) < 0.01, 8.0, 1.0)
    errors = {a: (quantize_weight(weight, 4, 32, a).dequantize() - weight).abs().mean() for a in ("minmax", "hqq")}
    assert errors["hqq"] < errors["minmax"]


class Rows(nn.Module):
    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(torch.tanh(x))


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bits,group,out", [(8, 0, 24), (4, 32, 24), (4, 16, 10), (8, 32, 13)])
def test_fused_product_matches_the_plain_one(bits, group, out, rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(out, 64), torch.randn(out)
    words, scale, offset, lane_bits = packed(quantize_weight(weight, bits, group))
    module = Rows(PackedLinear(words, scale, offset, lane_bits, out, bias)).eval()
    x = torch.randn(rows, 64)
    program = torch.export.export(module, (x,))
    graph_module = program.graph_module
    run_passes(graph_module, [FusedPackedLinearPass(), DecomposeCustomOpsPass()], "m")
    targets = {n.target for n in graph_module.graph.nodes}
    assert torch.ops.aten.linear.default not in targets and torch.ops.aten.bitwise_right_shift.Tensor_Scalar in targets
    dense = F.linear(torch.tanh(x), quantize_weight(weight, bits, group).dequantize(), bias)
    torch.testing.assert_close(program.module()(x), dense, rtol=1e-5, atol=1e-5)


def unpacked_copy(model: nn.Module) -> nn.Module:
    """The same model with every packed linear as a float nn.Linear holding
    its dequantized weight."""
    from kvexport.passes.packed_weights import dequantize_packed

    for fqn, module in list(model.named_modules()):
        if isinstance(module, PackedLinear):
            weight = dequantize_packed(module.words, module.scale, module.offset, module.bits, module.out_features, torch.float32)
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight.data, plain.bias = weight, module.bias
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent), name, plain)
    return model


def test_packed_and_unpacked_four_bits_give_the_same_tokens(tmp_path, backend="portable", package=None):
    """(test_quantization runs it on the aoti package it shares.)"""
    package = package or export_tiny("tiny-llama", tmp_path / "pkg", qlinear="4w", qembedding="8w", backend=backend).path
    eager = load_model("tiny-llama").model
    quantize_model(eager, "4w", 0, "8w")
    plain = unpacked_copy(eager)
    runtime = load(package)
    prompts = [prompt_of(9, seed=4), prompt_of(21, seed=5)]
    want = [hf_greedy(plain, p, 24) for p in prompts]
    assert generate(runtime, prompts, 24) == want
    manifest = json.loads((package / "manifest.json").read_text())
    rows = {r["module"]: r for r in manifest["quantization"]["coverage"]}
    assert rows["model.layers.0.mlp.down_proj"]["bits"] == 4 and rows["lm_head"]["bits"] == 8


def test_keep_8w_by_pattern_and_by_measured_sensitivity():
    model = load_model("tiny-llama").model
    rows = {r["module"]: r for r in quantize_model(model, "4w", 0, "8w", keep_8w=("*.down_proj",))}
    assert {m: r["bits"] for m, r in rows.items() if m.endswith("down_proj")} == {m: 8 for m in rows if m.endswith("down_proj")}
    assert rows["model.layers.0.self_attn.q_proj"]["bits"] == 4
    model = load_model("tiny-llama").model
    rows = quantize_model(model, "4w", 0, "8w", keep_8w=("sensitive:0.5",))
    linears = [r for r in rows if r["kind"] == "linear" and not r.get("shared_with")]
    assert sum(r["bits"] == 8 for r in linears) == round(0.5 * len(linears))
    with pytest.raises(SpecError, match="sensitive:FRACTION"):
        quantize_model(load_model("tiny-llama").model, "4w", 0, "8w", keep_8w=("sensitive:2",))


def test_gguf_scheme_needs_a_gguf_source(tmp_path):
    with pytest.raises(SpecError, match="must be a .gguf file"):
        export_tiny("tiny-llama", tmp_path / "pkg", qlinear="gguf")
    with pytest.raises(SpecError, match="drop --qembedding"):
        export_tiny("tiny-llama", tmp_path / "pkg", qlinear="gguf", qembedding="8w")
    with pytest.raises(SpecError, match="--qlinear 4w"):
        export_tiny("tiny-llama", tmp_path / "pkg", qlinear="8w", qlinear_keep_8w="*.q_proj")


def test_codes_pack_wider_than_four_bits_a_byte_each():
    codes = GroupCodes(torch.randint(0, 64, (16, 32), dtype=torch.uint8), torch.rand(16, 2), torch.rand(16, 2), 16, 6, "Q6_K")
    words, scale, offset, bits = packed(codes)
    assert bits == 8 and words.shape == (4, 32)
    assert scale.dtype == torch.float32


def test_a_gguf_source_keeps_its_own_codes(tmp_path, monkeypatch):
    """A tiny Llama written in eight GGUF types: every tensor stored as its
    source's codes, and greedy tokens equal to transformers' loading of the
    same file (its own dequantization)."""
    from test_gguf_codes import tiny_llama
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = tiny_llama(tmp_path / "tiny.gguf")
    package = export_tiny(str(path), tmp_path / "pkg", qlinear="gguf").path
    manifest = json.loads((package / "manifest.json").read_text())
    rows = {r["module"]: r for r in manifest["quantization"]["coverage"]}
    assert rows["model.layers.0.self_attn.q_proj"]["source"] == "Q4_K" and rows["model.layers.0.self_attn.q_proj"]["bits"] == 4
    assert rows["model.layers.0.self_attn.k_proj"]["source"] == "Q6_K" and rows["model.layers.0.self_attn.k_proj"]["granularity"] == "per group of 16"
    assert rows["model.embed_tokens"]["source"] == "Q8_0" and rows["model.embed_tokens"]["scheme"] == "gguf"
    assert rows["lm_head"]["source"] == "F16" and "kept as float" in rows["lm_head"]["skipped"]
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [[1, 5, 9, 3], [7, 7, 2, 30, 11, 4]]
    runtime = load(package)
    assert generate(runtime, prompts, 12) == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", ""])
def test_compiled_products_load_whole_vectors_of_words(isa):
    """On AVX2 (forced with ATEN_CPU_CAPABILITY) and the machine's own ISA,
    the fused 4-bit product loads its codes as whole int32 vectors, never
    byte by byte (bench/kernel_code.py prints the same)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    script = Path(__file__).parents[1] / "bench" / "kernel_code.py"
    done = subprocess.run([sys.executable, str(script), "--bits", "4"], env=env, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout[done.stdout.index("{"):])
    words = [line for line in report["loads"] if line.startswith("int32_t")]
    if not report["isa"].startswith(("avx2", "avx512")):
        pytest.skip(f"inductor vectorizes for {report['isa']} here")
    width = 8 if report["isa"].startswith("avx2") else 16
    assert words and all(int(line.split(": ")[1]) % width == 0 for line in words), report
    assert not report["byte_loads"], report


@pytest.mark.parametrize("bits,group,out", [(4, 32, 24), (8, 0, 13)])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_compile_pass_finds_the_stored_dequantization_and_keeps_its_results(bits, group, out, rows):
    """What the aoti compile does with a weight-only product (--qact none,
    or an LM head sharing the embedding's codes): the stored arithmetic
    (lanes shifted and masked, times the scale plus the offset, a linear)
    becomes one packed_linear call over the rows the kernel takes."""
    from kvexport.partitioners.aoti.passes.packed_linear import PACKED_LINEAR, PackedLinearPass

    torch.manual_seed(bits + rows)
    weight, bias = torch.randn(out, 64), torch.randn(out)
    words, scale, offset, lane_bits = packed(quantize_weight(weight, bits, group))
    module = Rows(PackedLinear(words, scale, offset, lane_bits, out, bias)).eval()
    x = torch.randn(rows, 64)
    program = torch.export.export(module, (x,))
    run_passes(program.graph_module, [DecomposeCustomOpsPass(), PackedLinearPass((1, 5))], "m")
    program.graph.eliminate_dead_code()
    called = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert called.count(PACKED_LINEAR) == 1 and torch.ops.aten.linear.default not in called
    assert torch.ops.aten.bitwise_right_shift.Tensor_Scalar not in called  # the unpacking is the kernel's
    torch.testing.assert_close(program.module()(x), module(x), rtol=1e-5, atol=1e-5)
    untouched = torch.export.export(module, (torch.randn(3, 64),))
    run_passes(untouched.graph_module, [DecomposeCustomOpsPass(), PackedLinearPass((1, 5))], "m")
    assert PACKED_LINEAR not in [n.target for n in untouched.graph.nodes]  # 3 rows: not the kernel's
