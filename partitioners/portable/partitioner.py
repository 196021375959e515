"""The portable backend: programs run by PyTorch's own kernels, so it takes
every compute node and its lowering keeps the program as it is."""

from __future__ import annotations

import torch.fx
from torch.fx.passes.operator_support import OperatorSupportBase

from kvexport.partitioners.base import TAG, Partitioner
from kvexport.passes.base import Pass
from kvexport.passes.check_step_width import CheckStepWidthPass
from kvexport.passes.decompose_custom_ops import DecomposeCustomOpsPass
from kvexport.passes.remove_noops import RemoveNoOpsPass
from kvexport.passes.weight_stationary_linear import WeightStationaryLinearPass


class _EveryOp(OperatorSupportBase):
    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return node.op == "call_function"


class PortablePartitioner(Partitioner):
    backend_id = "portable"
    device = "cpu"

    def edge_transform_passes(self) -> list[Pass]:
        return [
            *self.packed_kernel_passes(), DecomposeCustomOpsPass(), RemoveNoOpsPass(),
            *self.kernel_choice_passes(),
        ]

    def packed_kernel_passes(self) -> list[Pass]:
        """The passes that pick how products over packed weights run, while
        they are still one operator each (passes/packed_weights.py)."""
        return []

    def kernel_choice_passes(self) -> list[Pass]:
        """The passes that pick how products run on this backend's device."""
        return [WeightStationaryLinearPass()] if self.device == "cpu" else []

    def operator_support(self) -> OperatorSupportBase:
        return _EveryOp()

    def partition(self, graph_module: torch.fx.GraphModule) -> int:
        """Every compute node in one partition. torch.fx's proposer would find
        the same, but keeps a set of ancestors per node: quadratic memory, 16
        GB for a 30-layer graph with fused products."""
        nodes = [n for n in graph_module.graph.nodes if n.op == "call_function"]
        for node in nodes:
            node.meta[TAG] = f"{self.backend_id}_0"
        return 1 if nodes else 0

    def lowered_checks(self) -> list[Pass]:
        return [CheckStepWidthPass()]
