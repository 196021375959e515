"""RemoveNoOpsPass: drops nodes that do nothing at run time but cost a
dispatch each in an interpreted program: tensor-metadata assertions left by
tracing, and dtype conversions to the dtype a tensor already has. (About a
quarter of a Llama decode graph's nodes.)"""

from __future__ import annotations

import torch
import torch.fx

from kvexport.passes.base import Pass

_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
_TO_DTYPE = torch.ops.aten.to.dtype


def _is_noop_to(node: torch.fx.Node) -> bool:
    if node.target is not _TO_DTYPE or not isinstance(node.args[0], torch.fx.Node):
        return False
    if any(user.op == "output" for user in node.users):
        return False  # the program's signature names its outputs' nodes
    source = node.args[0].meta.get("val")
    dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    copy = node.args[3] if len(node.args) > 3 else node.kwargs.get("copy", False)
    return isinstance(source, torch.Tensor) and source.dtype == dtype and not copy


class RemoveNoOpsPass(Pass):
    name = "remove_noops"

    def call(self, graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
        modified = False
        for node in list(graph_module.graph.nodes):
            if node.target is _ASSERT_METADATA and not node.users:
                graph_module.graph.erase_node(node)
                modified = True
            elif _is_noop_to(node):
                node.replace_all_uses_with(node.args[0])
                graph_module.graph.erase_node(node)
                modified = True
        return graph_module, modified

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        left = [n.name for n in graph_module.graph.nodes if n.target is _ASSERT_METADATA or _is_noop_to(n)]
        if left:
            raise AssertionError(f"no-ops left: {left[:5]}")
