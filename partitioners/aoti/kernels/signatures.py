"""Each kernel's C signatures, declared once. The build writes them into
kernels.h, which the math and the shims include, so the compiler holds both
to this table; AOTInductor's shim map and the ctypes entry points read the
same rows.

A kernel `NAME` is three things: the custom op `kvexport::NAME` that the
backend's compile-time passes emit (passes/), the math `kvexport_NAME` on
raw pointers (NAME.cpp), and the AOTInductor C shim
`aoti_torch_cpu_NAME` on tensor handles (shims.cpp), which checks the
operands, says why it refuses any, and calls the math.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    name: str
    math: tuple[str, ...]  # the math's C parameters, "type name"
    shim: tuple[str, ...] | None  # the shim's parameters before its result handle; None: called by another's shim

    @property
    def symbol(self) -> str:
        return f"kvexport_{self.name}"

    @property
    def shim_symbol(self) -> str:
        return f"aoti_torch_cpu_{self.name}"

    def math_declaration(self) -> str:
        return f"void {self.symbol}({', '.join(self.math)})"

    def shim_declaration(self) -> str:
        return f"AOTITorchError {self.shim_symbol}({', '.join((*self.shim, 'AtenTensorHandle* ret0'))})"

    def argtypes(self) -> list:
        """ctypes types of the math's parameters."""
        return [_CTYPES[parameter.rsplit(" ", 1)[0]] for parameter in self.math]


_CTYPES = {"const float*": ctypes.c_void_p, "float*": ctypes.c_void_p, "const bool*": ctypes.c_void_p,
           "const int32_t*": ctypes.c_void_p, "const uint16_t*": ctypes.c_void_p, "const uint8_t*": ctypes.c_void_p,
           "const void*": ctypes.c_void_p, "int64_t": ctypes.c_int64, "float": ctypes.c_float}

ROWS_LINEAR = Kernel(
    "rows_linear",
    # x [M, K] (row stride ldx) @ w [N, K].T -> out [M, N], all fp32, w and out contiguous
    math=("const float* x", "int64_t ldx", "const float* w", "float* out", "int64_t M", "int64_t N", "int64_t K"),
    shim=("AtenTensorHandle x", "AtenTensorHandle weight"),
)
ROWS_LINEAR_BF16 = Kernel(
    "rows_linear_bf16",
    # rows_linear with x and w in bf16 (raw 16-bit values), out fp32; rows_linear's shim calls it for bf16 operands
    math=("const uint16_t* x", "int64_t ldx", "const uint16_t* w", "float* out", "int64_t M", "int64_t N", "int64_t K"),
    shim=None,
)
# rows_linear_bf16's two builds (kernels/build.py): its entry calls the vdpbf16ps one where the CPU has AVX512-BF16
ROWS_LINEAR_BF16_SHIFT = Kernel("rows_linear_bf16_shift", math=ROWS_LINEAR_BF16.math, shim=None)
ROWS_LINEAR_BF16_DOT = Kernel("rows_linear_bf16_dot", math=ROWS_LINEAR_BF16.math, shim=None)
MASKED_ATTENTION = Kernel(
    "masked_attention",
    # q [H, T, D], k and v [Hkv, C, D] (head and row strides given, unit along D),
    # mask [T, C] (strides given) -> out [H, T, D] contiguous
    math=("const float* q", "int64_t q_sh", "int64_t q_st", "const float* k", "int64_t k_sh", "int64_t k_sc",
          "const float* v", "int64_t v_sh", "int64_t v_sc", "const bool* mask", "int64_t m_st", "int64_t m_sc",
          "float* out", "int64_t H", "int64_t Hkv", "int64_t T", "int64_t C", "int64_t D", "float scale"),
    shim=("AtenTensorHandle query", "AtenTensorHandle key", "AtenTensorHandle value", "AtenTensorHandle mask",
          "double scale"),
)
MASKED_ATTENTION_BF16 = Kernel(
    "masked_attention_bf16",
    # masked_attention over bf16 key and value pools (raw 16-bit values), q and out fp32; its shim calls it for bf16
    math=tuple(p.replace("const float* k", "const uint16_t* k").replace("const float* v", "const uint16_t* v")
               for p in MASKED_ATTENTION.math),
    shim=None,
)
PACKED_LINEAR = Kernel(
    "packed_linear",
    # x [M, K] (row stride ldx) @ the packed weight [N, K].T -> out [M, N]: words int32 [R, K] of
    # 32 / bits lanes (passes/packed_weights.py), scale and offset fp32 [lanes * R, groups]; all contiguous
    math=("const float* x", "int64_t ldx", "const int32_t* words", "const float* scale", "const float* offset",
          "float* out", "int64_t M", "int64_t N", "int64_t K", "int64_t R", "int64_t groups", "int64_t bits"),
    shim=("AtenTensorHandle x", "AtenTensorHandle words", "AtenTensorHandle scale", "AtenTensorHandle offset",
          "int64_t bits", "int64_t rows"),
)
INT8_LINEAR = Kernel(
    "int8_linear",
    # x [M, K] (row stride ldx), its rows rounded per block of 32 as contract/schemes.py's QACT[qact]
    # says (1 int8, 2 int8x2, 3 int16, 4 int8-peak), @ the weight of codes in blocks [N, K].T -> out
    # [M, N]: data uint8 [N / 8, K * bits] (passes/packed_weights.py), scale and offset
    # [N / 8, groups * 8], fp32 (scale_bits 32) or fp16 (16); all contiguous
    math=("const float* x", "int64_t ldx", "const uint8_t* data", "const void* scale", "const void* offset",
          "float* out", "int64_t M", "int64_t N", "int64_t K", "int64_t groups", "int64_t bits", "int64_t scale_bits",
          "int64_t qact"),
    shim=("AtenTensorHandle x", "AtenTensorHandle data", "AtenTensorHandle scale", "AtenTensorHandle offset",
          "int64_t bits", "int64_t qact"),
)
# int8_linear's two builds (kernels/build.py): its entry calls the VNNI one where the CPU has VNNI
INT8_LINEAR_MADDUBS = Kernel("int8_linear_maddubs", math=INT8_LINEAR.math, shim=None)
INT8_LINEAR_VNNI = Kernel("int8_linear_vnni", math=INT8_LINEAR.math, shim=None)
KERNELS = (ROWS_LINEAR, ROWS_LINEAR_BF16, ROWS_LINEAR_BF16_SHIFT, ROWS_LINEAR_BF16_DOT, MASKED_ATTENTION,
           MASKED_ATTENTION_BF16, PACKED_LINEAR, INT8_LINEAR, INT8_LINEAR_MADDUBS, INT8_LINEAR_VNNI)
SHIMMED = tuple(kernel for kernel in KERNELS if kernel.shim is not None)  # the custom ops compiled code calls


def header() -> str:
    """kernels.h: every kernel's math and shim declarations."""
    math = "\n".join(f"{kernel.math_declaration()};" for kernel in KERNELS)
    shims = "\n".join(f"{kernel.shim_declaration()};" for kernel in SHIMMED)
    return (
        "// Written by kernels/signatures.py at build time: edit the table there.\n"
        "#pragma once\n\n#include <cstdint>\n\n"
        f'extern "C" {{\n{math}\n}}\n\n'
        "#ifdef KVEXPORT_AOTI_SHIM\n#include <torch/csrc/inductor/aoti_torch/c/shim.h>\n\n"
        f'extern "C" {{\n{shims}\n}}\n#endif\n'
    )
