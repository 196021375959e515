"""kvexport's row kernel (exporter/row_kernel.cpp): the products it computes,
over the shapes its tiles and tails cover, and a build that fails by name."""

from __future__ import annotations

import pytest
import torch

from kvexport.contract.errors import ExportError
from kvexport.exporter import row_kernel

pytestmark = pytest.mark.skipif(not row_kernel.supported(), reason="the row kernel needs x86 with AVX2 or AVX-512")


def run_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return row_kernel.rows_linear(x, weight, out=torch.full((x.shape[0], weight.shape[0]), float("nan")))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("out_features,width", [(64, 64), (131, 72), (5, 7), (200, 1)])
def test_products_match_the_reference(rows, out_features, width):
    """Row counts over and under a register tile, weight rows not a multiple
    of a tile or a thread's band, widths with a vector tail."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x, weight = torch.randn(rows, width, generator=g), torch.randn(out_features, width, generator=g)
    torch.testing.assert_close(run_kernel(x, weight), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_rows_may_be_strided():
    g = torch.Generator().manual_seed(1)
    wide, weight = torch.randn(6, 100, generator=g), torch.randn(40, 64, generator=g)
    x = wide[:, :64]  # row stride 100
    torch.testing.assert_close(run_kernel(x, weight), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_failed_build_names_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(row_kernel, "_commands", lambda kind, out: [["false"]])
    with pytest.raises(ExportError, match="--row-kernel off"):
        row_kernel.archive_dir()
    assert not [p for p in (tmp_path / "kernels").iterdir()]  # nothing half-built is kept


def test_auto_falls_back_to_the_blas_when_the_kernel_cannot_be_built(tmp_path, monkeypatch):
    from kvexport.exporter import kernel_probe

    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path))
    builds = []
    monkeypatch.setattr(row_kernel, "_commands", lambda kind, out: builds.append(kind) or [["false"]])
    monkeypatch.setattr(kernel_probe, "_UNBUILT", set())
    row_kernel.shared_kernel.cache_clear()
    try:
        assert kernel_probe.kernel_rows("cpu", "auto") == ()
        tried = len(builds)
        assert kernel_probe.kernel_rows("cpu", "auto") == () and len(builds) == tried  # not again in this process
        assert not (tmp_path / "probes").exists()  # nor on disk: the next export tries again
    finally:
        row_kernel.shared_kernel.cache_clear()


def run_attention(query, key, value, mask, scale):
    return row_kernel.masked_attention(query, key, value, mask, scale, out=torch.full(query.shape, float("nan")))


@pytest.mark.parametrize("heads,kv_heads,rows,cells,head_dim", [
    (9, 3, 8, 300, 64), (4, 4, 1, 7, 16), (6, 2, 3, 50, 20), (8, 1, 5, 33, 128), (2, 2, 2, 1, 256), (3, 1, 16, 200, 72)])
def test_masked_attention_matches_sdpa_over_pool_views(heads, kv_heads, rows, cells, head_dim):
    """GQA groups, head dims with a vector tail and over 64, one cell, rows
    that see nothing (zeros, as sdpa gives); keys and values as strided views
    of [C, Hkv, D] pools, the query as a transposed [1, T, H, D]."""
    g = torch.Generator().manual_seed(heads * 100 + cells)
    pool_k, pool_v = torch.randn(cells, kv_heads, head_dim, generator=g), torch.randn(cells, kv_heads, head_dim, generator=g)
    key, value = pool_k.permute(1, 0, 2).unsqueeze(0), pool_v.permute(1, 0, 2).unsqueeze(0)
    query = torch.randn(1, rows, heads, head_dim, generator=g).transpose(1, 2) * 3
    mask = torch.rand(rows, cells, generator=g) > 0.6
    mask[0] = False
    mask[-1, 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(run_attention(query, key, value, mask, 0.3), want, rtol=1e-5, atol=1e-5)


def test_masked_attention_softmax_holds_for_large_and_distant_scores():
    """The exp runs on max-subtracted scores: large ones do not overflow, and
    scores 100 apart give the far one no weight."""
    key = torch.zeros(1, 1, 3, 8)
    key[0, 0, 0, 0], key[0, 0, 1, 0], key[0, 0, 2, 0] = 1000.0, 900.0, 999.0
    value = torch.arange(24, dtype=torch.float32).reshape(1, 1, 3, 8)
    query = torch.zeros(1, 1, 1, 8)
    query[..., 0] = 1.0
    mask = torch.ones(1, 3, dtype=torch.bool)
    want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=1.0)
    torch.testing.assert_close(run_attention(query, key, value, mask, 1.0), want)


def test_the_python_entry_points_refuse_operands_the_kernels_cannot_read():
    """ctypes hands raw pointers to the kernels: a shape or stride they do not
    take is refused before any is read."""
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="rows_linear takes"):
        row_kernel.rows_linear(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="rows_linear takes"):
        row_kernel.rows_linear(x, torch.randn(8, 4).t())  # weight rows not contiguous
    with pytest.raises(ValueError, match="rows_linear takes"):
        row_kernel.rows_linear(x.double(), weight.double())
    query, pool = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="masked_attention takes"):
        row_kernel.masked_attention(query, pool, pool, mask[:, :4], 1.0)
    with pytest.raises(ValueError, match="masked_attention takes"):
        row_kernel.masked_attention(query, pool, pool, mask.float(), 1.0)
    with pytest.raises(ValueError, match="masked_attention takes"):
        row_kernel.masked_attention(torch.randn(1, 3, 2, 8), pool, pool, mask, 1.0)  # 3 heads over 2 KV heads
