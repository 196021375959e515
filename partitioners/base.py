"""A Partitioner belongs to one backend: it contributes the passes its
backend needs (run after the caller's), and tags the nodes its backend takes.
Tagging never changes the graph."""

from __future__ import annotations

import torch.fx

from kvexport.passes.base import Pass

TAG = "kvexport_backend"


class Partitioner:
    backend_id = "base"

    def edge_transform_passes(self) -> list[Pass]:
        return []

    def partition(self, graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
        raise NotImplementedError
