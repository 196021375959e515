"""The passes that choose how products and lookups run: each rewrites what
it promises, leaves alone what it must, and keeps the program's results."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvexport.exporter.quantization.quantize import plain_weights, quantize_model
from kvexport.passes.base import run_passes
from kvexport.passes.check_step_width import USER_INPUTS_META
from kvexport.passes.decompose_custom_ops import DecomposeCustomOpsPass
from kvexport.passes.packed_weights import FusedPackedLinearPass
from kvexport.passes.quantized_weights import FusedDequantizeMatmulPass
from kvexport.partitioners.aoti.passes.masked_attention import MASKED_ATTENTION, MaskedAttentionPass
from kvexport.partitioners.aoti.passes.rows_linear import ROWS_LINEAR, RowsLinearPass
from kvexport.passes.weight_stationary_linear import WeightStationaryLinearPass


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.up = nn.Linear(64, 96, bias=True)
        self.down = nn.Linear(96, 64, bias=False)

    def forward(self, tokens):
        return self.down(torch.relu(self.up(self.embed(tokens))))


def exported(module: nn.Module, tokens: torch.Tensor, dynamic: bool = False) -> torch.export.ExportedProgram:
    shapes = ({1: torch.export.Dim("T", min=2, max=16)},) if dynamic else None
    program = torch.export.export(module, (tokens,), dynamic_shapes=shapes, strict=False)
    program.graph_module.meta[USER_INPUTS_META] = list(program.graph_signature.user_inputs)
    return program


def targets(program: torch.export.ExportedProgram) -> list:
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


def tokens_of(rows: int) -> torch.Tensor:
    return torch.arange(rows).reshape(1, rows) * 7 % 50


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_weight_stationary_linear_rewrites_static_rows_and_keeps_results(rows):
    torch.manual_seed(0)
    block, tokens = Block().eval(), tokens_of(rows)
    program = exported(block, tokens)
    run_passes(program.graph_module, [WeightStationaryLinearPass()], "m")
    ops = targets(program)
    assert torch.ops.aten.linear.default not in ops and ops.count(torch.ops.aten.mm.default) == 2
    assert (torch.ops.aten.constant_pad_nd.default in ops) == (rows == 1)  # one row is padded to two
    torch.testing.assert_close(program.module()(tokens), block(tokens), rtol=1e-5, atol=1e-5)


def test_weight_stationary_linear_leaves_dynamic_and_wide_products():
    block = Block().eval()
    dynamic = exported(block, tokens_of(4), dynamic=True)
    wide = exported(block, tokens_of(12))
    for program in (dynamic, wide):
        run_passes(program.graph_module, [WeightStationaryLinearPass(max_rows=8)], "m")
        assert targets(program).count(torch.ops.aten.linear.default) == 2


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_row_kernel_linear_takes_its_row_counts_and_leaves_the_rest_to_the_blas(rows):
    torch.manual_seed(0)
    block, tokens = Block().eval(), tokens_of(rows)
    program = exported(block, tokens)
    kernel_rows = (1, 2)
    passes = [RowsLinearPass(kernel_rows), WeightStationaryLinearPass(skip_rows=kernel_rows)]
    run_passes(program.graph_module, passes, "m")
    ops = targets(program)
    assert torch.ops.aten.linear.default not in ops
    assert ops.count(ROWS_LINEAR) == (2 if rows in kernel_rows else 0)
    assert ops.count(torch.ops.aten.mm.default) == (0 if rows in kernel_rows else 2)
    torch.testing.assert_close(program.module()(tokens), block(tokens), rtol=1e-5, atol=1e-5)


def test_row_kernel_takes_bf16_products_over_every_row_count_where_asked():
    """Where torch's bf16 GEMM is slow (AVX2), bf16 linears over dynamic rows
    (a prefill slice) take the kernel too; fp32 ones stay on the BLAS, and
    without the flag bf16 ones do."""
    torch.manual_seed(0)
    tokens = tokens_of(4)
    for dtype, every, taken in ((torch.bfloat16, True, 2), (torch.bfloat16, False, 0), (torch.float32, True, 0)):
        block = Block().eval().to(dtype)
        program = exported(block, tokens, dynamic=True)
        run_passes(program.graph_module, [RowsLinearPass((1, 2), bf16_every_row_count=every)], "m")
        assert targets(program).count(ROWS_LINEAR) == taken, (dtype, every)
        other = tokens_of(11)
        torch.testing.assert_close(program.module()(other), block(other), atol=1e-2, rtol=2e-2)  # bf16 roundings


def test_row_kernel_linear_leaves_weights_it_cannot_read_row_by_row():
    class Sliced(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 96))

        def forward(self, x):
            return nn.functional.linear(x, self.weight[:, :64])  # rows 96 apart

    module, x = Sliced().eval(), torch.randn(2, 64)
    program = torch.export.export(module, (x,), strict=False)
    run_passes(program.graph_module, [RowsLinearPass((2,))], "m")
    assert ROWS_LINEAR not in targets(program)
    torch.testing.assert_close(program.module()(x), module(x))


class PoolAttention(nn.Module):
    """Attention of a few rows over a [C, Hkv, D] pool through a [T, C] mask,
    as the offgraph forward attends."""

    def forward(self, query, pool_k, pool_v, mask):
        key, value = pool_k.permute(1, 0, 2).unsqueeze(0), pool_v.permute(1, 0, 2).unsqueeze(0)
        return nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.2, enable_gqa=True)


@pytest.mark.parametrize("rows", [1, 4])
def test_masked_attention_takes_the_kernels_row_counts(rows):
    torch.manual_seed(0)
    inputs = (torch.randn(1, 6, rows, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16), torch.rand(rows, 10) > 0.5)
    program = torch.export.export(PoolAttention(), inputs, strict=False)
    run_passes(program.graph_module, [MaskedAttentionPass((1, 2))], "m")
    assert targets(program).count(MASKED_ATTENTION) == (1 if rows in (1, 2) else 0)
    torch.testing.assert_close(program.module()(*inputs), PoolAttention()(*inputs))


@pytest.mark.parametrize("dynamic", [True, False])
def test_masked_attention_takes_dynamic_rows_unless_told_not_to(dynamic):
    """A row count known only at run time (forward_others) goes to the kernel,
    whose shim takes one session's causal slice in two sdpa calls."""
    inputs = (torch.randn(1, 6, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16), torch.rand(4, 10) > 0.5)
    rows = torch.export.Dim("T", min=2, max=8)
    program = torch.export.export(PoolAttention(), inputs, strict=False,
                                  dynamic_shapes=({2: rows}, None, None, {0: rows}))
    run_passes(program.graph_module, [MaskedAttentionPass(tuple(range(1, 17)), dynamic=dynamic)], "m")
    assert (MASKED_ATTENTION in targets(program)) == dynamic
    torch.testing.assert_close(program.module()(*inputs), PoolAttention()(*inputs))


def test_weight_stationary_linear_leaves_the_row_kernels_counts_as_linears():
    program = exported(Block().eval(), tokens_of(4))
    run_passes(program.graph_module, [WeightStationaryLinearPass(skip_rows=(4,))], "m")
    assert targets(program).count(torch.ops.aten.linear.default) == 2


def test_kernel_rows_follow_the_measured_rates():
    from kvexport.partitioners.aoti.kernels.probe import choose_rows

    def rates(kernel):
        return {"blas": {1: 20.0, 2: 20.0, 4: 20.0, 8: 20.0}, "kernel": dict(zip((1, 2, 4, 8), kernel))}

    assert choose_rows(rates([30, 10, 30, 30])) == (1, 4, 8)  # each count on its own
    assert choose_rows(rates([20.5, 20, 19, 18])) == ()  # within the noise margin: the BLAS stays
    assert choose_rows(rates([40, 40, 40, 40])) == (1, 2, 4, 8)


def test_kernel_probe_measures_once_per_machine(tmp_path, monkeypatch):
    from kvexport.partitioners.aoti.kernels import build as row_kernel
    from kvexport.partitioners.aoti.kernels import probe as kernel_probe

    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(row_kernel, "supported", lambda: True)
    calls = []
    monkeypatch.setattr(kernel_probe, "measure", lambda: calls.append(1) or {
        "blas": {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0}, "kernel": {1: 5.0, 2: 20.0, 4: 20.0, 8: 5.0}})
    assert kernel_probe.kernel_rows("cpu") == (2, 4) and kernel_probe.kernel_rows("cpu") == (2, 4)
    assert calls == [1]
    [kept] = (tmp_path / "probes").iterdir()
    kept.write_text("{not json")  # a damaged cache file is measured again, not trusted
    assert kernel_probe.kernel_rows("cpu") == (2, 4) and calls == [1, 1]
    assert kernel_probe.kernel_rows("cpu", "on") == tuple(range(1, kernel_probe.MAX_ROWS + 1))
    assert kernel_probe.kernel_rows("cpu", "off") == () and kernel_probe.kernel_rows("cuda", "on") == ()
    assert calls == [1, 1]  # on and off measure nothing


def quantized_block(scheme: str) -> nn.Module:
    torch.manual_seed(0)
    block = Block().eval()
    quantize_model(block, scheme, 0, "8w")
    return block


@pytest.mark.parametrize("scheme", ["8w", "4w", "8da4w"])
def test_quantized_products_fuse_for_static_rows_and_keep_results(scheme):
    block, tokens = quantized_block(scheme), tokens_of(4)
    want = block(tokens)
    plain_weights(block)
    program = exported(block, tokens)
    passes = [FusedPackedLinearPass(), DecomposeCustomOpsPass(), FusedDequantizeMatmulPass()]
    run_passes(program.graph_module, passes, "m")
    ops = targets(program)
    assert not {torch.ops.aten.mm.default, torch.ops.aten.linear.default} & set(ops)
    assert ops.count(torch.ops.aten.sum.dim_IntList) >= 2
    assert all(getattr(op, "namespace", "aten") in ("aten", "prims") for op in ops)  # runs on torch alone
    torch.testing.assert_close(program.module()(tokens), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["8w", "8da4w"])
def test_quantized_products_keep_the_matrix_product_for_dynamic_rows(scheme):
    block = quantized_block(scheme)
    want = {rows: block(tokens_of(rows)) for rows in (3, 9)}
    plain_weights(block)
    program = exported(block, tokens_of(4), dynamic=True)
    passes = [FusedPackedLinearPass(), DecomposeCustomOpsPass(), FusedDequantizeMatmulPass()]
    run_passes(program.graph_module, passes, "m")
    ops = targets(program)
    assert torch.ops.aten.linear.default in ops or torch.ops.aten.mm.default in ops  # one product over many rows
    assert all(getattr(op, "namespace", "aten") in ("aten", "prims") for op in ops)
    for rows, logits in want.items():
        torch.testing.assert_close(program.module()(tokens_of(rows)), logits, rtol=1e-5, atol=1e-5)


def test_fused_products_leave_float_weights_and_activation_products_alone():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, tokens):
            h = self.block.embed(tokens)[0]
            return self.block.up(h), h @ h.t()  # a float weight; two activations

    program = exported(Mixed().eval(), tokens_of(4))
    run_passes(program.graph_module, [FusedDequantizeMatmulPass()], "m")
    assert torch.ops.aten.sum.dim_IntList not in targets(program)


def test_partitioners_choose_kernels_by_device():
    from kvexport.partitioners.aoti.partitioner import AotiPartitioner
    from kvexport.partitioners.portable.partitioner import PortablePartitioner

    def names(partitioner):
        return [p.name for p in partitioner.edge_transform_passes()]

    assert names(PortablePartitioner())[-1] == "weight_stationary_linear"
    cpu = names(AotiPartitioner("cpu"))
    assert cpu.index("fused_dequantize_matmul") < cpu.index("weight_stationary_linear")
    cuda = names(AotiPartitioner("cuda"))  # the layouts were measured on the CPU's BLAS only
    assert "fused_dequantize_matmul" not in cuda and "weight_stationary_linear" not in cuda
    assert cpu.index("fused_packed_linear") < cpu.index("decompose_custom_ops")
    skipped = AotiPartitioner("cpu", kernel_rows=(2, 8)).kernel_choice_passes()[-1]
    assert skipped.name == "weight_stationary_linear" and skipped.skip_rows == {2, 8}  # the compile takes those
    assert cuda[:1] == ["decompose_custom_ops"]


@pytest.mark.parametrize("group", [0, 16])
def test_quantized_lookup_unpacks_only_the_gathered_rows(group):
    from kvexport.exporter.quantization.quantize import PackedEmbedding, packed, quantize_weight

    torch.manual_seed(0)
    block, tokens = Block().eval(), tokens_of(6)
    table = block.embed.weight
    words, scale, offset, bits = packed(quantize_weight(table, 8, group))
    block.embed = PackedEmbedding(words, scale, offset, bits, table.shape[0], table.dtype)
    program = exported(block, tokens, dynamic=True)
    run_passes(program.graph_module, [FusedPackedLinearPass(), DecomposeCustomOpsPass()], "m")
    words_node = next(n for n in program.graph.nodes if n.op == "placeholder" and "embed" in n.name and "words" in n.name)
    assert [u.target for u in words_node.users] == [torch.ops.aten.embedding.default]  # never the whole table
    for rows in (3, 6, 11):
        torch.testing.assert_close(program.module()(tokens_of(rows)), block(tokens_of(rows)), rtol=1e-5, atol=1e-5)


class Siblings(nn.Module):
    """q/k/v-like products of one input (biased), two more of another
    (unbiased), and a product of a different width that must stay alone."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 16), nn.Linear(64, 16)
        self.gate, self.up = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
        self.down = nn.Linear(96, 64, bias=False)

    def forward(self, x):
        h = torch.cat([self.q(x), self.k(x), self.v(x).relu()], -1)[..., :64]
        return self.down(torch.relu(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("rows", [1, 5])
def test_sibling_linears_fuse_and_keep_results(rows):
    from kvexport.passes.fuse_linears import FusedWeights, fuse_sibling_linears

    model = Siblings().eval()
    x = torch.randn(rows, 64)
    program = torch.export.export(model, (x,), strict=False)
    fused = FusedWeights()
    assert fuse_sibling_linears(program, fused) == 2
    names = set(program.state_dict)
    assert {"q_k_v.weight", "q_k_v.bias", "gate_up.weight", "down.weight"} == names
    linears = [n for n in program.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == 3
    # the stacked weights are uninitialized: what the writer would store are their parts
    for name, parts in (("q_k_v.weight", ["q", "k", "v"]), ("gate_up.weight", ["gate", "up"])):
        assert [p is getattr(model, m).weight for p, m in zip(fused.parts(program.state_dict[name]), parts)] == [True] * len(parts)
    for name in ("q_k_v.weight", "q_k_v.bias", "gate_up.weight"):
        program.state_dict[name].data.copy_(torch.cat(fused.parts(program.state_dict[name])))
    assert torch.allclose(program.module()(x), model(x), atol=1e-6)


@pytest.mark.parametrize("qlinear,qact", [("4w", "int8"), ("8w", "int8"), ("4w", "int8-peak"), ("8w", "int16")])
def test_sibling_int8_products_fuse_and_keep_results(qlinear, qact):
    """Quantized siblings with rounded activations stack their codes, scales
    and offsets (and biases) along the rows and round their input once; the
    product over the stacked parts is the parts' products, each sliced back."""
    from kvexport.exporter.quantization.quantize import Int8Linear
    from kvexport.passes.fuse_linears import FusedWeights, fuse_sibling_int8_products

    torch.manual_seed(0)
    model = Siblings().eval()
    quantize_model(model, qlinear, 0, "", qact=qact)
    assert all(isinstance(getattr(model, m), Int8Linear) for m in ("q", "k", "v", "gate", "up", "down"))
    x = torch.randn(5, 64)
    program = torch.export.export(model, (x,), strict=False)
    fused = FusedWeights()
    assert fuse_sibling_int8_products(program, fused) == 2
    stacked = {f"{group}.{part}": members for group, members in (("q_k_v", "qkv"), ("gate_up", ("gate", "up")))
               for part in ("data", "scale", "offset")}
    assert set(stacked) | {"q_k_v.bias", "down.data", "down.scale", "down.offset"} == set(program.state_dict)
    called = [n.target for n in program.graph.nodes if n.op == "call_function"]
    rounding = getattr(torch.ops.kvexport, f"{qact.replace('-', '_')}_rows").default
    assert called.count(rounding) == 3  # x once for q/k/v, h once for gate/up, down
    assert called.count(torch.ops.kvexport.dequantize_blocks.default) == called.count(torch.ops.aten.linear.default) == 3
    for name, members in stacked.items():
        part = name.split(".")[1]
        parts = fused.parts(program.state_dict[name])
        assert [p is getattr(getattr(model, m), part) for p, m in zip(parts, members)] == [True] * len(members)
        program.state_dict[name].data.copy_(torch.cat(parts))
    program.state_dict["q_k_v.bias"].data.copy_(torch.cat(fused.parts(program.state_dict["q_k_v.bias"])))
    torch.testing.assert_close(program.module()(x), model(x), rtol=1e-6, atol=1e-6)
