"""The portable backend: programs run by PyTorch's own kernels. It takes
every compute node."""

from __future__ import annotations

import torch.fx

from kvexport.partitioners.base import TAG, Partitioner
from kvexport.passes.base import Pass
from kvexport.passes.remove_noops import RemoveNoOpsPass


class PortablePartitioner(Partitioner):
    backend_id = "portable"

    def edge_transform_passes(self) -> list[Pass]:
        return [RemoveNoOpsPass()]

    def partition(self, graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for node in graph_module.graph.nodes:
            if node.op == "call_function":
                node.meta[TAG] = self.backend_id
        return graph_module
