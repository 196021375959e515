"""Graph transform passes. A pass takes a graph module and returns
`(graph_module, modified)`; it may check what it requires before it runs and
what it ensures after. `run_passes` runs a list in order, lints the graph
after each, and names the pass, the method and the passes before it when one
fails."""

from __future__ import annotations

import math
from typing import Sequence

import torch.fx

from kvexport.contract import torch_compat
from kvexport.contract.errors import ExportError


class PassError(ExportError):
    pass


class Pass:
    """Subclasses set `name` and implement `call`."""

    name = "pass"

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        """Raise if the graph is not what this pass expects."""

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        """Raise if the pass did not leave the graph as it promises."""

    def call(self, graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
        raise NotImplementedError

    def __call__(self, graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
        self.requires(graph_module)
        graph_module, modified = self.call(graph_module)
        self.ensures(graph_module)
        return graph_module, modified


class RewritePass(Pass):
    """A pass that replaces every node `candidates` finds with what
    `rewrite` emits just before it (the insertion point is set), and
    ensures none is left. Subclasses set `leftover`, the error's words."""

    leftover = "nodes left to rewrite"

    def candidates(self, graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
        raise NotImplementedError

    def rewrite(self, graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        raise NotImplementedError

    def call(self, graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
        graph = graph_module.graph
        found = self.candidates(graph_module)
        for node in found:
            with graph.inserting_before(node):
                replacement = self.rewrite(graph, node)
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
        return graph_module, bool(found)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        left = self.candidates(graph_module)
        if left:
            raise AssertionError(f"{self.leftover}: {[n.name for n in left[:5]]}")


SOURCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "torch_fn")


def emit(graph: torch.fx.Graph, like: torch.fx.Node, target, *args, **kwargs) -> torch.fx.Node:
    """Inserts `target(*args, **kwargs)` at the graph's insertion point, with
    the source metadata of `like` (the node it replaces: source location,
    module stack) and its own value computed from its inputs' fake values."""
    new = graph.call_function(target, args, kwargs)
    new.meta.update({k: like.meta[k] for k in SOURCE_META if k in like.meta})
    args, kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    with torch_compat.fake_mode_of((args, kwargs)):
        new.meta["val"] = target(*args, **kwargs)
    return new


def emit_shape(graph: torch.fx.Graph, like: torch.fx.Node, of: torch.fx.Node) -> list:
    """The shape of `of` as a size argument: its static dims as ints, each
    dynamic dim read from it with a sym_size node."""
    return [
        d if isinstance(d, int) else emit(graph, like, torch.ops.aten.sym_size.int, of, i)
        for i, d in enumerate(of.meta["val"].shape)
    ]


def arguments(node: torch.fx.Node) -> dict:
    """An operator call's arguments by schema name, however they were passed."""
    names = [a.name for a in node.target._schema.arguments]
    return dict(zip(names, node.args)) | dict(node.kwargs)


def static_rows(x: torch.fx.Node) -> int | None:
    """How many rows a product over `x` has (all dims but the last), when
    that is known at export time."""
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 1:
        return None
    lead = val.shape[:-1]
    return math.prod(lead) if all(isinstance(d, int) for d in lead) else None


def run_passes(
    graph_module: torch.fx.GraphModule, passes: Sequence[Pass], method: str
) -> tuple[torch.fx.GraphModule, list[str]]:
    """Runs `passes` in order; returns the graph and the names of the passes
    that changed it."""
    ran: list[str] = []
    changed: list[str] = []
    for p in passes:
        try:
            graph_module, modified = p(graph_module)
            graph_module.graph.lint()
        except Exception as e:
            before = ", ".join(ran) or "none"
            raise PassError(f"pass {p.name} failed on {method} (passes before it: {before}): {type(e).__name__}: {e}") from e
        ran.append(p.name)
        if modified:
            changed.append(p.name)
            graph_module.recompile()
    return graph_module, changed
