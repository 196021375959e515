"""The AOTInductor backend: every method compiled ahead of time for the
export machine's device, with the weights left out of the compiled code
(the runtime binds the package's one copy to every method as user-managed
constants)."""

from __future__ import annotations

import platform

import torch
import torch.fx

from kvexport.partitioners.portable.partitioner import PortablePartitioner
from kvexport.passes.base import Pass, arguments, static_rows
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

    def __init__(self, device: str = "cpu", kernel_rows: tuple[int, ...] = (), packed_rows: tuple[int, ...] = ()):
        self.device = device
        # fp32 products over these static row counts stay linears here: the
        # compile gives them to the row kernel (passes/rows_linear.py)
        self.kernel_rows = tuple(kernel_rows)
        # products by packed weights over these stay a dequantization and a
        # linear: the compile gives them to the packed kernel (passes/packed_linear.py)
        self.packed_rows = tuple(packed_rows)

    def packed_kernel_passes(self) -> list[Pass]:
        return [FusedPackedLinearPass(skip_rows=self.packed_rows)] if self.device == "cpu" else []

    def kernel_choice_passes(self) -> list[Pass]:
        if self.device != "cpu":
            return super().kernel_choice_passes()
        return [_LeaveInt8Products(self.packed_rows), _LeavePackedProducts(self.packed_rows, skip_rows=self.kernel_rows)]


def _for_packed_kernels(node: torch.fx.Node, rows: frozenset[int]) -> bool:
    """A linear over the packed kernels' row counts by a packed weight, or
    with int8 activations: the compile must find it as a linear to give it
    to a kernel (passes/packed_linear.py, passes/int8_linear.py)."""
    from kvexport.partitioners.aoti.passes.int8_linear import int8_product
    from kvexport.partitioners.aoti.passes.packed_linear import packed_weight

    return (node.target is torch.ops.aten.linear.default and static_rows(node.args[0]) in rows
            and (packed_weight(arguments(node)["weight"]) is not None or int8_product(node) is not None))


class _LeavePackedProducts(WeightStationaryLinearPass):
    """The weight-stationary layout for fp32 linears, except the products
    the packed kernels take."""

    def __init__(self, packed_rows: tuple[int, ...], skip_rows: tuple[int, ...]):
        super().__init__(skip_rows=skip_rows)
        self.packed_rows = frozenset(packed_rows)

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [n for n in super().candidates(graph_module) if not _for_packed_kernels(n, self.packed_rows)]


class _LeaveInt8Products(FusedDequantizeMatmulPass):
    """Dequantized products fused with their few rows, except the products
    the packed kernels take (the int8 ones: this pass would fuse their
    blocks' dequantization)."""

    def __init__(self, packed_rows: tuple[int, ...]):
        super().__init__()
        self.packed_rows = frozenset(packed_rows)

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [n for n in super().candidates(graph_module) if not _for_packed_kernels(n, self.packed_rows)]
