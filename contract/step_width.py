"""The step-width declaration (docs/contracts/offgraph_kv-v1.md): "input_index:dim"
names the input of the lowered program that carries the step's token count
T, and the dim that holds it.

The check reads a program as a GraphView (built from a live fx graph at
export, or from a package's stored JSON graph by `validate`) and finds by
data flow:
- the tokens: the integer input that feeds an embedding lookup; T is its
  last dim;
- the positions: the integer input whose values reach floating-point
  arithmetic (rotary angles), other than as an index.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

from kvexport.contract.errors import PackageError
from kvexport.contract.program_check import symbol_of

_SPEC = re.compile(r"([0-9]+):([0-9]+)")
_INDEX_OPS = ("embedding", "index", "gather", "scatter")
FLOAT_DTYPES = {"float16", "float32", "float64", "bfloat16"}
INT_DTYPES = {"int8", "int16", "int32", "int64", "uint8"}


class StepWidthError(PackageError):
    pass


@dataclass
class GraphView:
    """What the check needs of a program: its user inputs in order, each
    value's dtype name and shape (ints, or symbol strings for dynamic dims),
    and which ops use each value."""

    user_inputs: list[str]
    dtypes: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)
    uses: dict[str, list[tuple[str, list[str]]]] = field(default_factory=dict)  # value -> [(op, outputs)]

    def _reaches(self, start: str, found) -> bool:
        seen, queue = {start}, deque([start])
        while queue:
            value = queue.popleft()
            for op, outputs in self.uses.get(value, []):
                if found(op, outputs):
                    return True
                if any(k in op for k in _INDEX_OPS):
                    continue  # what an index op returns is the table's values, not the index's (an int8 weight's rows)
                for out in outputs:
                    if out not in seen and self.dtypes.get(out) in INT_DTYPES:
                        seen.add(out)
                        queue.append(out)
        return False

    def _int_inputs(self) -> list[int]:
        return [i for i, name in enumerate(self.user_inputs) if self.dtypes.get(name) in INT_DTYPES]

    def tokens_input(self) -> int | None:
        for i in self._int_inputs():
            if self._reaches(self.user_inputs[i], lambda op, outs: "embedding" in op):
                return i
        return None

    def positions_input(self) -> int | None:
        def to_float(op: str, outputs: list[str]) -> bool:
            return not any(k in op for k in _INDEX_OPS) and any(self.dtypes.get(o) in FLOAT_DTYPES for o in outputs)

        for i in self._int_inputs():
            if self._reaches(self.user_inputs[i], to_float):
                return i
        return None


def parse_step_width(spec: object) -> tuple[int, int]:
    match = _SPEC.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise StepWidthError(
            f"step width {spec!r} is malformed: expected two non-negative decimals joined by one colon, like '1:0'"
        )
    return int(match.group(1)), int(match.group(2))


def check_step_width(spec: object, graph: GraphView) -> None:
    """Raises StepWidthError with one of the contract's four messages."""
    index, dim = parse_step_width(spec)
    n = len(graph.user_inputs)
    if index >= n:
        raise StepWidthError(f"step width {spec!r}: input {index} does not exist; the program takes {n} inputs")
    positions = graph.positions_input()
    if positions is None:
        raise StepWidthError(f"step width {spec!r}: no input of the program feeds the positions")
    if index != positions:
        raise StepWidthError(
            f"step width {spec!r}: input {index} ({graph.user_inputs[index]}) does not feed the positions; "
            f"positions come from input {positions} ({graph.user_inputs[positions]})"
        )
    tokens = graph.tokens_input()
    if tokens is None:
        raise StepWidthError(f"step width {spec!r}: no input of the program feeds the token embedding")
    step = graph.shapes[graph.user_inputs[tokens]][-1]
    shape = graph.shapes[graph.user_inputs[index]]
    if dim >= len(shape) or shape[dim] != step:
        size = shape[dim] if dim < len(shape) else f"none (rank {len(shape)})"
        raise StepWidthError(
            f"step width {spec!r}: dim {dim} is not the step: it has size {size}, the step has {step} tokens"
        )


# ---------------------------------------------------------------- readers
def view_of_serialized(program: dict) -> GraphView:
    """A GraphView of a program as torch's serializer writes it (JSON)."""
    from torch._export.serde.schema import ScalarType

    gm = program["graph_module"]
    graph = gm["graph"]
    view = GraphView(user_inputs=[])
    for spec in gm["signature"]["input_specs"]:
        if "user_input" in spec:
            view.user_inputs.append(spec["user_input"]["arg"]["as_tensor"]["name"])
    for name, meta in graph["tensor_values"].items():
        view.dtypes[name] = _scalar_name(ScalarType(meta["dtype"]).name)
        # a dynamic dim as its symbol's name (s27), as range_constraints keys it
        view.shapes[name] = tuple(
            s["as_int"] if "as_int" in s else symbol_of(s["as_expr"]["expr_str"]) for s in meta["sizes"]
        )
    for node in graph["nodes"]:
        outputs = [o["as_tensor"]["name"] for o in node["outputs"] if "as_tensor" in o]
        outputs += [t["name"] for o in node["outputs"] if "as_tensors" in o for t in o["as_tensors"]]
        op = node["target"].removeprefix("torch.ops.")
        for arg in node["inputs"]:
            value = arg["arg"]
            used = [value["as_tensor"]["name"]] if "as_tensor" in value else []
            used += [t["name"] for t in value.get("as_tensors", [])]
            for name in used:
                view.uses.setdefault(name, []).append((op, outputs))
    return view


_SCALAR_NAMES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
                 "short": "int16", "char": "int8", "byte": "uint8", "bool": "bool", "bfloat16": "bfloat16"}


def _scalar_name(enum_name: str) -> str:
    return _SCALAR_NAMES.get(enum_name.lower(), enum_name.lower())


def view_of_graph_module(graph_module, user_inputs: list[str]) -> GraphView:
    """A GraphView of a live fx graph whose nodes carry meta['val']."""
    import torch

    view = GraphView(user_inputs=list(user_inputs))
    for node in graph_module.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            view.dtypes[node.name] = str(val.dtype).removeprefix("torch.")
            view.shapes[node.name] = tuple(d if isinstance(d, int) else str(d) for d in val.shape)
        if node.op != "call_function":
            continue
        outputs = [node.name]
        for getter in node.users:  # multi-output ops return through getitem
            if getter.op == "call_function" and "getitem" in str(getter.target):
                outputs.append(getter.name)
        op = node.target.name() if isinstance(node.target, torch._ops.OpOverload) else str(node.target)
        for used in node.all_input_nodes:
            view.uses.setdefault(used.name, []).append((op, outputs))
    return view
