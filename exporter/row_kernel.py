"""Builds kvexport's kernels for the instruction set inductor compiles for,
and hands AOTInductor what it needs to call them: the row kernel
(row_kernel.cpp, fp32 products over a few rows) and the masked attention
(attention_kernel.cpp, a few query rows over a cell pool).

Two builds of the sources, each kept in kvexport's cache directory under a
key of the sources, the flags and the compiler:
- a static archive holding the kernels and their C shims, which AOTInductor
  links into each compiled method (`custom_op_libs`), so a package's library
  carries them and needs nothing of kvexport at run time;
- a shared library of the kernels alone, which the kernel probe
  (exporter/kernel_probe.py), bench/ and the tests call through ctypes.
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


@functools.cache
def shared_kernel() -> ctypes.CDLL:
    """The kernels alone: `kvexport_rows_linear(x, ldx, w, out, M, N, K)` and
    `kvexport_masked_attention(q, q_sh, q_st, k, k_sh, k_sc, v, v_sh, v_sc,
    mask, m_st, m_sc, out, H, Hkv, T, C, D, scale)`."""
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


def _build(kind: str) -> Path:
    """Builds once per source, flags and compiler; concurrent builds (compile
    workers) each write their own folder and the first rename wins."""
    from kvexport.contract.package import cache_dir

    if not supported():
        raise ExportError(f"the row kernel needs an x86 CPU with AVX2 or AVX-512; inductor compiles for {_isa() or 'no vector ISA'} here")
    probe = _commands(kind, Path("OUT"))
    compiler = probe[0][0]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), repr(probe), version]).encode()).hexdigest()[:16]
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
