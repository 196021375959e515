"""Products with int8 activations (--qact int8): the blocks format, the
definition of the rounded rows (passes/packed_weights.py), the quantizer's
choice per linear, and the aoti compile pass that gives them to the int8
kernel (partitioners/aoti/passes/int8_linear.py)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from helpers import export_tiny
from kvexport.cli.main import main
from kvexport.contract.errors import SpecError
from kvexport.contract.op_allowlist import ALLOWED_OPS
from kvexport.contract.schemes import QACT_BY_BITS
from kvexport.exporter.quantization.quantize import (
    Int8Linear, PackedLinear, coverage_summary, quantize_model, quantize_weight,
)
from kvexport.partitioners.aoti.passes.int8_linear import INT8_LINEAR, Int8LinearPass, int8_product
from kvexport.passes.base import run_passes
from kvexport.passes.decompose_custom_ops import DecomposeCustomOpsPass
from kvexport.passes.packed_weights import (
    INV_127, INV_32767, _dequantize_blocks, int8_peak_rows, int8_rows, int8x2_rows, int16_rows, narrow_tables,
    pack_blocks, pack_table, unpack_blocks, unpack_table,
)


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_round_trip_and_four_bits_take_half_the_bytes(bits):
    codes = torch.randint(0, 1 << bits, (16, 96), dtype=torch.uint8)
    data = pack_blocks(codes, bits)
    assert data.dtype == torch.uint8 and data.shape == (2, 96 * bits)  # panels of 8 rows
    assert torch.equal(unpack_blocks(data, bits), codes)
    # panel 1, block 2, quad 1: 4 bytes of each of the panel's rows; row 3's
    # are codes 64 + 4 .. 64 + 7 of weight row 11 (4 bits: and 64 + 20 .. high)
    at = (2 * 4 * (bits // 4) + 1) * 32 + 3 * 4
    quad = [int(v) for v in data[1, at:at + 4]]
    want = [int(codes[11, 68 + t]) | (int(codes[11, 84 + t]) << 4 if bits == 4 else 0) for t in range(4)]
    assert quad == want


def test_tables_keep_fp16_only_where_it_holds_them():
    """fp16 where every value keeps fp16's precision (exact: a GGUF's own
    scales); a scale under fp16's normal range or a value past its largest
    keeps both tables fp32."""
    scale, offset = torch.rand(16, 3) + 0.01, torch.randn(16, 3)
    assert narrow_tables(scale, offset, exact=False)[0].dtype == torch.float16
    assert narrow_tables(scale, offset, exact=True)[0].dtype == torch.float32  # rounding would change them
    halves = (scale.half().float(), offset.half().float())
    assert all(t.dtype == torch.float16 for t in narrow_tables(*halves, exact=True))
    assert narrow_tables(scale * 1e-6, offset, exact=False)[1].dtype == torch.float32
    assert narrow_tables(scale, offset * 1e5, exact=False)[0].dtype == torch.float32
    assert torch.equal(unpack_table(pack_table(scale)), scale)


@pytest.mark.parametrize("rows,inverse,limit", [(int8_rows, INV_127, 127), (int16_rows, INV_32767, 32767)])
def test_rounded_rows_round_each_block_to_whole_steps_of_its_largest_magnitude(rows, inverse, limit):
    """int8_rows: 127 steps to a block's top; int16_rows: 32767."""
    torch.manual_seed(0)
    x = torch.randn(3, 96) * torch.tensor([1.0, 1e3, 1e-3]).repeat_interleave(32)
    x[1, :32] = 0.0
    got = rows(x).reshape(3, 3, 32)
    blocks = x.reshape(3, 3, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    step = top * torch.tensor(inverse, dtype=torch.float32)
    codes = got / torch.where(step > 0, step, 1.0)
    assert (codes - codes.round()).abs().max() < limit * 1e-6 and codes.round().abs().max() == limit
    assert ((got - blocks).abs() <= step / 2 * (1 + 1e-6) + blocks.abs() * 2**-23).all()  # half a step at most
    torch.testing.assert_close(got.abs().amax(-1, keepdim=True), top, rtol=1e-6, atol=0)  # the largest: `limit` steps
    assert torch.equal(got[1, 0], torch.zeros(32))  # an all-zero block stays zero


def test_int8x2_rows_add_the_rounding_error_rounded_alike():
    """Two terms: the rows rounded as int8_rows rounds them, plus their
    rounding error rounded the same way, so each value is within half of a
    step of at most 1/254 of the first's (about 15 bits of the block)."""
    torch.manual_seed(0)
    x = torch.randn(3, 96) * torch.tensor([1.0, 1e3, 1e-3]).repeat_interleave(32)
    x[1, :32] = 0.0
    first = int8_rows(x)
    got = int8x2_rows(x)
    assert torch.equal(got, first + int8_rows(x - first))
    step = (x.abs().reshape(3, 3, 32).amax(-1, keepdim=True) * INV_127).expand(3, 3, 32).reshape(3, 96)
    error, one_term = (got - x).abs(), (first - x).abs()
    assert (error <= step / 508 + x.abs() * 2**-23).all()  # half a second step, and fp32's rounding of the sum
    assert error.max() < one_term.max() / 100
    assert torch.equal(got[1, :32], torch.zeros(32))


def test_int8_peak_rows_add_a_second_term_on_each_rows_peak_blocks_alone():
    """int8-peak: int8_rows, plus int8x2's second term on the blocks whose
    largest magnitude is their row's largest (ties: every such block),
    nothing elsewhere; an all-zero row has no second term to add."""
    torch.manual_seed(0)
    x = torch.randn(4, 128)
    x[1, 64:96] *= 1e3  # one peak block
    x[2, :32], x[2, 96:] = 5.0, -5.0  # a tie: two peak blocks
    x[3] = 0.0
    first = int8_rows(x)
    both = int8x2_rows(x)
    got = int8_peak_rows(x).reshape(4, 4, 32)
    tops = x.abs().reshape(4, 4, 32).amax(-1)
    peak = tops == tops.amax(-1, keepdim=True)
    assert peak.sum(-1).tolist() == [1, 1, 2, 4] and peak[1, 2] and peak[2, 0] and peak[2, 3]
    for m in range(4):
        for b in range(4):
            want = (both if peak[m, b] else first).reshape(4, 4, 32)[m, b]
            assert torch.equal(got[m, b], want), (m, b)
    assert not torch.equal(got[1, 2], first.reshape(4, 4, 32)[1, 2])  # the second term changed the peak block
    assert torch.equal(got[3], torch.zeros(4, 32))


@pytest.mark.parametrize("qact", ["int8", "int8x2", "int16", "int8-peak"])
def test_the_stored_rounding_calls_only_allowlisted_operators(qact):
    module = Int8Linear(pack_blocks(torch.zeros(8, 64, dtype=torch.uint8), 4), torch.ones(1, 16).half(),
                        torch.zeros(1, 16).half(), 4, qact=qact)
    program = torch.export.export(module, (torch.randn(2, 64),))
    run_passes(program.graph_module, [DecomposeCustomOpsPass()], "m")
    called = {f"torch.ops.{n.target}" for n in program.graph.nodes if n.op == "call_function"}
    assert "torch.ops.aten.round.default" in called and called <= set(ALLOWED_OPS), called - set(ALLOWED_OPS)


class Model(nn.Module):
    def __init__(self, vocab: int = 40):
        super().__init__()
        self.embed = nn.Embedding(vocab, 64)
        self.up = nn.Linear(64, 96, bias=True)
        self.odd = nn.Linear(96, 64, bias=False)
        self.head = nn.Linear(64, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.odd(torch.relu(self.up(self.embed(tokens)))))


def test_qact_int8_rounds_the_activations_of_the_linears_that_can_take_it():
    torch.manual_seed(0)
    model = Model().eval()
    up_weight, up_bias = model.up.weight.detach().clone(), model.up.bias.detach().clone()
    embed_weight = model.embed.weight.detach().clone()
    rows = {r["module"]: r for r in quantize_model(model, "4w", 0, "8w", qact="int8")}
    assert isinstance(model.up, Int8Linear) and isinstance(model.odd, Int8Linear)
    # the tied head multiplies the embedding's codes, stored once in the blocks format, which lookups read too
    assert isinstance(model.head, Int8Linear) and model.head.data is model.embed.words and model.embed.blocks
    assert rows["up"]["activations"] == rows["head"]["activations"] == "int8" and rows["head"]["shared_with"] == "embed"
    embed = quantize_weight(embed_weight, 8, 0)
    embed = dataclasses.replace(embed, scale=embed.scale.half().float(), offset=embed.offset.half().float()).dequantize()
    ids = torch.tensor([[0, 7, 8, 39], [13, 13, 1, 2]])
    assert torch.equal(model.embed(ids), embed[ids])
    x = torch.randn(3, 64)
    codes = quantize_weight(up_weight, 4, 32)
    assert model.up.scale.dtype == model.up.offset.dtype == torch.float16  # fp16 holds these tables
    stored = dataclasses.replace(codes, scale=codes.scale.half().float(), offset=codes.offset.half().float())
    want = F.linear(int8_rows(x), stored.dequantize(), up_bias)
    torch.testing.assert_close(model.up(x), want, rtol=1e-6, atol=1e-6)
    grouped = Model().eval()
    rows = {r["module"]: r for r in quantize_model(grouped, "8w", 16, "", qact="int8")}
    assert rows["up"]["activations"] == "float (its groups of 16 are not whole blocks of 32)"
    assert isinstance(grouped.up, PackedLinear)
    odd_vocab = Model(vocab=36).eval()  # rows not a multiple of 8: the head keeps float activations, lookups row lanes
    rows = {r["module"]: r for r in quantize_model(odd_vocab, "4w", 0, "8w", qact="int8")}
    assert rows["head"]["activations"] == "float (shares the codes of embed, stored for lookups)"
    assert isinstance(odd_vocab.head, PackedLinear) and not odd_vocab.embed.blocks


def test_by_width_each_linear_takes_the_rounding_of_its_codes_width():
    """The default where the kernels exist: int16 over 8-bit codes (the tied
    head's, and a linear kept at 8 bits in a 4w export), int8-peak over
    4-bit ones; the coverage summary names both."""
    from kvexport.contract.schemes import BY_WIDTH

    model = Model().eval()
    rows = {r["module"]: r for r in quantize_model(model, "4w", 0, "8w", keep_8w=("odd",), qact=BY_WIDTH)}
    assert (rows["up"]["bits"], rows["odd"]["bits"], rows["head"]["bits"]) == (4, 8, 8)
    assert rows["up"]["activations"] == "int8-peak"
    assert rows["odd"]["activations"] == rows["head"]["activations"] == "int16"
    assert (model.up.qact, model.odd.qact, model.head.qact) == ("int8-peak", "int16", "int16")
    assert "int16/int8-peak activations on 3 of 3 quantized linears" in coverage_summary(list(rows.values()))


@pytest.mark.parametrize("qact", ["int8", "int8x2", "int16", "int8-peak"])
def test_the_coverage_summary_names_the_activations_each_linear_takes(qact):
    model = Model(vocab=36).eval()  # the head tied to an embedding of 36 rows keeps float activations
    lines = coverage_summary(quantize_model(model, "4w", 0, "8w", qact=qact))
    assert f"{qact} activations on 2 of 3 quantized linears" in lines
    assert "  head: activations float (shares the codes of embed, stored for lookups)" in lines
    assert isinstance(model.up, Int8Linear) and model.up.qact == qact


@pytest.mark.parametrize("flags,message", [
    (dict(qact="int8"), "--qact int8 rounds the activations of linears with packed codes"),
    (dict(qlinear="8da4w", qact="int8"), "8da4w rounds its own"),
    (dict(qlinear="4w", qact="int4"), "--qact must be one of none, int8"),
])
def test_qact_without_packed_linears_is_refused(tmp_path, flags, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        export_tiny("tiny-llama", tmp_path / "pkg", **flags)


def program_of(bits: int, rows: int, bias: bool = True, dynamic: bool = False,
               qact: str = "int8") -> tuple[torch.export.ExportedProgram, nn.Module, torch.Tensor]:
    """An int8 linear's stored arithmetic over `rows` rows (a row count
    known only at run time when `dynamic`)."""
    torch.manual_seed(bits + rows)
    codes = torch.randint(0, 1 << bits, (24, 64), dtype=torch.uint8)
    scale, offset = torch.rand(24, 2), torch.randn(24, 2)
    if rows > 1:  # fp16 tables, as exports store them where they fit
        scale, offset = scale.half(), offset.half()
    module = Int8Linear(pack_blocks(codes, bits), pack_table(scale), pack_table(offset), bits,
                        torch.randn(24) if bias else None, qact=qact).eval()
    x = torch.randn(1, rows, 64)
    shapes = {"x": {1: torch.export.Dim("tokens", min=2, max=64)}} if dynamic else None
    program = torch.export.export(module, (x,), dynamic_shapes=shapes)
    run_passes(program.graph_module, [DecomposeCustomOpsPass()], "m")
    return program, module, x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("qact,code", [("int8", 1), ("int8x2", 2), ("int16", 3), ("int8-peak", 4)])
def test_the_compile_pass_finds_the_stored_arithmetic_and_keeps_its_results(bits, rows, qact, code):
    program, module, x = program_of(bits, rows, bias=rows == 1, qact=qact)
    run_passes(program.graph_module, [Int8LinearPass((1, 5))], "m")
    program.graph.eliminate_dead_code()
    called = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert called.count(INT8_LINEAR) == 1 and torch.ops.aten.linear.default not in called
    assert next(n for n in program.graph.nodes if n.target is INT8_LINEAR).args[-1] == code
    assert torch.ops.aten.round.default not in called  # the rows' rounding is the kernel's
    torch.testing.assert_close(program.module()(x), module(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_compile_pass_takes_a_row_count_known_only_at_run_time_for_the_code_widths_it_is_given(bits):
    """A prefill method's products (rows known at run time) go to the kernel
    for the code widths the pass is given, and keep their results at other
    row counts than the traced one; other widths stay as stored."""
    program, module, x = program_of(bits, 5, dynamic=True)
    run_passes(program.graph_module, [Int8LinearPass((1, 5), dynamic_bits=tuple({4, 8} - {bits}))], "m")
    assert INT8_LINEAR not in [n.target for n in program.graph.nodes]
    run_passes(program.graph_module, [Int8LinearPass((), dynamic_bits=(bits,))], "m")
    program.graph.eliminate_dead_code()
    called = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert called.count(INT8_LINEAR) == 1 and torch.ops.aten.linear.default not in called
    for rows in (5, 17, 40):
        x = torch.randn(1, rows, 64)
        torch.testing.assert_close(program.module()(x), module(x), rtol=1e-6, atol=1e-6)


def test_the_compile_pass_leaves_other_row_counts_and_other_arithmetic():
    program, _, _ = program_of(4, 3)
    run_passes(program.graph_module, [Int8LinearPass((1, 2))], "m")
    assert INT8_LINEAR not in [n.target for n in program.graph.nodes]
    program, _, _ = program_of(4, 1)
    step = next(n for n in program.graph.nodes if n.target is torch.ops.aten.mul.Tensor and n.args[1] == INV_127)
    step.args = (step.args[0], 1 / 100)  # a different rounding is not the kernel's
    linear = next(n for n in program.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert int8_product(linear) is None
    program, _, _ = program_of(4, 1, qact="int8x2")
    error = next(n for n in program.graph.nodes if n.target is torch.ops.aten.sub.Tensor)
    error.args = (error.args[0], error.args[0])  # a second term that is not the first's rounding error
    linear = next(n for n in program.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert int8_product(linear) is None
    for change in ("fill", "peak over the blocks' own values", "peak of other rows"):
        program, _, _ = program_of(4, 3, qact="int8-peak")
        nodes = list(program.graph.nodes)
        masked = next(n for n in nodes if n.target is torch.ops.aten.masked_fill.Scalar)
        below = masked.args[1]
        if change == "fill":  # the blocks below the peak keep half their second term
            masked.args = (masked.args[0], below, 0.5)
        elif change == "peak over the blocks' own values":
            below.args[1].args = (below.args[1].args[0], [-1], True)
        else:
            below.args[1].args = (below.args[1].args[0], [0], True)
        linear = next(n for n in nodes if n.target is torch.ops.aten.linear.default)
        assert int8_product(linear) is None, change


def test_blocks_dequantize_as_scale_times_code_plus_offset():
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    scale, offset = torch.rand(8, 2).half(), torch.randn(8, 2).half()
    want = codes.float().reshape(8, 2, 32) * scale.float()[..., None] + offset.float()[..., None]
    got = _dequantize_blocks(pack_blocks(codes, 4), pack_table(scale), pack_table(offset), 4, torch.float32)
    assert torch.equal(got, want.reshape(8, 64))


@pytest.mark.compile
def test_an_int8_package_runs_its_static_products_on_the_kernels(tiny_package):
    """An aoti 4w package takes rounded activations by default where the
    kernels exist (int8-peak over its 4-bit codes), and verifies (its tokens alone and batched are its eager
    reference's). Each static method calls the int8 kernel once per layer
    product (q/k/v and gate/up stacked) and the packed kernel once, for the LM head (the 8w embedding's
    codes, weight-only), and links both; forward_others (prefill) calls the
    int8 kernel for the same linears and the attention kernel, and leaves the head to inductor's code;
    the stored programs stay plain aten."""
    import gzip
    import zipfile

    from helpers import PROGRESS
    from kvexport.partitioners.aoti.kernels import build

    if not build.supported():
        pytest.skip("kvexport's kernels need x86 with AVX2 or AVX-512")
    path = tiny_package("tiny-llama", "aoti", qlinear="4w", qembedding="8w")  # test_quantization's too
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["backend"]["target"]["packed_kernel_rows"] == list(range(1, 17))
    coverage = manifest["quantization"]["coverage"]
    rounding = QACT_BY_BITS[4]
    int8 = sum(1 for r in coverage if r.get("activations") == rounding)
    # siblings (q/k/v, gate/up) are stored stacked, as rows of one tensor each: one product a stacked tensor
    products = len({r["stored"]["data"].split("[")[0] for r in coverage if r.get("activations") == rounding})
    assert products < int8 and any("_proj.data[" in r["stored"].get("data", "") for r in coverage if "stored" in r)
    assert int8 == sum(1 for r in coverage if r["kind"] == "linear") - 1  # all but the tied head
    shown = CliRunner().invoke(main, ["inspect", str(path)]).stdout
    assert f"{rounding} activations on {int8} of {int8 + 1} quantized linears" in shown
    progress = "\n".join(PROGRESS[str(path)])
    for name, entry in manifest["methods"].items():
        if not name.startswith("forward_"):
            continue
        program = gzip.decompress((path / entry["program"]).read_bytes())
        assert b"int8_linear" not in program and b"packed_linear" not in program
        with zipfile.ZipFile(path / entry["compiled"]) as archive:
            library = b"".join(archive.read(n) for n in archive.namelist() if n.endswith(".so"))
        assert b"kvexport_int8_linear" in library, name
        # one kernel call per linear, none left to inductor's own code, as the export says
        # (forward_others: attention on the kernel's shim, which takes a causal slice; the head on inductor's code)
        head = r", .*packed_linear x1\b" if name != "forward_others" else r", masked_attention x\d+$"
        assert re.search(rf"{name} compiled in [0-9.]+ s, calling kvexport's int8_linear x{products}{head}", progress,
                         re.MULTILINE), progress


@pytest.mark.parametrize("qact", ["int8", "int8x2"])
def test_a_portable_package_computes_the_eager_int8_arithmetic(tiny_package, qact):
    """--qact int8 (and int8x2) on the portable backend (no kernel: the
    stored rounding and dequantization run as plain ATen) gives the eagerly
    quantized model's greedy tokens, alone and batched."""
    from helpers import hf_greedy, prompt_of
    from kvexport.exporter.sources.models import load_model
    from kvexport.runtime import generate, load

    package = tiny_package("tiny-llama", qlinear="4w", qembedding="8w", qact=qact)
    coverage = json.loads((package / "manifest.json").read_text())["quantization"]["coverage"]
    eager = load_model("tiny-llama").model
    linears = sum(isinstance(m, nn.Linear) for m in eager.modules())
    assert sum(1 for r in coverage if r.get("activations") == qact) == linears - 1  # all but the tied head
    quantize_model(eager, "4w", 0, "8w", qact=qact)
    runtime = load(package)
    prompts = [prompt_of(5, seed=1), prompt_of(30, seed=2)]
    want = [hf_greedy(eager, p, 16) for p in prompts]
    assert [generate(runtime, [p], 16)[0] for p in prompts] == want
    assert generate(runtime, prompts, 16) == want


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """A tiny Llama with tied embeddings and a vocabulary of 1032 rows (a
    multiple of 8: the head can take int8 activations), as a model directory."""
    from transformers import AutoModelForCausalLM

    from kvexport.exporter.sources.models import tiny_config

    config = tiny_config("LlamaForCausalLM")
    config.vocab_size = 1032
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    out = tmp_path_factory.mktemp("tied") / "tiny-tied-llama"
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("backend", ["portable", pytest.param("aoti", marks=pytest.mark.compile)])
def test_a_tied_head_multiplies_the_embeddings_codes_with_int8_activations(tmp_path, tied_model_dir, backend):
    """With a vocabulary a multiple of 8, the tied LM head takes int8
    activations: the embedding's codes are stored once, in the blocks format,
    and its lookups read them there. The package verifies (its tokens alone
    and batched are its eager reference's: export checks them) and on aoti
    calls the int8 kernel for the head too, the packed kernel not at all."""
    from helpers import PROGRESS
    from kvexport.partitioners.aoti.kernels import build

    if backend == "aoti" and not build.supported():
        pytest.skip("kvexport's kernels need x86 with AVX2 or AVX-512")
    out = tmp_path / "pkg"
    export_tiny(str(tied_model_dir), out, backend=backend, qlinear="4w", qembedding="8w", qact="int8")
    coverage = json.loads((out / "manifest.json").read_text())["quantization"]["coverage"]
    head = next(r for r in coverage if r["module"] == "lm_head")
    embed = next(r for r in coverage if r["module"] == "model.embed_tokens")
    assert head["activations"] == "int8" and head["shared_with"] == "model.embed_tokens"
    assert embed["stored"]["words"] == head["stored"]["data"]  # one stored copy
    if backend == "aoti":
        progress = "\n".join(PROGRESS[str(out)])
        assert re.search(r"forward_1 compiled in [0-9.]+ s, calling kvexport's int8_linear x\d+", progress), progress
        assert not re.search(r"forward_1 compiled .*packed_linear", progress), progress


@pytest.mark.compile
@pytest.mark.parametrize("qact,qlinear", [("int8x2", "4w"), ("int16", "8w"), ("int8", "4w")])
def test_a_package_with_other_activations_runs_them_on_the_kernel_and_verifies(tiny_package, qact, qlinear):
    """--qact int8x2 (two int8 terms) or int8 (one, where the default is
    int8-peak) over 4-bit codes, or int16 over 8-bit ones (a scale a row)
    on aoti: every linear but the tied head takes them, the report
    says so, the static methods call the int8 kernel, and the package
    verifies (export checks its tokens alone and batched against its eager
    reference, the rounding's own arithmetic); the runtime's greedy tokens
    are the eagerly quantized model's."""
    from helpers import PROGRESS, hf_greedy, prompt_of
    from kvexport.exporter.sources.models import load_model
    from kvexport.partitioners.aoti.kernels import build
    from kvexport.runtime import generate, load

    if not build.supported():
        pytest.skip("kvexport's kernels need x86 with AVX2 or AVX-512")
    path = tiny_package("tiny-llama", "aoti", qlinear=qlinear, qembedding="8w", qact=qact)
    coverage = json.loads((path / "manifest.json").read_text())["quantization"]["coverage"]
    taking = sum(1 for r in coverage if r.get("activations") == qact)
    assert taking == sum(1 for r in coverage if r["kind"] == "linear") - 1
    assert f"{qact} activations on {taking} of {taking + 1} quantized linears" in CliRunner().invoke(
        main, ["inspect", str(path)]).stdout
    progress = "\n".join(PROGRESS[str(path)])
    calls = r"forward_\d+ (from the compile cache \(it )?compiled in [0-9.]+ s\)?, calling kvexport's int8_linear x\d+"
    assert re.search(calls, progress), progress
    eager = load_model("tiny-llama").model
    quantize_model(eager, qlinear, 0, "8w", qact=qact)
    runtime = load(path)
    prompts = [prompt_of(5, seed=1), prompt_of(30, seed=2)]
    want = [hf_greedy(eager, p, 12) for p in prompts]
    assert generate(runtime, prompts, 12) == want
