"""A Partitioner belongs to one backend. It contributes the passes its
backend needs (run after the caller's), tags the nodes its backend takes
(tagging never changes the graph: the pipeline checks), lowers the tagged
program, declares the step width its lowering produces, and contributes the
checks that run on the lowered program."""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from kvexport.passes.base import Pass

TAG = "kvexport_backend"


class Partitioner:
    backend_id = "base"

    def edge_transform_passes(self) -> list[Pass]:
        return []

    def operator_support(self) -> OperatorSupportBase:
        raise NotImplementedError

    def partition(self, graph_module: torch.fx.GraphModule) -> int:
        """Tags the nodes this backend takes with `<backend>_<partition>`
        (torch.fx's capability-based partitioning); returns how many
        partitions it found. Does not change the graph."""
        proposer = CapabilityBasedPartitioner(
            graph_module, self.operator_support(), allows_single_node_partition=True
        )
        partitions = proposer.propose_partitions()
        for i, partition in enumerate(partitions):
            for node in partition.nodes:
                node.meta[TAG] = f"{self.backend_id}_{i}"
        return len(partitions)

    def lower(self, program: torch.export.ExportedProgram, method: str) -> torch.export.ExportedProgram:
        """Turns the tagged nodes into what this backend runs."""
        return program

    def step_width(self, public: str) -> str:
        """The step-width declaration for the lowered program, given the one
        for the contract's public input order."""
        return public

    def lowered_checks(self) -> list[Pass]:
        return []
