"""kvexport's row kernel (exporter/row_kernel.cpp): the products it computes,
over the shapes its tiles and tails cover, and a build that fails by name."""

from __future__ import annotations

import pytest
import torch

from kvexport.contract.errors import ExportError
from kvexport.exporter import row_kernel

pytestmark = pytest.mark.skipif(not row_kernel.supported(), reason="the row kernel needs x86 with AVX2 or AVX-512")


def run_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"))
    row_kernel.shared_kernel().kvexport_rows_linear(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                                                    x.shape[0], weight.shape[0], weight.shape[1])
    return out


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
    monkeypatch.setattr(row_kernel, "_commands", lambda kind, out: [["false"]])
    row_kernel.shared_kernel.cache_clear()
    try:
        assert kernel_probe.kernel_rows("cpu", "auto") == ()
        assert not (tmp_path / "probes").exists()  # a failure is not remembered: the next export tries again
    finally:
        row_kernel.shared_kernel.cache_clear()
