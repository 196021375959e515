"""Builds kvexport's row kernel (row_kernel.cpp) for the instruction set
inductor compiles for, and hands AOTInductor what it needs to call it.

Two builds of the one source, each kept in kvexport's cache directory under
a key of the source, the flags and the compiler:
- a static archive holding the kernel and its C shim, which AOTInductor links
  into each compiled method (`custom_op_libs`), so a package's library
  carries the kernel and needs nothing of kvexport at run time;
- a shared library of the kernel alone, which the kernel probe
  (exporter/kernel_probe.py) times against the BLAS through ctypes.
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

SOURCE = Path(__file__).with_name("row_kernel.cpp")
LIBRARY = "kvexport_rows"
SHIM = "AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* ret0)"
ISAS = ("avx2", "avx512")


def supported() -> bool:
    """The kernel is written for x86 with AVX2+FMA or AVX-512: is that what
    inductor compiles for here?"""
    return platform.machine() in ("x86_64", "AMD64") and _isa() in ISAS


def inductor_configs() -> dict:
    """The AOTInductor settings under which `kvexport::rows_linear` compiles
    to a direct call of the kernel linked into the method's library. The
    archive's folder must be on LIBRARY_PATH for the link (`library_path`)."""
    from kvexport.passes.row_kernel_linear import ROWS_LINEAR

    return {"aot_inductor.custom_ops_to_c_shims": {ROWS_LINEAR: [SHIM]}, "aot_inductor.custom_op_libs": [LIBRARY]}


def archive_dir() -> Path:
    """The folder holding lib<LIBRARY>.a, built for inductor's instruction set."""
    return _build("archive")


@functools.cache
def shared_kernel() -> ctypes.CDLL:
    """The kernel alone, loaded for timing: `kvexport_rows_linear(x, ldx, w,
    out, M, N, K)`."""
    library = ctypes.CDLL(str(_build("shared") / f"lib{LIBRARY}.so"))
    library.kvexport_rows_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    library.kvexport_rows_linear.restype = None
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
        return [[compiler, *flags, "-shared", str(SOURCE), "-o", str(out / f"lib{LIBRARY}.so")]]
    includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
    obj = out / "row_kernel.o"
    return [[compiler, *flags, "-DKVEXPORT_AOTI_SHIM", *includes, "-c", str(SOURCE), "-o", str(obj)],
            ["ar", "rcs", str(out / f"lib{LIBRARY}.a"), str(obj)]]


def _build(kind: str) -> Path:
    """Builds once per source, flags and compiler; concurrent builds (compile
    workers) each write their own folder and the first rename wins."""
    from kvexport.contract.package import cache_dir

    if not supported():
        raise ExportError(f"the row kernel needs an x86 CPU with AVX2 or AVX-512; inductor compiles for {_isa() or 'no vector ISA'} here")
    probe = _commands(kind, Path("OUT"))
    compiler = probe[0][0]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), repr(probe), version]).encode()).hexdigest()[:16]
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
                raise ExportError(f"building the row kernel failed ({' '.join(command[:2])} ...):\n{done.stderr[-2000:]}"
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
