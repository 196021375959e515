"""Graph transform passes. A pass takes a graph module and returns
`(graph_module, modified)`; it may check what it requires before it runs and
what it ensures after. `run_passes` runs a list in order, lints the graph
after each, and names the pass, the method and the passes before it when one
fails."""

from __future__ import annotations

from typing import Sequence

import torch.fx

from kvexport.runtime.errors import ExportError


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
