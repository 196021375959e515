"""The AOTInductor backend: every method compiled ahead of time for the
export machine's device, with the weights left out of the compiled code
(the runtime binds the package's one copy to every method as user-managed
constants)."""

from __future__ import annotations

import platform

import torch
import torch.fx
from torch.fx.passes.operator_support import OperatorSupportBase

from kvexport.partitioners.base import Partitioner
from kvexport.passes.base import Pass
from kvexport.passes.check_step_width import CheckStepWidthPass
from kvexport.passes.remove_noops import RemoveNoOpsPass


class _EveryOp(OperatorSupportBase):
    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return node.op == "call_function"


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


class AotiPartitioner(Partitioner):
    backend_id = "aoti"

    def __init__(self, device: str = "cpu"):
        self.device = device

    def edge_transform_passes(self) -> list[Pass]:
        return [RemoveNoOpsPass()]

    def operator_support(self) -> OperatorSupportBase:
        return _EveryOp()

    def lowered_checks(self) -> list[Pass]:
        return [CheckStepWidthPass()]
