"""The AOTInductor backend: every method compiled ahead of time for the
export machine's device, the weights left out of the compiled code (the
runtime binds the package's one copy to every method).

Its room: the partitioner (partitioner.py), the compile step (compile.py),
the passes that run inside the compile (passes/: kvexport's kernels take
the products and attention over a few rows) and the kernels (kernels/)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvexport.contract.errors import ExportError, SpecError
from kvexport.partitioners.aoti.kernels.probe import MODES as KERNEL_MODES
from kvexport.partitioners.registry import Backend, BackendOptions, CompileContext, register_backend



@dataclass
class AotiOptions(BackendOptions):
    # static row counts whose fp32 products and attention run on kvexport's
    # kernels (kernels/probe.py decides them once per machine for auto)
    kernel_rows: tuple[int, ...] = ()
    # static row counts whose products by packed weights run on the packed kernel
    packed_rows: tuple[int, ...] = ()
    # static row counts whose attention runs on the masked attention kernel: every one unless --row-kernel off
    attention_rows: tuple[int, ...] = ()
    # bf16 products over every row count (prefill slices too) run on the row kernel: where torch's own bf16
    # GEMM is slow (kernels/build.py: fast_bf16_gemm)
    bf16_every_row_count: bool = False


def _check_spec(spec) -> None:
    if spec.row_kernel not in KERNEL_MODES:
        raise SpecError(f"--row-kernel must be one of {', '.join(KERNEL_MODES)}, got {spec.row_kernel!r}")
    if spec.packed_kernel not in ("on", "off"):
        raise SpecError(f"--packed-kernel must be on or off, got {spec.packed_kernel!r}")


def _configure(spec) -> AotiOptions:
    import torch

    from kvexport.partitioners.aoti.kernels.probe import kernel_rows, packed_rows

    if spec.device == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda needs a CUDA GPU, and torch sees none on this machine")
    # the probe weighs the kernel against the BLAS's fp32 products; bf16 ones take the kernel at every row
    # count (on the BLAS, SmolLM2 bf16 decoded 1.27 x slower at batch 1 and 3.0 x over 8 sessions: README)
    mode = "on" if spec.row_kernel == "auto" and spec.dtype == "bf16" else spec.row_kernel
    rows, packed = kernel_rows(spec.device, mode), packed_rows(spec.device, spec.packed_kernel)
    # the probe times products, not attention: the attention kernel takes every static row count
    attention = kernel_rows(spec.device, "off" if spec.row_kernel == "off" else "on")
    bf16_every = False
    if rows or packed or attention:
        from kvexport.partitioners.aoti.kernels.build import archive_dir, fast_bf16_gemm

        archive_dir()  # built (once per machine) before any work, so a missing compiler fails first
        bf16_every = spec.dtype == "bf16" and bool(rows) and not fast_bf16_gemm()
    return AotiOptions(spec.device, _compile_workers(spec), int8_products=bool(packed), kernel_rows=rows,
                       packed_rows=packed, attention_rows=attention, bf16_every_row_count=bf16_every)


def _compile_workers(spec) -> int:
    """One compile process per core, and no more than there are methods: the
    static forwards, forward_others and the two samplers."""
    return spec.compile_workers or min(os.cpu_count() or 1, len(spec.forward_sizes) + 3)


def _partitioners(options: AotiOptions) -> list:
    from kvexport.partitioners.aoti.partitioner import AotiPartitioner

    return [AotiPartitioner(options.device, kernel_rows=options.kernel_rows, packed_rows=options.packed_rows)]


def _manifest_entry(options: AotiOptions) -> dict:
    from kvexport.partitioners.aoti.partitioner import compile_target

    return {"target": compile_target(options.device) | {"fp32_kernel_rows": list(options.kernel_rows),
                                                        "packed_kernel_rows": list(options.packed_rows),
                                                        "attention_kernel_rows": list(options.attention_rows),
                                                        "bf16_kernel_every_row_count": options.bf16_every_row_count}}


def _compile(ctx: CompileContext) -> dict[str, str]:
    """Every method compiled by AOTInductor in worker processes."""
    from kvexport.contract.package import program_path
    from kvexport.partitioners.aoti.compile import CompileJob, compile_methods
    from kvexport.partitioners.aoti.kernels.build import archive_dir

    options: AotiOptions = ctx.options
    rows, packed, attention = options.kernel_rows, options.packed_rows, options.attention_rows
    archive = archive_dir() if rows or packed or attention else None
    if rows:
        ctx.progress(f"kvexport's kernel for float products over {','.join(map(str, rows))} rows: {archive}")
    if options.bf16_every_row_count:
        ctx.progress("kvexport's kernel for bf16 products over every row count (torch's bf16 GEMM is slow here)")
    if attention:
        ctx.progress(f"kvexport's kernel for attention over {attention[0]}..{attention[-1]} rows")
    if packed:
        ctx.progress(f"kvexport's kernel for products by packed weights over {packed[0]}..{packed[-1]} rows")
    jobs = [
        CompileJob(name, ctx.root / entry["program"], ctx.weights, ctx.bindings[name], ctx.aliases, entry["inputs"],
                   ctx.root / program_path(name, compiled=True), options.device, entry.get("state", []),
                   rows, archive, packed, attention_rows=attention, bf16_every_row_count=options.bf16_every_row_count)
        for name, entry in ctx.methods.items()
    ]
    compile_methods(jobs, options.compile_workers, ctx.progress)
    return {job.method: job.output.relative_to(ctx.root).as_posix() for job in jobs}


def _compile_passes(options: AotiOptions) -> list:
    from kvexport.partitioners.aoti.passes import compile_passes

    return compile_passes(options.kernel_rows, options.packed_rows, options.attention_rows, options.bf16_every_row_count)


register_backend(
    Backend("aoti", "every method compiled ahead of time with AOTInductor", _partitioners, _compile, _manifest_entry,
            devices=("cpu", "cuda"), configure=_configure, check_spec=_check_spec, compile_passes=_compile_passes,
            compile_workers=_compile_workers)
)
