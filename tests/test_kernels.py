"""kvexport's kernels (partitioners/aoti/kernels/), one table of cases driven
through both ways in: the math on raw pointers (the ctypes entry points the
probe and benches use) and the AOTInductor C shims on tensor handles (what
compiled methods call), on every instruction set this CPU runs (AVX2 code on
an AVX-512 machine too), against torch's own kernels."""

from __future__ import annotations

import re

import pytest
import torch

from kvexport.contract.errors import ExportError
from kvexport.partitioners.aoti.kernels import build
from kvexport.partitioners.aoti.kernels.signatures import KERNELS

pytestmark = [pytest.mark.compile, pytest.mark.skipif(not build.supported(), reason="kvexport's kernels need x86 with AVX2 or AVX-512")]


def runnable_isas() -> list[str]:
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    names = {str(isa).split()[0] for isa in valid_vec_isa_list()}
    return [isa for isa in build.ISAS if isa in names]


ISAS = runnable_isas()


@pytest.fixture(scope="module", params=ISAS)
def isa(request):
    return request.param


@pytest.fixture(scope="module")
def shims(isa):
    return build.Shims(isa)


# ----------------------------------------------------------- rows linear
def rows_operands(rows: int, out_features: int, width: int, row_stride: int = 0):
    g = torch.Generator().manual_seed(rows * 1000 + out_features + width)
    x = torch.randn(rows, row_stride or width, generator=g)[:, :width]
    return x, torch.randn(out_features, width, generator=g)


# row counts over and under a register tile (4 or 8 rows), weight rows not a
# multiple of a tile or a thread's band, widths with a vector tail, strided
# rows; one row by weight rows of 2048 bytes or more (the 8-row tile, not the
# row-by-row walk of shorter ones), and one with each tail of that walk
ROWS_CASES = [(r, n, k, 0) for r in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16) for n, k in ((64, 64), (131, 72), (5, 7), (200, 1))]
ROWS_CASES += [(6, 40, 64, 100), (1, 3, 9, 12), (1, 37, 1100, 0), (1, 21, 83, 1200), (1, 19, 2053, 0)]


@pytest.mark.parametrize("rows,out_features,width,row_stride", ROWS_CASES)
def test_rows_linear(isa, shims, rows, out_features, width, row_stride):
    x, weight = rows_operands(rows, out_features, width, row_stride)
    want = torch.nn.functional.linear(x, weight)
    out = torch.full((rows, out_features), float("nan"))
    torch.testing.assert_close(build.rows_linear(x, weight, out=out, isa=isa), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shims.call("rows_linear", x, weight), want, rtol=1e-5, atol=1e-5)


BF16_PRODUCTS = {isa: ["shift", "dot"] if build.has_bf16_dot(isa) else ["shift"] for isa in ISAS}


@pytest.mark.parametrize("rows,out_features,width,row_stride", [c for c in ROWS_CASES if c[0] in (1, 3, 8, 9, 16)]
                         + [(2, 33, 47, 0), (4, 17, 130, 150), (8, 9, 31, 0)])
def test_rows_linear_reads_bf16(isa, shims, rows, out_features, width, row_stride):
    """bf16 rows by a bf16 weight sum their exact products in fp32 (widened,
    or vdpbf16ps pairs where the CPU has AVX512-BF16: odd widths end in a
    half pair); the shim rounds the result to bf16 as torch does."""
    x, weight = rows_operands(rows, out_features, width, row_stride)
    x, weight = x.bfloat16(), weight.bfloat16()
    out = torch.full((rows, out_features), float("nan"))
    assert_float_sum(build.rows_linear(x, weight, out=out, isa=isa), x.double(), weight.double())
    for products in BF16_PRODUCTS[isa]:
        assert_float_sum(build.rows_linear(x, weight, isa=isa, products=products), x.double(), weight.double())
    got = shims.call("rows_linear", x, weight)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, build.rows_linear(x, weight, isa=isa).bfloat16())


@pytest.mark.parametrize("rows,out_features,width,row_stride",
                         [(128, 300, 1000, 0), (130, 300, 4100, 0), (131, 17, 70, 90), (200, 600, 9, 0)])
def test_the_bf16_shim_takes_a_prefill_slices_rows_to_the_blas(isa, shims, rows, out_features, width, row_stride):
    """Over 128 rows or more the shim widens bf16 operands (the weight a
    panel at a time: 300 rows of width 1000 are two panels, of width 4100
    three of at least 128 rows, the last one short) for torch's fp32
    GEMM, each panel's product into its columns: the sums are fp32 sums of
    the exact products, rounded to bf16."""
    x, weight = rows_operands(rows, out_features, width, row_stride)
    x, weight = x.bfloat16(), weight.bfloat16()
    got = shims.call("rows_linear", x, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    want = x.double() @ weight.double().T
    bound = 1e-6 * (x.double().abs() @ weight.double().abs().T) + 1e-6
    assert ((got.double() - want).abs() <= bound + want.abs() * 2 ** -8).all()  # bf16's rounding of the sums


@pytest.mark.parametrize("rows,width,row_stride", [(8, 70, 100), (12, 70, 100), (40, 70, 0), (16, 2100, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_over_several_passes_give_each_rows_own_sums(isa, rows, width, row_stride, dtype):
    """However many rows a call takes and however a build tiles them (8
    rows: one pass over a band with AVX-512, two with AVX2; a bf16 prefill
    slice's rows, where torch's bf16 GEMM is slow), each row's outputs are
    the exact bits it gets alone: a session's tokens do not depend on the
    sessions batched with it. (bf16's vdpbf16ps tiles pair the products
    differently from 4 rows on: its shift form holds this.)"""
    x, weight = (t.to(dtype) for t in rows_operands(rows, 45, width, row_stride))
    products = "shift" if dtype == torch.bfloat16 else ""
    together = build.rows_linear(x, weight, isa=isa, products=products)
    for row in range(rows):
        alone = build.rows_linear(x[row:row + 1], weight, isa=isa, products=products)[0]
        assert torch.equal(together[row], alone), row


@pytest.mark.compile
def test_the_bf16_kernel_runs_vdpbf16ps_where_the_cpu_has_it(isa):
    """The entry compiled code calls is the vdpbf16ps build on a CPU with
    AVX512-BF16 (its sums in another order than the widened build's) from 3
    rows, else the widened one; one and two rows, whose steps the weight's
    reads bound, take the widened one everywhere (rows_linear.cpp)."""
    x, weight = (t.bfloat16() for t in rows_operands(5, 131, 96))
    entry = build.rows_linear(x, weight, isa=isa)
    assert torch.equal(entry, build.rows_linear(x, weight, isa=isa, products=BF16_PRODUCTS[isa][-1]))
    if len(BF16_PRODUCTS[isa]) == 2:
        assert not torch.equal(entry, build.rows_linear(x, weight, isa=isa, products="shift"))
    for rows in (1, 2):
        assert torch.equal(build.rows_linear(x[:rows], weight, isa=isa),
                           build.rows_linear(x[:rows], weight, isa=isa, products="shift"))


# ------------------------------------------------------ masked attention
def sdpa_in_fp32(query, key, value, mask, scale):
    """torch's sdpa through the bool mask, GQA, on the operands widened to fp32:
    what the shims and kernels are checked against."""
    return torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                                            scale=scale, enable_gqa=True)


def attention_operands(heads, kv_heads, rows, cells, head_dim, seed=0):
    """Keys and values as strided views of [C, Hkv, D] pools, the query as a
    transposed [1, T, H, D]; the first row sees nothing (zeros, as sdpa
    gives), the last sees cell 0."""
    g = torch.Generator().manual_seed(heads * 100 + cells + seed)
    pool_k, pool_v = torch.randn(cells, kv_heads, head_dim, generator=g), torch.randn(cells, kv_heads, head_dim, generator=g)
    key, value = pool_k.permute(1, 0, 2).unsqueeze(0), pool_v.permute(1, 0, 2).unsqueeze(0)
    query = torch.randn(1, rows, heads, head_dim, generator=g).transpose(1, 2) * 3
    mask = torch.rand(rows, cells, generator=g) > 0.6
    mask[0] = False
    mask[-1, 0] = True
    return query, key, value, mask


# GQA groups, head dims with a vector tail and over 64, one cell; the shim
# hands 4+ rows that see most cells to sdpa (the dense case)
ATTENTION_CASES = [(9, 3, 8, 300, 64), (4, 4, 1, 7, 16), (6, 2, 3, 50, 20), (8, 1, 5, 33, 128), (2, 2, 2, 1, 256),
                   (3, 1, 16, 200, 72)]


@pytest.mark.parametrize("heads,kv_heads,rows,cells,head_dim", ATTENTION_CASES)
def test_masked_attention(isa, shims, heads, kv_heads, rows, cells, head_dim):
    query, key, value, mask = attention_operands(heads, kv_heads, rows, cells, head_dim)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    out = torch.full(query.shape, float("nan"))
    got = build.masked_attention(query, key, value, mask, 0.3, out=out, isa=isa)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shims.call("masked_attention", query, key, value, mask, 0.3), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,rows,cells,head_dim", ATTENTION_CASES)
def test_masked_attention_over_bf16_pools(isa, shims, heads, kv_heads, rows, cells, head_dim):
    """bf16 query, keys and values (strided views of bf16 pools): the same
    attention, computed in fp32 over their values and rounded to bf16 once,
    dense rows included (they stay on the kernel)."""
    query, key, value, mask = (t.bfloat16() if t.dtype == torch.float32 else t
                               for t in attention_operands(heads, kv_heads, rows, cells, head_dim, seed=1))
    want = sdpa_in_fp32(query, key, value, mask, 0.3)
    got = shims.call("masked_attention", query, key, value, mask, 0.3)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    # fp32 sums in another order than sdpa's move a value by an ulp of fp32, which can flip its bf16 rounding
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=8e-3, atol=1e-5)
    dense = torch.ones(rows, cells, dtype=torch.bool)
    want = sdpa_in_fp32(query, key, value, dense, 0.3)
    torch.testing.assert_close(shims.call("masked_attention", query, key, value, dense, 0.3).float(),
                               want.bfloat16().float(), rtol=8e-3, atol=1e-5)


# (heads, kv heads, rows, earlier cells, head dim): groups of 3, 7 (4 + 3 on
# AVX-512), 5 and 6; head dims with a tail past whole tiles of dims
SESSION_ROW_CASES = [(9, 3, 8, 300, 64), (7, 1, 5, 40, 20), (10, 2, 16, 130, 72), (12, 2, 4, 64, 128)]


@pytest.mark.parametrize("heads,kv_heads,rows,history,head_dim", SESSION_ROW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention_over_one_sessions_rows(isa, shims, heads, kv_heads, rows, history, head_dim, dtype):
    """One session's rows (a speculative check, a short slice) see the same
    cells, row t its history and the step's first t + 1, among another
    session's cells: the kernel takes one kv head's rows in turn and scores
    a kv head's query heads together; the result is sdpa's."""
    g = torch.Generator().manual_seed(heads * 7 + rows)
    cells = 2 * (history + rows) + 3
    pool_k, pool_v = (torch.randn(cells, kv_heads, head_dim, generator=g) for _ in range(2))
    key, value = pool_k.permute(1, 0, 2).unsqueeze(0), pool_v.permute(1, 0, 2).unsqueeze(0)
    query = torch.randn(1, rows, heads, head_dim, generator=g).transpose(1, 2) * 2
    own = torch.arange(1, cells, 2)[: history + rows]  # the session's cells, every other one
    mask = torch.zeros(rows, cells, dtype=torch.bool)
    for t in range(rows):
        mask[t, own[: history + t + 1]] = True
    query, key, value = (t.to(dtype) for t in (query, key, value))
    want = sdpa_in_fp32(query, key, value, mask, 0.3)
    got = shims.call("masked_attention", query, key, value, mask, 0.3)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(build.masked_attention(query, key, value, mask, 0.3, isa=isa), want,
                                   rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=8e-3, atol=1e-5)


def test_the_shim_hands_dense_rows_to_sdpa(shims):
    """4+ fp32 rows that see most cells (one session's slice) go to sdpa."""
    query, key, value, _ = attention_operands(4, 2, 6, 40, 16)
    mask = torch.ones(6, 40, dtype=torch.bool)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(shims.call("masked_attention", query, key, value, mask, 0.5), want, rtol=1e-5, atol=1e-5)


def test_the_shim_hands_rows_past_a_static_method_to_sdpa(shims):
    """Over 16 rows (a dynamic prefill of several sessions) the shim calls
    torch's sdpa through the mask, on the same operands."""
    query, key, value, _ = attention_operands(4, 2, 20, 40, 16)
    mask = torch.rand(20, 40, generator=torch.Generator().manual_seed(5)) > 0.3
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(shims.call("masked_attention", query, key, value, mask, 0.5), want, rtol=1e-5, atol=1e-5)


def causal_slice_operands(heads, kv_heads, rows, history, head_dim, spread=False, dtype=torch.float32, seed=0):
    """One session's slice as the cell cache lays it out: cell 0 the scratch
    cell (unseen), the session's earlier cells, then the slice's own, row t
    seeing the history and own cells 0..t. With spread, the session's cells
    sit among another session's (the shim gathers them)."""
    g = torch.Generator().manual_seed(rows * 31 + history + seed)
    step = 2 if spread else 1
    cells = 1 + step * (history + rows)
    pool_k, pool_v = (torch.randn(cells, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    key, value = pool_k.permute(1, 0, 2).unsqueeze(0), pool_v.permute(1, 0, 2).unsqueeze(0)
    query = (torch.randn(1, rows, heads, head_dim, generator=g).transpose(1, 2) * 3).to(dtype)
    position = torch.full((cells,), 1 << 30)  # unseen: the scratch cell and another session's cells
    position[1::step] = torch.arange(history + rows)
    mask = position[None, :] <= torch.arange(history, history + rows)[:, None]
    return query, key, value, mask


# slices of 256+ rows (the causal path; shorter ones go through the mask) with
# and without a history; GQA; one kv head; head dims with a tail; cells among
# another session's; a shorter slice; a slice of a static method's rows
CAUSAL_CASES = [(9, 3, 256, 0, 64, False), (9, 3, 301, 100, 64, False), (4, 1, 260, 7, 20, True),
                (2, 2, 270, 513, 16, True), (9, 3, 40, 100, 64, False), (6, 2, 8, 30, 72, False)]


@pytest.mark.parametrize("heads,kv_heads,rows,history,head_dim,spread", CAUSAL_CASES)
def test_the_shim_takes_a_causal_slice_as_history_and_own_cells(shims, heads, kv_heads, rows, history, head_dim, spread):
    """A single session's slice (from 256 rows: dense history, causal own
    cells, two sdpa calls merged by their log-sum-exps; under that, sdpa
    through the mask or the kernel) gives sdpa's result through the mask,
    over fp32 and bf16 pools."""
    query, key, value, mask = causal_slice_operands(heads, kv_heads, rows, history, head_dim, spread)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(shims.call("masked_attention", query, key, value, mask, 0.3), want, rtol=1e-5, atol=1e-5)
    query, key, value = query.bfloat16(), key.bfloat16(), value.bfloat16()
    want = sdpa_in_fp32(query, key, value, mask, 0.3)
    got = shims.call("masked_attention", query, key, value, mask, 0.3)
    assert got.dtype == torch.bfloat16
    # two bf16 results merged: an ulp of bf16 each
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("change", ["a row sees one cell less", "two rows see a new cell", "a second session",
                                    "a window", "no history"])
def test_masks_that_are_not_a_causal_slice_keep_their_meaning(shims, change):
    """Masks near a causal slice but not one go the other ways (sdpa through
    the mask, or the kernel): each still gives sdpa's result."""
    query, key, value, mask = causal_slice_operands(6, 2, 260, 10, 32)
    if change == "a row sees one cell less":
        mask[120, 3] = False
    elif change == "two rows see a new cell":
        mask[5, 1 + 10 + 6] = True
    elif change == "a second session":
        mask[120:, 1:11] = False
    elif change == "a window":
        mask &= torch.arange(mask.shape[1])[None, :] > torch.arange(mask.shape[0])[:, None]
    else:
        mask[:, :11] = False
        mask[0, 11] = False
        mask[0, 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(shims.call("masked_attention", query, key, value, mask, 0.3), want, rtol=1e-5, atol=1e-5)


def sessions_slices_operands(heads, kv_heads, slices, head_dim, interleave=False, seed=0):
    """Several sessions' slices in one step, as the cell cache lays a server's
    prefill out: slices [(history, rows)], session i's cells after cell 0
    (the scratch cell, unseen), in blocks or every session's cells
    interleaved; the rows session by session, row t of a slice seeing its
    history and its own cells 0..t."""
    g = torch.Generator().manual_seed(seed + 17 * len(slices))
    sizes = [history + rows for history, rows in slices]
    if interleave:
        owner = [i for n in range(max(sizes)) for i, size in enumerate(sizes) if n < size]
    else:
        owner = [i for i, size in enumerate(sizes) for _ in range(size)]
    cells = 1 + len(owner)
    owner = torch.tensor([-1, *owner])
    position = torch.zeros(cells, dtype=torch.long)
    for i in range(len(slices)):
        position[owner == i] = torch.arange(sizes[i])
    pool_k, pool_v = (torch.randn(cells, kv_heads, head_dim, generator=g) for _ in range(2))
    key, value = pool_k.permute(1, 0, 2).unsqueeze(0), pool_v.permute(1, 0, 2).unsqueeze(0)
    total = sum(rows for _, rows in slices)
    query = torch.randn(1, total, heads, head_dim, generator=g).transpose(1, 2) * 3
    mask = torch.cat([(owner[None, :] == i) & (position[None, :] <= torch.arange(h, h + r)[:, None])
                      for i, (h, r) in enumerate(slices)])
    return query, key, value, mask


# a server's prefill of several prompts, sessions' cells in blocks or
# interleaved, and the way the shim takes each: prompts from scratch; prompts
# with histories and decode rows among them (apart: each row sees an eighth of
# the cells); one-row slices over few cells each, where the calls would cost
# more than the mask's extra scores; a long prompt beside short ones, whose
# causal blocks cost more than scoring the others' few cells
SESSIONS_CASES = [([(0, 120)] * 5, False, "slices"),
                  ([(300, 10), (0, 9), (600, 1), (200, 12), (50, 3), (400, 1), (0, 20), (100, 8)], True, "slices"),
                  ([(12, 1)] * 20, False, "mask"), ([(0, 300), (64, 1), (0, 20)], True, "mask")]


@pytest.mark.parametrize("slices,interleave,way", SESSIONS_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shim_takes_several_sessions_slices_apart(shims, slices, interleave, way, dtype):
    """Over more rows than a static method takes, a step of several
    sessions' causal slices attends each slice over its own session's cells
    (dense history, causal own cells) where that costs less than scoring
    every row against every cell through the mask: either way the result is
    sdpa's through the mask."""
    query, key, value, mask = sessions_slices_operands(6, 2, slices, 32, interleave)
    assert shims.attention_route(mask) == (way, len(slices) if way == "slices" else 0)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    want = sdpa_in_fp32(query, key, value, mask, 0.3)
    got = shims.call("masked_attention", query, key, value, mask, 0.3)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # two bf16 results merged: an ulp of bf16 each
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_over_many_rows_masks_that_are_no_slice_go_to_sdpa(shims):
    """Over more rows than a static method takes (a prefill of several
    sessions at once), fp32 and bf16 alike."""
    query, key, value, mask = attention_operands(6, 2, 40, 90, 32)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(shims.call("masked_attention", query, key, value, mask, 0.3), want, rtol=1e-5, atol=1e-5)
    query, key, value = query.bfloat16(), key.bfloat16(), value.bfloat16()
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(shims.call("masked_attention", query, key, value, mask, 0.3), want)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("rows,kv_heads", [(1, 3), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention_splits_a_rows_cells_among_threads(isa, shims, threads, rows, kv_heads, dtype):
    """One or two rows over many cells leave threads idle when each takes a
    (row, kv head): the cells are split into runs, one a thread, and the runs'
    partial softmaxes merged. A run may see no cell (the first row sees only
    the last third), a row may see nothing (zeros); the result is the same
    attention whatever the thread count."""
    query, key, value, mask = (t.to(dtype) if t.dtype == torch.float32 else t
                               for t in attention_operands(9, kv_heads, rows, 700, 64, seed=2))
    mask[0, :470] = False
    mask[1:] = False
    want = sdpa_in_fp32(query, key, value, mask, 0.3)
    want[:, :, 1:] = 0.0  # sdpa's NaN for a row that sees nothing; the kernel gives zeros
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = shims.call("masked_attention", query, key, value, mask, 0.3)
        if dtype == torch.float32:
            torch.testing.assert_close(build.masked_attention(query, key, value, mask, 0.3, isa=isa), want,
                                       rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(saved)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **tolerance)


# (heads, kv heads, head dim, rows, cells a row): groups of 3, 7 (tiles of 4 + 3, or 2 + 2 + 2 + 1 on AVX2)
# and 1 with head-dim tails; rows of a session each (the pool's cells dealt out in runs of 64), and one
# row over more heads' scores than the kernel holds at once (64 heads over 4300 cells on one thread: kv
# head by kv head)
LONG_ROW_CASES = [(9, 3, 64, 4, 320), (9, 3, 64, 1, 1100), (14, 2, 20, 2, 600), (8, 8, 72, 3, 300), (64, 1, 16, 1, 4300)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,rows,each", LONG_ROW_CASES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention_over_long_rows(isa, shims, heads, kv_heads, head_dim, rows, each, threads, dtype):
    """Rows over hundreds of cells go cell block by cell block, every kv
    head's rows of a block together (the pools' order), alone or split among
    the threads: the result is sdpa's whatever the thread count."""
    g = torch.Generator().manual_seed(heads + rows * 10 + each)
    cells = rows * each + 5
    pool_k, pool_v = (torch.randn(cells, kv_heads, head_dim, generator=g) for _ in range(2))
    key, value = pool_k.permute(1, 0, 2).unsqueeze(0), pool_v.permute(1, 0, 2).unsqueeze(0)
    query = torch.randn(1, rows, heads, head_dim, generator=g).transpose(1, 2) * 2
    owner = torch.arange(cells) // 64 % rows
    mask = owner[None, :] == torch.arange(rows)[:, None]
    mask[:, -5:] = False  # the pool's last cells are nobody's
    query, key, value = (t.to(dtype) for t in (query, key, value))
    want = sdpa_in_fp32(query, key, value, mask, 0.3)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = shims.call("masked_attention", query, key, value, mask, 0.3)
    finally:
        torch.set_num_threads(saved)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=8e-3, atol=1e-5)


def test_softmax_holds_for_large_and_distant_scores(isa):
    """The exp runs on max-subtracted scores: large ones do not overflow, and
    scores 100 apart give the far one no weight."""
    key = torch.zeros(1, 1, 3, 8)
    key[0, 0, 0, 0], key[0, 0, 1, 0], key[0, 0, 2, 0] = 1000.0, 900.0, 999.0
    value = torch.arange(24, dtype=torch.float32).reshape(1, 1, 3, 8)
    query = torch.zeros(1, 1, 1, 8)
    query[..., 0] = 1.0
    mask = torch.ones(1, 3, dtype=torch.bool)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=1.0)
    torch.testing.assert_close(build.masked_attention(query, key, value, mask, 1.0, isa=isa), want)


# --------------------------------------------------------- packed linear
def packed_operands(bits: int, rows: int, out_features: int, width: int, groups: int, row_stride: int = 0):
    """x, and a packed weight of random codes (every code value, 0 and the top
    included) with random scales and offsets, as passes/packed_weights.py
    stores them; plus the weight in float64."""
    from kvexport.passes.packed_weights import pack, pad_rows

    g = torch.Generator().manual_seed(bits * 7919 + rows * 1000 + out_features + width + groups)
    x = torch.randn(rows, row_stride or width, generator=g)[:, :width]
    codes, scale, offset, weight = random_weight(g, bits, out_features, width, groups)
    return x, pack(codes, bits), pad_rows(scale, bits), pad_rows(offset, bits), weight


def random_weight(g: torch.Generator, bits: int, out_features: int, width: int, groups: int):
    """Random codes (every value, 0 and the top included), scales and
    offsets, and the weight they make, in float64."""
    codes = torch.randint(0, 1 << bits, (out_features, width), generator=g, dtype=torch.uint8)
    codes[0, :2] = torch.tensor([0, (1 << bits) - 1], dtype=torch.uint8)
    scale, offset = torch.rand(out_features, groups, generator=g) + 0.01, torch.randn(out_features, groups, generator=g)
    size = width // groups
    weight = (codes.double().reshape(out_features, groups, size) * scale.double()[..., None]
              + offset.double()[..., None]).reshape(out_features, width)
    return codes, scale, offset, weight


# row counts over and under a register tile, weight rows not a multiple of the
# lanes (padding rows) or of a thread's band, per-row and grouped scales, strided rows
PACKED_CASES = [(b, r, n, k, gr, 0) for b in (4, 8) for r in (1, 2, 3, 4, 5, 8, 9, 16)
                for n, k, gr in ((64, 64, 2), (131, 72, 1), (5, 16, 2), (33, 576, 18))]
PACKED_CASES += [(4, 6, 40, 64, 8, 100), (8, 3, 9, 8, 1, 12), (4, 1, 1, 32, 1, 0)]


@pytest.mark.parametrize("bits,rows,out_features,width,groups,row_stride", PACKED_CASES)
def test_packed_linear(isa, shims, bits, rows, out_features, width, groups, row_stride):
    x, words, scale, offset, weight = packed_operands(bits, rows, out_features, width, groups, row_stride)
    out = torch.full((rows, out_features), float("nan"))
    got = build.packed_linear(x, words, scale, offset, bits, out_features, out=out, isa=isa)
    assert_float_sum(got, x, weight)
    assert_float_sum(shims.call("packed_linear", x, words, scale, offset, bits, out_features), x, weight)


def assert_float_sum(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """got is x @ weight.T (float64) up to fp32 rounding: within 1e-6 of the
    sum of the products' magnitudes (a few ulps of each term, summed)."""
    want = x.double() @ weight.T
    bound = 1e-6 * (x.double().abs() @ weight.abs().T) + 1e-6
    assert got.dtype == torch.float32 and got.shape == want.shape
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, f"off by {(got.double() - want).abs().max():.3g} at {divmod(int(excess.argmax()), got.shape[1])}"


def test_the_packed_op_is_its_decomposition():
    """kvexport::packed_linear's eager form (what tracing and the reference
    run) is the stored dequantization and a linear."""
    from kvexport.partitioners.aoti.passes.packed_linear import packed_linear

    x, words, scale, offset, weight = packed_operands(4, 3, 40, 64, 2)
    assert_float_sum(packed_linear(x, words, scale, offset, 4, 40), x, weight)


# ----------------------------------------------------------- int8 linear
def int8_operands(bits: int, rows: int, out_features: int, width: int, groups: int, row_stride: int = 0,
                  half: bool = False, qact: int = 1):
    """x, and a weight of random codes in the blocks format with random
    scales and offsets (fp16 with `half`, as exports store them); plus x
    rounded by the definition (passes/packed_weights.py; `qact` 1: int8_rows,
    2: int8x2_rows, 3: int16_rows, 4: int8_peak_rows, contract/schemes.py's
    QACT) and the
    weight, both float64."""
    from kvexport.contract.schemes import QACT
    from kvexport.passes.packed_weights import pack_blocks, pack_table, rounded_rows

    g = torch.Generator().manual_seed(bits * 7919 + rows * 1000 + out_features + width + groups + 1)
    x = torch.randn(rows, row_stride or width, generator=g)[:, :width]
    x[0, :32] = 0.0  # an all-zero block
    if rows > 1:
        x[1, 32:64] *= 1e4  # a block far larger than the rest of its row
    if rows > 2 and width >= 96:
        x[2, 64:96] = x[2, :32] = 3.0  # two peak blocks of one row (a tie)
    codes, scale, offset, weight = random_weight(g, bits, out_features, width, groups)
    if half:
        scale, offset = scale.half(), offset.half()
        weight = (codes.double().reshape(out_features, groups, -1) * scale.double()[..., None]
                  + offset.double()[..., None]).reshape(out_features, width)
    rounded = rounded_rows(x, QACT[qact])
    return x, pack_blocks(codes, bits), pack_table(scale), pack_table(offset), rounded.double(), weight


# row counts over and under a register tile and a pass of rows (7 on
# AVX-512, 4 on AVX2), panels of weight rows not a multiple of a tile or of a
# thread's band, per-row and grouped scales, strided rows, fp32 and fp16 tables
INT8_CASES = [(b, r, n, k, gr, 0, h) for b in (4, 8) for r in (1, 2, 3, 4, 5, 8, 9, 16)
              for n, k, gr, h in ((64, 64, 2, False), (136, 96, 1, True), (8, 64, 1, False), (40, 576, 18, True))]
INT8_CASES += [(4, 6, 40, 128, 2, 200, True), (8, 3, 8, 64, 2, 70, False), (4, 1, 8, 32, 1, 0, True)]
# groups of several blocks, odd block counts
INT8_CASES += [(4, 3, 40, 192, 2, 0, True), (4, 1, 16, 160, 1, 0, False), (4, 2, 24, 224, 7, 0, True),
               (4, 7, 16, 96, 3, 130, False)]
# many passes of rows, more panels than one chunk (the 576 x 4096 weight), strided rows
INT8_CASES += [(b, r, n, k, gr, 0, True) for b in (4, 8) for r in (17, 40, 137)
               for n, k, gr in ((64, 64, 2), (136, 96, 1), (8, 64, 1))]
INT8_CASES += [(4, 12, 40, 128, 2, 200, False), (8, 24, 8, 64, 2, 70, True), (4, 9, 576, 4096, 128, 0, True)]


@pytest.mark.parametrize("bits,rows,out_features,width,groups,row_stride,half", INT8_CASES)
def test_int8_linear(isa, shims, bits, rows, out_features, width, groups, row_stride, half):
    """The kernel rounds x to the same int8 codes as the definition and sums
    their products exactly: one code off moves a result by a step times a
    weight, far more than fp32 rounding (the bound) allows."""
    x, data, scale, offset, rounded, weight = int8_operands(bits, rows, out_features, width, groups, row_stride, half)
    out = torch.full((rows, out_features), float("nan"))
    assert_float_sum(build.int8_linear(x, data, scale, offset, bits, out=out, isa=isa), rounded, weight)
    assert_float_sum(shims.call("int8_linear", x, data, scale, offset, bits, 1), rounded, weight)
    for products in INT8_PRODUCTS[isa]:
        assert_float_sum(build.int8_linear(x, data, scale, offset, bits, isa=isa, products=products), rounded, weight)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_linear_sums_the_largest_products_exactly(isa, shims, bits, rows):
    """Codes at their top and at 0 by activations that all round to +127 or
    -127 (each row constant): every integer sum of a block reaches its
    largest magnitude (the AVX2 build's int16 sums of 4-bit products
    16 * 15 * 127, its 8-bit pairs 2 * 128 * 127) and stays exact."""
    from kvexport.passes.packed_weights import _int8_rows, pack_blocks, pack_table

    out_features, width = 24, 128
    codes = torch.zeros(out_features, width, dtype=torch.uint8)
    codes[:8], codes[16:, ::2] = (1 << bits) - 1, (1 << bits) - 1  # panels of the top, of 0, and of both
    scale, offset = torch.ones(out_features, 2), torch.zeros(out_features, 2)
    x = torch.tensor([(-1.0) ** m * (m + 1) for m in range(rows)])[:, None].expand(rows, width).contiguous()
    data, tables = pack_blocks(codes, bits), (pack_table(scale), pack_table(offset))
    for got in [build.int8_linear(x, data, *tables, bits, isa=isa), shims.call("int8_linear", x, data, *tables, bits, 1)]:
        assert_float_sum(got, _int8_rows(x).double(), codes.double())


# finer activations than one int8 term: two terms (qact 2: one row and a pass's worth, 2 M rows of codes: 8
# sessions are 16, two passes; 5 rows, passes of 6 and 4 code rows), int16 codes (qact 3: 8 sessions are two
# passes on AVX2) and second codes on each row's peak blocks (qact 4: one row, passes whose rows peak in
# different blocks, a tie), odd block counts and groups of several blocks, prefill-sized over more panels than
# one chunk, strided rows
FINER_CASES = [(q, b, r, n, k, gr, s, h) for q in (2, 3, 4) for b in (4, 8) for r, n, k, gr, s, h in (
    (1, 64, 64, 2, 0, False), (3, 136, 96, 1, 0, True), (5, 24, 224, 7, 0, True), (8, 40, 576, 18, 0, True),
    (9, 576, 4096, 128, 0, True), (40, 64, 64, 2, 70, False), (4, 16, 160, 1, 0, False), (1, 136, 576, 1, 0, True))]


@pytest.mark.parametrize("qact,bits,rows,out_features,width,groups,row_stride,half", FINER_CASES)
def test_int8_linear_with_finer_activations(isa, shims, qact, bits, rows, out_features, width, groups, row_stride,
                                            half):
    """qact=2 rounds x and then its rounding error to the codes of the
    definition (int8x2_rows), qact=3 rounds x to int16 codes (int16_rows),
    qact=4 adds the error's codes on each row's peak blocks alone
    (int8_peak_rows), and the kernel sums their products exactly; the
    result is closer to the float product than one int8 term's."""
    x, data, scale, offset, rounded, weight = int8_operands(bits, rows, out_features, width, groups, row_stride, half,
                                                            qact=qact)
    out = torch.full((rows, out_features), float("nan"))
    got = build.int8_linear(x, data, scale, offset, bits, qact, out=out, isa=isa)
    assert_float_sum(got, rounded, weight)
    assert_float_sum(shims.call("int8_linear", x, data, scale, offset, bits, qact), rounded, weight)
    for products in INT8_PRODUCTS[isa]:
        assert_float_sum(build.int8_linear(x, data, scale, offset, bits, qact, isa=isa, products=products), rounded,
                         weight)
    exact = x.double() @ weight.T
    one_term = (build.int8_linear(x, data, scale, offset, bits, isa=isa).double() - exact).abs().amax(1)
    error = (got.double() - exact).abs().amax(1)
    if qact != 4:
        assert error.max() < one_term.max() / 30
    elif rows > 1:  # row 1's error is its huge block's, which the second codes all but remove
        assert error[1] < one_term[1] / 30


@pytest.mark.parametrize("bits", [4, 8])
def test_int16_codes_are_the_definitions_to_the_last_one(isa, bits):
    """One int16 code off moves a result by a step (1/32767 of its block's
    top) times a weight, within assert_float_sum's bound: here each row's
    values sit on whole steps but one, chosen to round half to even
    (round(x / step) ties), so a kernel that rounds otherwise, or
    computes the step otherwise, lands a whole weight code away."""
    from kvexport.passes.packed_weights import INV_32767, _int16_rows, pack_blocks, pack_table

    width, out_features = 64, 16
    top = 32767 * 2.0**-14  # its step, top * INV_32767 in fp32, is 2 ** -14: whole and half steps are exact
    step = torch.tensor(top) * torch.tensor(INV_32767, dtype=torch.float32)
    assert step == 2.0**-14
    g = torch.Generator().manual_seed(bits)
    x = torch.randint(-32000, 32001, (3, width), generator=g).float() * step
    x[:, 0::32] = top  # every block's top
    x[:, 1::32] = (torch.tensor([[2.5], [-6.5], [100.5]]) * step).expand(3, 2)  # ties: to 2, -6 and 100
    codes = torch.zeros(out_features, width, dtype=torch.uint8)
    codes[:, 1::32] = (1 << bits) - 1  # the weight reads only the ties' codes
    ones, zeros = torch.ones(out_features, 1), torch.zeros(out_features, 1)
    got = build.int8_linear(x, pack_blocks(codes, bits), pack_table(ones), pack_table(zeros), bits, 3, isa=isa)
    want = (_int16_rows(x).double() @ codes.double().T).float()
    assert torch.equal(got, want), (got[:, 0], want[:, 0])
    assert torch.equal(x[:, 1] / step, torch.tensor([2.5, -6.5, 100.5]))  # ties, as the definition divides
    assert torch.equal(_int16_rows(x)[:, 1], torch.tensor([2.0, -6.0, 100.0]) * step)


INT8_PRODUCTS = {isa: ["maddubs", "vnni"] if build.has_vnni(isa) else ["maddubs"] for isa in ISAS}


@pytest.fixture(scope="module")
def disassembly(isa) -> dict[str, str]:
    """Each kernel object of the isa's build, as objdump lists its code."""
    import shutil
    import subprocess

    if not shutil.which("objdump"):
        pytest.skip("objdump (binutils) is not installed")
    objects = build._build("objects", isa)
    return {name: subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(objects / f"{name}.o")],
                                 capture_output=True, text=True).stdout for _, _, name in build._units(isa)}


def test_every_kernel_build_keeps_its_prefetches(disassembly):
    """The kernels stream weights a few rows ahead into L2; a compiler that
    drops those fetches (GCC deletes a loop of _mm_prefetch alone) leaves
    results unchanged and the products from memory 1.2 x slower, so only the
    machine code shows it."""
    for name, code in disassembly.items():
        assert "prefetcht1" in code, f"{name} lost its prefetches"


PRODUCT = re.compile(r"\b(vfmadd\w+|vdpbf16ps|vpdpbusds?|vpdpwssds?|vpmaddubsw|vpmaddwd)\b")
STACK_STORE = re.compile(r"\bvmov\w*\s+%[yz]mm\d+,\s*(-?0x[0-9a-f]+)?\(%rsp\)")
BACKWARD_JUMP = re.compile(r"^\s*([0-9a-f]+):\s+j\w+\s+([0-9a-f]+) <")


def hot_loops(code: str) -> dict[str, list[str]]:
    """Per function of an objdump listing, its hot loop: of the innermost
    loops (a backward jump's span that holds no other), the one densest in
    vector products. Empty where a function has none."""
    loops = {}
    for listing in code.split("\n\n"):
        name, *lines = listing.strip().splitlines() or [""]
        at = [int(line.split(":")[0], 16) for line in lines]
        spans = [(int(m.group(2), 16), int(m.group(1), 16)) for line in lines if (m := BACKWARD_JUMP.match(line))]
        spans = [(lo, hi) for lo, hi in spans if at and at[0] <= lo < hi]
        inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
        bodies = [[line for a, line in zip(at, lines) if lo <= a <= hi] for lo, hi in inner]
        density = lambda body: sum(bool(PRODUCT.search(line)) for line in body) / len(body)  # noqa: E731
        loops[name] = max(bodies, key=density, default=[])
    return loops


def test_register_tiles_stay_in_registers(disassembly):
    """In every kernel build, a register tile's accumulators stay in
    registers across its hot loop. Once a loop left rolled indexes them,
    and an asm statement may read memory they could be in, GCC keeps them
    in memory too and stores each one every step: one store for each FMA,
    results unchanged, 8-row products 1.6-1.8 x slower (int8's maddubs
    build held most of a block's products so: 1.08-1.14 x). Only the
    machine code shows it.

    The row kernel's tiles, the one-row tile of a batch-1 step above all,
    store no vector at all in a hot loop. Its one-row bf16 tile once loaded
    its 8 widened weight vectors before their FMAs, 17 vectors for AVX2's 16
    registers, and kept one accumulator on the stack, stored and read back
    every step (1 store for 8 FMAs, which the first rule lets pass): from
    memory it took 1.1 x the time, in cache 1.3 x."""
    checked = row_kernel = 0
    for name, code in disassembly.items():
        for function, loop in hot_loops(code).items():
            products = sum(bool(PRODUCT.search(line)) for line in loop)
            stores = [line.strip() for line in loop if STACK_STORE.search(line)]
            if products >= 4:
                checked += 1
                assert len(stores) * 4 <= products, f"{name}: {function} stores {stores} for {products} products"
                if name.startswith("rows_linear"):
                    row_kernel += 1
                    assert not stores, f"{name}: {function} stores {stores}"
    assert checked >= 10 and row_kernel >= 10


@pytest.mark.parametrize("bits,qact,groups,rows", [(4, 1, 3, 5), (8, 1, 3, 5), (4, 2, 3, 5), (4, 3, 3, 5), (8, 3, 3, 5),
                                                   (8, 3, 1, 5), (8, 3, 1, 1), (8, 3, 3, 1), (4, 3, 3, 1), (4, 4, 3, 5),
                                                   (4, 4, 3, 1), (8, 4, 1, 5)])
def test_the_int8_kernel_runs_vnni_where_the_cpu_has_it(isa, shims, bits, qact, groups, rows):
    """Both builds sum the same integers: with 4-bit codes, and with int16
    codes (vpdpwssd against madd; 8w's one scale a row too), the same bits
    (one term or two, whichever tiling the VNNI build takes: 136 outputs
    are 17 panels, in pairs and one alone; one row of int16 codes by 8-bit
    ones, WideRow on AVX-512); compiled code (the shim) runs the VNNI build
    where the CPU has it."""
    if "vnni" not in INT8_PRODUCTS[isa]:
        pytest.skip(f"this CPU has no VNNI for the {isa} build")
    x, data, scale, offset, _, _ = int8_operands(bits, rows, 136, 96, groups, half=True, qact=qact)
    vnni = build.int8_linear(x, data, scale, offset, bits, qact, isa=isa, products="vnni")
    assert torch.equal(shims.call("int8_linear", x, data, scale, offset, bits, qact), vnni)
    if bits == 4 or qact == 3:
        assert torch.equal(build.int8_linear(x, data, scale, offset, bits, qact, isa=isa, products="maddubs"), vnni)


def test_the_int8_op_is_its_decomposition():
    """kvexport::int8_linear's eager form (what tracing and the reference
    run) is the stored rounding of x, the dequantization and a linear."""
    from kvexport.partitioners.aoti.passes.int8_linear import int8_linear

    for qact in (1, 2, 3, 4):
        x, data, scale, offset, rounded, weight = int8_operands(4, 3, 40, 64, 2, qact=qact)
        assert_float_sum(int8_linear(x, data, scale, offset, 4, qact), rounded, weight)


# ------------------------------------------------------------ refusals
def _int8(bits=4, width=64, groups=2, data_dtype=torch.uint8, scale_rows=5, offset_dtype=torch.float32, qact=1):
    x, data, _, _, _, _ = int8_operands(4, 2, 40, 64, 2)
    if width != 64:
        x, data = torch.randn(2, width), torch.zeros(5, width * 4, dtype=torch.uint8)
    scale, offset = torch.rand(scale_rows, groups * 8) + 0.01, torch.randn(scale_rows, groups * 8)
    return x, data.to(data_dtype), scale, offset.to(offset_dtype), bits, qact


def _packed(bits=4, groups=2, width=64, words_dtype=torch.int32, rows=40):
    x, words, scale, offset, _ = packed_operands(4, 2, 40, 64, 2)
    if width != 64:
        x = torch.randn(2, width)
        words = torch.zeros(words.shape[0], width, dtype=torch.int32)
    return x, words.to(words_dtype), scale[:, :groups].contiguous(), offset[:, :groups].contiguous(), bits, rows


REFUSED = [
    ("packed_linear", lambda: _packed(bits=3), "bits must be 4 or 8|of 4 or 8 bits"),
    ("packed_linear", lambda: _packed(words_dtype=torch.int64), "words int32|int32 words"),
    ("packed_linear", lambda: _packed(width=60, groups=1), "multiple of 8 \\* groups"),
    ("packed_linear", lambda: _packed(rows=41), "rows must be within|rows <= lanes"),
    ("int8_linear", lambda: _int8(bits=2), "bits must be 4 or 8|of 4 or 8 bits"),
    ("int8_linear", lambda: _int8(qact=5), "qact must be 1 \\(int8\\), 2 \\(int8x2\\), 3 \\(int16\\) or 4 "
     "\\(int8-peak\\)|qact 1, 2, 3 or 4"),
    ("int8_linear", lambda: _int8(qact=0), "qact must be 1 \\(int8\\), 2 \\(int8x2\\), 3 \\(int16\\) or 4 "
     "\\(int8-peak\\)|qact 1, 2, 3 or 4"),
    ("int8_linear", lambda: _int8(data_dtype=torch.int8), "data uint8|uint8 data"),
    ("int8_linear", lambda: _int8(width=48, groups=1), "multiple of 32"),
    ("int8_linear", lambda: _int8(groups=4), "multiple of 32 \\* groups"),
    ("int8_linear", lambda: _int8(scale_rows=4), "\\[N / 8, groups \\* 8\\]"),
    ("int8_linear", lambda: _int8(offset_dtype=torch.float16), "float32 or both float16|both fp32 or both fp16"),
    ("int8_linear", lambda: _int8(offset_dtype=torch.bfloat16), "float32 or both float16|both fp32 or both fp16"),
    ("rows_linear", lambda: (torch.randn(2, 8), torch.randn(4, 9)), "weight must be \\[N, K\\]"),
    ("rows_linear", lambda: (torch.randn(2, 8), torch.randn(8, 4).t()), "unit stride along K"),
    ("rows_linear", lambda: (torch.randn(2, 8).double(), torch.randn(4, 8).double()), "float32"),
    ("rows_linear", lambda: (torch.randn(2, 8).bfloat16(), torch.randn(4, 8)), "both be float32 or both bfloat16"),
    ("masked_attention", lambda: (torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                                  torch.ones(2, 4, dtype=torch.bool), 1.0), "mask must be \\[T, C\\]"),
    ("masked_attention", lambda: (torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                                  torch.ones(2, 5), 1.0), "mask bool"),
    ("masked_attention", lambda: (torch.randn(1, 3, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                                  torch.ones(2, 5, dtype=torch.bool), 1.0), "multiple of the key heads"),
]


@pytest.mark.parametrize("name,operands,why", REFUSED)
def test_operands_the_kernels_cannot_read_are_refused_with_the_reason(shims, capfd, name, operands, why):
    """Both ways in refuse before any pointer is read: the Python entry point
    with a ValueError, the shim with a failure code and its reason on stderr
    (generated code reports only that a shim failed)."""
    with pytest.raises(ValueError, match=f"{name} takes"):
        getattr(build, name)(*operands())
    with pytest.raises(ValueError, match="refused"):
        shims.call(name, *operands())
    err = capfd.readouterr().err
    assert f"kvexport {name}: refused its operands" in err
    assert re.search(why, err), err


def test_the_signatures_are_declared_once_and_compiled_against():
    """kernels.h comes from the table, and the sources declare no signature
    of their own: a math or shim that strays from the table fails to build."""
    from pathlib import Path

    header = build.header()
    for kernel in KERNELS:
        assert kernel.math_declaration() in header
        assert kernel.shim is None or kernel.shim_declaration() in header
    for source in Path(build.__file__).parent.glob("*.cpp"):
        assert 'extern "C" void' not in source.read_text(), source.name


# ---------------------------------------------------------------- build
def test_a_failed_build_names_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_commands", lambda kind, isa, out, objects: [["false"]])
    with pytest.raises(ExportError, match="--row-kernel off"):
        build.archive_dir()
    assert not [p for p in (tmp_path / "kernels").iterdir()]  # nothing half-built is kept


def test_auto_falls_back_to_the_blas_when_the_kernel_cannot_be_built(tmp_path, monkeypatch):
    from kvexport.partitioners.aoti.kernels import probe

    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(build, "_commands", lambda kind, isa, out, objects: builds.append(kind) or [["false"]])
    monkeypatch.setattr(probe, "_UNBUILT", set())
    build._load_math.cache_clear()
    try:
        assert probe.kernel_rows("cpu", "auto") == ()
        tried = len(builds)
        assert probe.kernel_rows("cpu", "auto") == () and len(builds) == tried  # not again in this process
        assert not (tmp_path / "probes").exists()  # nor on disk: the next export tries again
    finally:
        build._load_math.cache_clear()


def test_every_shimmed_op_is_defined_whichever_kernels_a_compile_uses():
    """inductor_configs maps every shimmed op, in a process that imported no
    pass (a compile worker with the row kernel off and the packed kernel on)."""
    import subprocess
    import sys

    code = ("from kvexport.partitioners.aoti.kernels.build import inductor_configs; "
            "print(sorted(str(op) for op in inductor_configs()['aot_inductor.custom_ops_to_c_shims']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    from kvexport.partitioners.aoti.kernels.signatures import SHIMMED

    assert all(f"kvexport.{kernel.name}.default" in done.stdout for kernel in SHIMMED)
