"""CheckStepWidthPass: checks a forward method's step-width declaration
against its lowered program (docs/contracts/offgraph_kv-v1.md). Every backend whose
runtime reads the step width contributes it. The pipeline puts the
declaration and the program's user-input names in the graph module's meta."""

from __future__ import annotations

import torch.fx

from kvexport.passes.base import Pass
from kvexport.contract.step_width import check_step_width, view_of_graph_module

STEP_WIDTH_META = "kvexport.step_width"
USER_INPUTS_META = "kvexport.user_inputs"


class CheckStepWidthPass(Pass):
    name = "check_step_width"

    def call(self, graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
        spec = graph_module.meta.get(STEP_WIDTH_META)
        if spec is not None:  # samplers declare none
            check_step_width(spec, view_of_graph_module(graph_module, graph_module.meta[USER_INPUTS_META]))
        return graph_module, False
