"""Constant names that stay unique across a whole package.

torch 2.13's lifting names a new constant `lifted_tensor_N` counting from the
program's own constants only, and a name already in use silently replaces the
earlier tensor. In a package every method's tensors share one weights file,
keyed by name, so a name must mean one tensor package-wide.

`ConstantNames` reserves every name the package's programs already hold
(parameters, buffers, constants) before any new constant is named, names new
ones deterministically (`<hint>_<lowest free N>`, in method order and graph
order, so the same export gives the same names) and raises on a name bound to
two different tensors.

The pipeline first has `ConstantNames.reserve_program` take every method's
names (renaming a constant whose name another method holds for a different
tensor); then `ReserveConstantNamesPass` lifts each tensor a pass attached to
a graph module (a `get_attr` node) into its program as a constant input
under a fresh name.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from kvexport.passes.base import Pass, PassError


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))


class ConstantNames:
    """name -> tensor for a whole package."""

    def __init__(self) -> None:
        self.bound: dict[str, torch.Tensor] = {}

    def holds(self, name: str, tensor: torch.Tensor) -> bool:
        return name in self.bound and _same_tensor(self.bound[name], tensor)

    def reserve(self, name: str, tensor: torch.Tensor) -> None:
        """Binds an existing name; the same tensor again is fine."""
        if name in self.bound and not _same_tensor(self.bound[name], tensor):
            raise PassError(f"constant name {name!r} is bound to two different tensors")
        self.bound[name] = tensor

    def new(self, hint: str, tensor: torch.Tensor) -> str:
        """A fresh name for a new tensor: `<hint>_<lowest free N>`."""
        n = 0
        while f"{hint}_{n}" in self.bound:
            n += 1
        name = f"{hint}_{n}"
        self.bound[name] = tensor
        return name

    def reserve_program(self, program: torch.export.ExportedProgram) -> bool:
        """Reserves every name a program holds. Parameters and buffers are
        shared by name between methods (the same name must be the same
        tensor); a constant whose name another method holds for a different
        tensor is renamed. Returns whether anything was renamed."""
        for name, tensor in program.state_dict.items():
            self.reserve(name, tensor)
        renamed = False
        constants = program.constants
        for spec in program.graph_signature.input_specs:
            if spec.kind == InputKind.BUFFER and not spec.persistent:
                self.reserve(spec.target, constants[spec.target])
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                tensor = constants[spec.target]
                if spec.target not in self.bound or self.holds(spec.target, tensor):
                    self.reserve(spec.target, tensor)
                    continue
                fresh = self.new(spec.target.rstrip("0123456789").rstrip("_") or "constant", tensor)
                del constants[spec.target]
                constants[fresh] = tensor
                spec.target = fresh
                renamed = True
        return renamed


class ReserveConstantNamesPass(Pass):
    """Lifts the tensors passes attached to the graph module (get_attr
    nodes) into the program as constants, named by a package-wide
    ConstantNames that already holds every existing name."""

    name = "reserve_constant_names"

    def __init__(self, names: ConstantNames, program: torch.export.ExportedProgram, hint: str = "kvexport_constant"):
        self.names = names
        self.program = program
        self.hint = hint

    def call(self, graph_module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, bool]:
        modified = False
        for node in list(graph_module.graph.nodes):
            if node.op != "get_attr":
                continue
            value = getattr(graph_module, node.target, None)
            if isinstance(value, torch.Tensor):
                self._lift(graph_module, node, value)
                modified = True
        return graph_module, modified

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        left = [n.target for n in graph_module.graph.nodes if n.op == "get_attr" and isinstance(getattr(graph_module, n.target, None), torch.Tensor)]
        if left:
            raise AssertionError(f"tensors left unlifted: {left}")
        targets = [s.target for s in self.program.graph_signature.input_specs if s.target is not None]
        if len(targets) != len(set(targets)):
            raise AssertionError(f"duplicate input targets: {sorted(t for t in targets if targets.count(t) > 1)}")

    def _lift(self, graph_module: torch.fx.GraphModule, node: torch.fx.Node, value: torch.Tensor) -> None:
        name = self.names.new(self.hint, value)
        graph = graph_module.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        specs = self.program.graph_signature.input_specs
        # constants go before the user inputs, after every other lifted input
        position = next((i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT), len(specs))
        anchor = placeholders[position] if position < len(placeholders) else None
        with graph.inserting_before(anchor) if anchor is not None else graph.inserting_after(placeholders[-1]):
            placeholder = graph.placeholder(f"c_{name}")
        placeholder.meta = dict(node.meta)
        placeholder.meta.setdefault("val", value)
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        delattr(graph_module, node.target)
        specs.insert(position, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(placeholder.name), name))
        self.program.constants[name] = value
