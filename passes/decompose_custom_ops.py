"""DecomposeCustomOpsPass: replaces calls to custom operators that have a
decomposition (torchao's quantize/dequantize/choose_qparams and our own
dequantize_packed, registered as CompositeImplicitAutograd) with the ATen operations they decompose into.

Export keeps such operators as single nodes; inlining them makes a package
need nothing but torch to run (the runtime never imports torchao), lets the
other passes see the arithmetic, and lets AOTInductor fuse it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from kvexport.passes.base import SOURCE_META, Pass

NAMESPACES = ("torchao", "kvexport")


def _is_custom(node: torch.fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace in NAMESPACES
    )


def _traced_decomposition(node: torch.fx.Node) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """The node's decomposition as a graph over its tensor inputs."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, torch.fx.Node)]

    def decomposed(*tensors):
        values = list(flat)
        for i, t in zip(positions, tensors):
            values[i] = t
        args, kwargs = pytree.tree_unflatten(values, spec)
        result = node.target.decompose(*args, **kwargs)
        if result is NotImplemented:
            raise AssertionError(f"{node.target} has no decomposition into ATen operations")
        return result

    fakes = [flat[i].meta["val"] for i in positions]
    return make_fx(decomposed, tracing_mode="real")(*fakes), [flat[i] for i in positions]


class DecomposeCustomOpsPass(Pass):
    name = "decompose_custom_ops"

    def call(self, graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
        graph = graph_module.graph
        found = [n for n in graph.nodes if _is_custom(n)]
        for node in found:
            sub, inputs = _traced_decomposition(node)
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            env = dict(zip(placeholders, inputs))
            with graph.inserting_before(node):
                for sub_node in sub.graph.nodes:
                    if sub_node.op in ("placeholder", "output"):
                        continue
                    new = graph.node_copy(sub_node, lambda n: env[n])
                    new.meta.update({k: node.meta[k] for k in SOURCE_META if k in node.meta})
                    new.meta["val"] = sub_node.meta.get("val")
                    env[sub_node] = new
            result = next(n for n in sub.graph.nodes if n.op == "output").args[0]
            replacement = pytree.tree_map(lambda n: env[n] if isinstance(n, torch.fx.Node) else n, result)
            if isinstance(replacement, (tuple, list)):
                if any(user.target is not operator.getitem for user in node.users):
                    raise AssertionError(f"{node.name} returns several values and is used whole")
                for user in list(node.users):
                    user.replace_all_uses_with(replacement[user.args[1]])
                    graph.erase_node(user)
            else:
                node.replace_all_uses_with(replacement)
            graph.erase_node(node)
        return graph_module, bool(found)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        left = [n.name for n in graph_module.graph.nodes if _is_custom(n)]
        symbolic = [n.name for n in graph_module.graph.nodes if any(isinstance(a, torch.SymInt) for a in pytree.tree_leaves((n.args, n.kwargs)))]
        if symbolic:  # a size must come from a sym_size node, or the graph cannot be stored
            raise AssertionError(f"nodes with bare symbolic sizes: {symbolic[:5]}")
        if left:
            raise AssertionError(f"custom ops left: {left[:5]}")
