"""Builds kvexport's kernels for the instruction set inductor compiles for,
and hands AOTInductor what it needs to call them: the row kernel
(row_kernel.cpp, fp32 products over a few rows) and the masked attention
(attention_kernel.cpp, a few query rows over a cell pool).

Two builds of the sources, each kept in kvexport's cache directory under a
key of the sources, the flags and the compiler:
- a static archive holding the kernels and their C shims, which AOTInductor
  links into each compiled method (`custom_op_libs`), so a package's library
  carries them and needs nothing of kvexport at run time;
- a shared library of the kernels alone, which `rows_linear` and
  `masked_attention` below call through ctypes (for the kernel probe,
  exporter/kernel_probe.py, bench/ and the tests).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvexport.contract.errors import ExportError

SOURCES = (Path(__file__).with_name("row_kernel.cpp"), Path(__file__).with_name("attention_kernel.cpp"))
FILES = (*SOURCES, Path(__file__).with_name("kernel_vec.h"))  # everything a build reads
LIBRARY = "kvexport_rows"
ROWS_SHIM = "AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* ret0)"
ATTENTION_SHIM = ("AOTITorchError aoti_torch_cpu_masked_attention(AtenTensorHandle query, AtenTensorHandle key, "
                  "AtenTensorHandle value, AtenTensorHandle mask, double scale, AtenTensorHandle* ret0)")
ISAS = ("avx2", "avx512")


def supported() -> bool:
    """The kernel is written for x86 with AVX2+FMA or AVX-512: is that what
    inductor compiles for here?"""
    return platform.machine() in ("x86_64", "AMD64") and _isa() in ISAS


def inductor_configs() -> dict:
    """The AOTInductor settings under which `kvexport::rows_linear` and
    `kvexport::masked_attention` compile to direct calls of the kernels
    linked into the method's library. The archive's folder must be on
    LIBRARY_PATH for the link (exporter/aoti_compile.py)."""
    from kvexport.passes.masked_attention import MASKED_ATTENTION
    from kvexport.passes.row_kernel_linear import ROWS_LINEAR

    return {"aot_inductor.custom_ops_to_c_shims": {ROWS_LINEAR: [ROWS_SHIM], MASKED_ATTENTION: [ATTENTION_SHIM]},
            "aot_inductor.custom_op_libs": [LIBRARY]}


def archive_dir() -> Path:
    """The folder holding lib<LIBRARY>.a, built for inductor's instruction set."""
    return _build("archive")


def rows_linear(x, weight, out=None):
    """x [M, K] (unit stride along K) @ weight [N, K] (contiguous).T on the
    row kernel, into out [M, N] (contiguous) when given."""
    import torch

    (m, k), n = x.shape, weight.shape[0]
    out = x.new_empty(m, n) if out is None else out
    if not (x.dtype == weight.dtype == out.dtype == torch.float32 and weight.shape[1] == k and x.stride(1) == 1
            and weight.is_contiguous() and out.is_contiguous() and tuple(out.shape) == (m, n)):
        raise ValueError("rows_linear takes fp32 x [M, K] with unit stride along K, a contiguous weight [N, K] "
                         "and out [M, N]")
    shared_kernel().kvexport_rows_linear(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), m, n, k)
    return out


def masked_attention(query, key, value, mask, scale: float, out=None):
    """sdpa(query [1, H, T, D], key and value [1, Hkv, C, D], bool mask [T, C],
    GQA) on the masked attention kernel, into out [1, H, T, D] (contiguous)
    when given; unit strides along D."""
    import torch

    heads, rows, dim = query.shape[1:]
    kv_heads, cells = key.shape[1:3]
    out = query.new_empty(1, heads, rows, dim) if out is None else out
    if not (query.dtype == key.dtype == value.dtype == out.dtype == torch.float32 and mask.dtype == torch.bool
            and query.shape[0] == key.shape[0] == 1 and key.shape == value.shape and key.shape[3] == dim
            and heads % kv_heads == 0 and tuple(mask.shape) == (rows, cells)
            and query.stride(3) == key.stride(3) == value.stride(3) == 1
            and out.is_contiguous() and tuple(out.shape) == (1, heads, rows, dim)):
        raise ValueError("masked_attention takes fp32 query [1, H, T, D], key and value [1, Hkv, C, D] (unit "
                         "strides along D), a bool mask [T, C] and out [1, H, T, D]")
    shared_kernel().kvexport_masked_attention(
        query.data_ptr(), query.stride(1), query.stride(2), key.data_ptr(), key.stride(1), key.stride(2),
        value.data_ptr(), value.stride(1), value.stride(2), mask.data_ptr(), mask.stride(0), mask.stride(1),
        out.data_ptr(), heads, kv_heads, rows, cells, dim, scale)
    return out


@functools.cache
def shared_kernel() -> ctypes.CDLL:
    """The kernels alone: `kvexport_rows_linear(x, ldx, w, out, M, N, K)` and
    `kvexport_masked_attention(q, q_sh, q_st, k, k_sh, k_sc, v, v_sh, v_sc,
    mask, m_st, m_sc, out, H, Hkv, T, C, D, scale)`. Call them through
    `rows_linear` and `masked_attention`, which check the operands."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library = ctypes.CDLL(str(_build("shared") / f"lib{LIBRARY}.so"))
    library.kvexport_rows_linear.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64]
    library.kvexport_rows_linear.restype = None
    library.kvexport_masked_attention.argtypes = [ptr, i64, i64] * 3 + [ptr, i64, i64, ptr] + [i64] * 5 + [ctypes.c_float]
    library.kvexport_masked_attention.restype = None
    return library


def _isa() -> str:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa()).split()[0] if pick_vec_isa() else ""


def _commands(kind: str, out: Path) -> list[list[str]]:
    import torch.utils.cpp_extension
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    compiler = get_cpp_compiler()
    flags = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", *pick_vec_isa().build_arch_flags().split()]
    if kind == "shared":
        return [[compiler, *flags, "-shared", *map(str, SOURCES), "-o", str(out / f"lib{LIBRARY}.so")]]
    includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
    objects = [out / source.with_suffix(".o").name for source in SOURCES]
    return [*([compiler, *flags, "-DKVEXPORT_AOTI_SHIM", *includes, "-c", str(source), "-o", str(obj)]
              for source, obj in zip(SOURCES, objects)),
            ["ar", "rcs", str(out / f"lib{LIBRARY}.a"), *map(str, objects)]]


@functools.cache
def _version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def _build(kind: str) -> Path:
    """Builds once per source, flags and compiler; concurrent builds (compile
    workers) each write their own folder and the first rename wins."""
    from kvexport.contract.package import cache_dir

    if not supported():
        raise ExportError(f"the row kernel needs an x86 CPU with AVX2 or AVX-512; inductor compiles for {_isa() or 'no vector ISA'} here")
    probe = _commands(kind, Path("OUT"))
    key = hashlib.sha256("\0".join([*(f.read_text() for f in FILES), repr(probe), _version(probe[0][0])]).encode())
    key = key.hexdigest()[:16]
    root = cache_dir() / "kernels"
    final = root / f"{kind}-{key}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
    try:
        for command in _commands(kind, work):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise ExportError(f"building kvexport's kernels failed ({' '.join(command[:2])} ...):\n{done.stderr[-2000:]}"
                                  "\nthe fix: a C++ compiler with AVX2 support (the one AOTInductor uses), or "
                                  "--row-kernel off")
        try:
            os.rename(work, final)
        except OSError:  # another process built it first
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
