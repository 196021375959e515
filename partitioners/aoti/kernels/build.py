"""Builds kvexport's kernels for the instruction set inductor compiles for,
and hands AOTInductor what it needs to call them. The kernels (their C
signatures are the table in signatures.py): rows_linear (rows_linear.cpp,
fp32 and bf16 products over a few rows), masked_attention
(masked_attention.cpp, a few query rows over a cell pool), packed_linear
(packed_linear.cpp, few rows by packed 4/8-bit weights) and int8_linear
(int8_linear.cpp, the same with int8 activations, integer dot products), all
written in vec.h's vocabulary.

Builds, each kept in kvexport's cache directory under a key of the sources,
the flags and the compiler:
- `objects`: the math compiled once (int8_linear.cpp twice, below), which
  the three builds below link;
- `archive`: a static library of the kernels and their C shims (shims.cpp),
  which AOTInductor links into each compiled method (`custom_op_libs`), so a
  package's library carries them and needs nothing of kvexport at run time;
- `shared`: the kernels alone, which `rows_linear` and `masked_attention`
  below call through ctypes (the kernel probe, bench/ and the tests);
- `shims`: kernels and shims as a shared library linked to torch, whose
  shims the tests call on tensor handles.
Each can be built for another instruction set than inductor's (`isa`), so
the tests check AVX2 code on an AVX-512 machine too.
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
from kvexport.partitioners.aoti.kernels.signatures import (
    INT8_LINEAR,
    KERNELS,
    MASKED_ATTENTION,
    PACKED_LINEAR,
    ROWS_LINEAR,
    ROWS_LINEAR_BF16,
    SHIMMED,
    header,
)

HERE = Path(__file__).parent
MATH = (HERE / "rows_linear.cpp", HERE / "masked_attention.cpp", HERE / "packed_linear.cpp", HERE / "int8_linear.cpp")
SHIMS = HERE / "shims.cpp"
FILES = (*MATH, SHIMS, HERE / "vec.h", HERE / "signatures.py")  # everything a build reads
LIBRARY = "kvexport_kernels"
ISAS = ("avx2", "avx512")
VNNI_FLAGS = {"avx2": "-mavxvnni", "avx512": "-mavx512vnni"}  # the VNNI of each build: AVX-VNNI, AVX512-VNNI
BF16_FLAGS = {"avx2": [], "avx512": ["-mavx512bf16"]}  # vdpbf16ps: AVX512-BF16 (an AVX2 build has no bf16 products)


def supported() -> bool:
    """The kernel is written for x86 with AVX2+FMA or AVX-512: is that what
    inductor compiles for here?"""
    return platform.machine() in ("x86_64", "AMD64") and _isa() in ISAS


def inductor_configs() -> dict:
    """The AOTInductor settings under which `kvexport::rows_linear` and
    `kvexport::masked_attention` compile to direct calls of the kernels
    linked into the method's library. The archive's folder must be on
    LIBRARY_PATH for the link (partitioners/aoti/compile.py)."""
    import torch

    # the passes' modules define the kvexport:: ops; all of them, whichever kernels this compile uses
    import kvexport.partitioners.aoti.passes.int8_linear  # noqa: F401
    import kvexport.partitioners.aoti.passes.masked_attention  # noqa: F401
    import kvexport.partitioners.aoti.passes.packed_linear  # noqa: F401
    import kvexport.partitioners.aoti.passes.rows_linear  # noqa: F401

    shims = {getattr(torch.ops.kvexport, kernel.name).default: [kernel.shim_declaration()] for kernel in SHIMMED}
    return {"aot_inductor.custom_ops_to_c_shims": shims, "aot_inductor.custom_op_libs": [LIBRARY]}


def archive_dir() -> Path:
    """The folder holding lib<LIBRARY>.a, built for inductor's instruction set."""
    return _build("archive")


def rows_linear(x, weight, out=None, isa: str | None = None, products: str = ""):
    """x [M, K] (unit stride along K) @ weight [N, K] (contiguous).T, both
    fp32 or both bf16, on the rows_linear kernel (built for `isa`, inductor's
    by default), into fp32 out [M, N] (contiguous) when given. products, for
    bf16: "" as compiled code runs it (vdpbf16ps from 3 rows where the CPU
    has it), "shift" or "dot" (see has_bf16_dot) for that build alone."""
    import torch

    (m, k), n = x.shape, weight.shape[0]
    out = x.new_empty(m, n, dtype=torch.float32) if out is None else out
    if not (x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16) and out.dtype == torch.float32
            and weight.shape[1] == k and x.stride(1) == 1 and weight.is_contiguous() and out.is_contiguous()
            and tuple(out.shape) == (m, n)):
        raise ValueError("rows_linear takes x [M, K] with unit stride along K and a contiguous weight [N, K], both "
                         "fp32 or both bf16, and fp32 out [M, N]")
    if products not in ("", "shift", "dot") or (products and x.dtype == torch.float32):
        raise ValueError(f"rows_linear's bf16 products are shift or dot, not {products!r}")
    kernel = ROWS_LINEAR.name if x.dtype == torch.float32 else "_".join(filter(None, (ROWS_LINEAR_BF16.name, products)))
    shared_kernel(isa)[kernel](x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), m, n, k)
    return out


def has_bf16_dot(isa: str | None = None) -> bool:
    """Whether this CPU has AVX512-BF16 and rows_linear's build for `isa`
    can call it (AVX-512 builds only)."""
    return (isa or _isa()) == "avx512" and _cpu_has("avx512_bf16")


def masked_attention(query, key, value, mask, scale: float, out=None, isa: str | None = None):
    """sdpa(query [1, H, T, D], key and value [1, Hkv, C, D], bool mask [T, C],
    GQA) on the masked_attention kernel (built for `isa`), into out
    [1, H, T, D] (contiguous) when given; unit strides along D."""
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
    shared_kernel(isa)[MASKED_ATTENTION.name](
        query.data_ptr(), query.stride(1), query.stride(2), key.data_ptr(), key.stride(1), key.stride(2),
        value.data_ptr(), value.stride(1), value.stride(2), mask.data_ptr(), mask.stride(0), mask.stride(1),
        out.data_ptr(), heads, kv_heads, rows, cells, dim, scale)
    return out


def packed_linear(x, words, scale, offset, bits: int, rows: int, out=None, isa: str | None = None):
    """x [M, K] (unit stride along K) times the packed weight (words int32
    [R, K] of 32 / bits lanes, scale and offset fp32 [lanes * R, groups],
    passes/packed_weights.py) transposed, its first `rows` rows, on the
    packed_linear kernel (built for `isa`), into out [M, rows] when given."""
    import torch

    (m, k), (r, width) = x.shape, words.shape
    lanes = 32 // bits if bits in (4, 8) else 0
    groups = scale.shape[1] if scale.dim() == 2 else 0
    out = x.new_empty(m, rows) if out is None else out
    if not (lanes and x.dtype == scale.dtype == offset.dtype == out.dtype == torch.float32 and words.dtype == torch.int32
            and width == k and x.stride(1) == 1 and words.is_contiguous() and scale.is_contiguous()
            and offset.is_contiguous() and tuple(scale.shape) == tuple(offset.shape) == (lanes * r, groups)
            and groups and k % (8 * groups) == 0 and 0 < rows <= lanes * r
            and out.is_contiguous() and tuple(out.shape) == (m, rows)):
        raise ValueError("packed_linear takes fp32 x [M, K] with unit stride along K, contiguous int32 words [R, K] "
                         "of 4 or 8 bits, fp32 scale and offset [lanes * R, groups] with K a multiple of 8 * groups, "
                         "1 <= rows <= lanes * R and out [M, rows]")
    shared_kernel(isa)[PACKED_LINEAR.name](x.data_ptr(), x.stride(0), words.data_ptr(), scale.data_ptr(),
                                            offset.data_ptr(), out.data_ptr(), m, rows, k, r, groups, bits)
    return out


def fast_bf16_gemm(isa: str | None = None) -> bool:
    """Whether torch multiplies bf16 matrices fast in code for `isa`
    (inductor's by default): torch calls oneDNN's bf16 GEMM only on CPUs with
    AVX-512, and an AVX2 CPU gets ATen's generic one, 34 GFLOPS over a
    512-row prefill's products where the row kernel ran 131 (Intel Xeon, AVX2
    code, bench/bf16_products.py)."""
    return (isa or _isa()) == "avx512"


def has_vnni(isa: str | None = None) -> bool:
    """Whether this CPU has the VNNI that int8_linear's build for `isa`
    uses (AVX-VNNI for AVX2, AVX512-VNNI for AVX-512)."""
    return _cpu_has({"avx2": "avx_vnni", "avx512": "avx512_vnni"}[isa or _isa()])


def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (False where it cannot be read)."""
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


# The code widths whose int8 products over a row count known only at run
# time (prefill slices) take the int8 kernel: 4-bit and 8-bit codes, with
# VNNI or without it. Without VNNI, 8-bit codes once went to the stored
# form (the weight dequantized to fp32 each call, then the BLAS): maddubs
# takes them through the sign trick, then measured as dear as fp32 FMAs.
# After the kernel's later changes, 8w packages of AVX2 code on a Zen 4 took
# their 512-token prompts 1.3-1.6 x (SmolLM2) and 1.6 x (the 1B shape) as
# fast through the kernel (`python bench/prefill.py`, alternated; README,
# "8-bit prompts without VNNI").
DYNAMIC_INT8_BITS = (4, 8)


def int8_linear(x, data, scale, offset, bits: int, qact: int = 1, out=None, isa: str | None = None, products: str = ""):
    """x [M, K] (unit stride along K), its rows rounded per block of 32 as
    contract/schemes.py's QACT[qact] says (1: int8_rows; 2: int8x2_rows,
    that plus its rounding error rounded alike; 3: int16_rows; 4:
    int8_peak_rows, a second term on each row's peak blocks), times the
    weight of codes in the blocks format (data uint8 [N / 8, K * bits], scale
    and offset [N / 8, groups * 8], both fp32 or both fp16;
    passes/packed_weights.py) transposed, on the int8_linear kernel
    (built for `isa`), into out [M, N] when given. products: "" as compiled
    code runs it (VNNI where the CPU has it), "maddubs" or "vnni" (see
    has_vnni) for that build alone."""
    import torch

    (m, k), panels = x.shape, data.shape[0]
    n, groups = panels * 8, (scale.shape[1] // 8 if scale.dim() == 2 else 0)
    out = x.new_empty(m, n) if out is None else out
    if not (bits in (4, 8) and qact in (1, 2, 3, 4) and x.dtype == out.dtype == torch.float32
            and scale.dtype == offset.dtype and scale.dtype in (torch.float32, torch.float16) and data.dtype == torch.uint8
            and data.dim() == 2 and data.shape[1] == k * bits and x.stride(1) == 1
            and data.is_contiguous() and scale.is_contiguous() and offset.is_contiguous()
            and tuple(scale.shape) == tuple(offset.shape) == (panels, groups * 8) and groups and k % (32 * groups) == 0
            and out.is_contiguous() and tuple(out.shape) == (m, n)):
        raise ValueError("int8_linear takes fp32 x [M, K] with unit stride along K, contiguous uint8 data "
                         "[N / 8, K * bits] of 4 or 8 bits, scale and offset [N / 8, groups * 8] both fp32 or both "
                         "fp16 with K a multiple of 32 * groups, out [M, N], and qact 1, 2, 3 or 4")
    if products not in ("", "maddubs", "vnni"):
        raise ValueError(f"int8_linear's products are maddubs or vnni, not {products!r}")
    kernel = f"{INT8_LINEAR.name}_{products}" if products else INT8_LINEAR.name
    shared_kernel(isa)[kernel](x.data_ptr(), x.stride(0), data.data_ptr(), scale.data_ptr(), offset.data_ptr(),
                               out.data_ptr(), m, n, k, groups, bits, scale.element_size() * 8, qact)
    return out


def shared_kernel(isa: str | None = None) -> dict:
    """Kernel name -> its math through ctypes, built for `isa` (inductor's
    by default). Call them through `rows_linear` and `masked_attention`,
    which check the operands."""
    return _load_math(isa)


def shims_library(isa: str | None = None) -> Path:
    """The kernels and their shims as a shared library linked to torch."""
    return _build("shims", isa) / f"lib{LIBRARY}_shims.so"


class Shims:
    """The shims of one build (shims_library, or another build's `library`),
    called on tensors as a compiled method's generated code calls them: for
    tests and benches."""

    def __init__(self, isa: str | None = None, library: Path | None = None):
        self.library = ctypes.CDLL(str(library or shims_library(isa)))
        api = ctypes.pythonapi
        api.PyCapsule_GetPointer.restype, api.PyCapsule_GetPointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        api.PyCapsule_New.restype, api.PyCapsule_New.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self.api = api

    def call(self, name: str, *operands):
        """The shim's result tensor; raises ValueError when the shim refuses."""
        import torch

        kernel = next(k for k in KERNELS if k.name == name)
        function = getattr(self.library, kernel.shim_symbol)
        function.restype = ctypes.c_int32
        scalars = {"double": ctypes.c_double, "int64_t": ctypes.c_int64}
        function.argtypes = [scalars.get(p.split()[0], ctypes.c_void_p) for p in kernel.shim]
        function.argtypes += [ctypes.POINTER(ctypes.c_void_p)]
        handles = [self._handle(o) if isinstance(o, torch.Tensor) else o for o in operands]
        result = ctypes.c_void_p()
        try:
            if function(*handles, ctypes.byref(result)):
                raise ValueError(f"{name}'s shim refused its operands")
        finally:
            delete = self.library.aoti_torch_delete_tensor_object
            delete.argtypes = [ctypes.c_void_p]
            for operand, handle in zip(operands, handles):
                if isinstance(operand, torch.Tensor):
                    delete(handle)
        return torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(self.api.PyCapsule_New(result.value, None, None))

    ROUTES = ("kernel", "mask", "slices")

    def attention_route(self, mask, fp32: bool = True) -> tuple[str, int]:
        """The way masked_attention's shim takes a bool mask [T, C] (the
        kernel, sdpa through the mask, or sdpa over each causal slice's
        cells) and how many slices it found."""
        function = self.library.kvexport_masked_attention_route
        function.restype = ctypes.c_int32
        function.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)]
        slices = ctypes.c_int64()
        way = function(mask.data_ptr(), mask.stride(0), mask.stride(1), mask.shape[0], mask.shape[1], int(fp32),
                       ctypes.byref(slices))
        return self.ROUTES[way], slices.value

    def _handle(self, tensor) -> int:
        import torch

        return self.api.PyCapsule_GetPointer(torch._C._aoti.unsafe_alloc_void_ptr_from_tensor(tensor), None)


@functools.cache
def _load_math(isa: str | None) -> dict:
    library = ctypes.CDLL(str(_build("shared", isa) / f"lib{LIBRARY}.so"))
    functions = {}
    for kernel in KERNELS:
        function = getattr(library, kernel.symbol)
        function.argtypes, function.restype = kernel.argtypes(), None
        functions[kernel.name] = function
    return functions


def _isa() -> str:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa()).split()[0] if pick_vec_isa() else ""


def _arch_flags(isa: str | None) -> list[str]:
    """Inductor's own -m flags for its instruction set (None), else those of
    the plain AVX2 or AVX-512 build."""
    from torch._inductor import cpu_vec_isa

    if isa is None:
        return cpu_vec_isa.pick_vec_isa().build_arch_flags().split()
    builds = {"avx2": cpu_vec_isa.VecAVX2, "avx512": cpu_vec_isa.VecAVX512}
    if isa not in builds:
        raise ExportError(f"kvexport's kernels have no build for instruction set {isa!r} (known: {', '.join(builds)})")
    return builds[isa]().build_arch_flags().split()


def _units(isa: str | None) -> list[tuple[Path, list[str], str]]:
    """Each compile of the math: (source, its own flags, object name).
    int8_linear.cpp compiles twice, the second time with VNNI's integer dot
    products (vpdpbusd), and rows_linear.cpp twice, the second time with
    AVX512-BF16's vdpbf16ps (AVX-512 builds): each first build's entry calls
    the second where the CPU has its instructions, so a package built here
    runs on a CPU without them too."""
    vnni, bf16 = VNNI_FLAGS[isa or _isa()], BF16_FLAGS[isa or _isa()]
    return [*((source, [], source.stem) for source in MATH), (HERE / "int8_linear.cpp", ["-DKV_VNNI", vnni], "int8_linear_vnni"),
            (HERE / "rows_linear.cpp", ["-DKV_BF16", *bf16], "rows_linear_bf16_dot")]


def _commands(kind: str, isa: str | None, out: Path, objects: Path | None) -> list[list[str]]:
    """The compiler runs that build `kind`; out holds kernels.h and the
    result. The math compiles once per instruction set (`objects`); the
    archive, the shared library and the shims library link those objects."""
    import torch.utils.cpp_extension
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()
    # F16C (fp16 scales, vec.h's load_half): every AVX2 CPU has it, but inductor's AVX-512 flags leave it out
    flags = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", *_arch_flags(isa), "-mf16c", f"-I{out}"]
    units = _units(isa)
    if kind == "objects":
        return [[compiler, *flags, *extra, "-c", str(source), "-o", str(out / f"{name}.o")] for source, extra, name in units]
    math = [str(objects / f"{name}.o") for _, _, name in units]
    if kind == "shared":
        return [[compiler, *flags, "-shared", *math, "-o", str(out / f"lib{LIBRARY}.so")]]
    # the shims, against torch's headers
    shim_flags = ["-DKVEXPORT_AOTI_SHIM", *(f"-I{path}" for path in torch.utils.cpp_extension.include_paths())]
    shims = [compiler, *flags, *shim_flags, "-c", str(SHIMS), "-o", str(out / f"{SHIMS.stem}.o")]
    if kind == "archive":
        return [shims, ["ar", "rcs", str(out / f"lib{LIBRARY}.a"), *math, str(out / f"{SHIMS.stem}.o")]]
    libraries = torch.utils.cpp_extension.library_paths()
    return [shims, [compiler, *flags, "-shared", *math, str(out / f"{SHIMS.stem}.o"), *(f"-L{p}" for p in libraries),
                    *(f"-Wl,-rpath,{p}" for p in libraries), "-ltorch", "-ltorch_cpu", "-lc10",
                    "-o", str(out / f"lib{LIBRARY}_shims.so")]]


@functools.cache
def compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def _build(kind: str, isa: str | None = None) -> Path:
    """Builds once per source, flags and compiler; concurrent builds (compile
    workers) each write their own folder and the first rename wins."""
    from kvexport.contract.package import cache_dir

    if not supported():
        raise ExportError(f"kvexport's kernels need an x86 CPU with AVX2 or AVX-512; inductor compiles for "
                          f"{_isa() or 'no vector ISA'} here")
    objects = _build("objects", isa) if kind != "objects" else None
    probe = _commands(kind, isa, Path("OUT"), objects)
    key = hashlib.sha256("\0".join([*(f.read_text() for f in FILES), repr(probe), compiler_version(probe[0][0])]).encode())
    root = cache_dir() / "kernels"
    final = root / f"{kind}-{isa or _isa()}-{key.hexdigest()[:16]}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
    try:
        (work / "kernels.h").write_text(header())
        for command in _commands(kind, isa, work, objects):
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
