"""The AOTInductor backend: every method compiled ahead of time for the
export machine's device, with the weights left out of the compiled code
(the runtime binds the package's one copy to every method as user-managed
constants)."""

from __future__ import annotations

import platform

import torch

from kvexport.partitioners.portable.partitioner import PortablePartitioner
from kvexport.passes.base import Pass
from kvexport.passes.packed_weights import FusedPackedLinearPass
from kvexport.passes.quantized_weights import FusedDequantizeMatmulPass
from kvexport.passes.weight_stationary_linear import WeightStationaryLinearPass


def compile_target(device: str) -> dict:
    """What a compiled package needs of the machine that runs it."""
    target = {
        "device": device,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "system": platform.system(),
    }
    if device == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        target["cpu_isa"] = str(pick_vec_isa())
    else:
        target["cuda_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return target


class AotiPartitioner(PortablePartitioner):
    """Takes every op, with the portable backend's passes and checks; the
    compiling happens when the package is written, once constant names are
    final (partitioners/aoti/compile.py)."""

    backend_id = "aoti"

    def __init__(self, device: str = "cpu", kernel_rows: tuple[int, ...] = ()):
        self.device = device
        # fp32 products over these static row counts stay linears here: the
        # compile gives them to the row kernel (passes/rows_linear.py)
        self.kernel_rows = tuple(kernel_rows)

    def packed_kernel_passes(self) -> list[Pass]:
        return [FusedPackedLinearPass()] if self.device == "cpu" else []

    def kernel_choice_passes(self) -> list[Pass]:
        if self.device != "cpu":
            return super().kernel_choice_passes()
        return [FusedDequantizeMatmulPass(), WeightStationaryLinearPass(skip_rows=self.kernel_rows)]
