"""Sibling linears (several products of one input, such as attention's q, k
and v, or an MLP's gate and up) become one product over their weights
stacked, whose output is sliced back into each.

A decode step reads every weight once; fewer, larger products read them
closer to the memory's rate (one call and one stream instead of three
short ones). SmolLM2's aoti batch-1 step was 2.8% faster (median of 40
interleaved rounds, bench/ab_decode.py), 8 sessions and a 512-token
prefill alike. The stacked weight is a new parameter that replaces its
parts in every method, so the package stores the same bytes.

Products with int8 activations (quantized linears under --qact int8) stack
the same way: their codes, scales and offsets along the rows, their
input rounded once. On kvexport's int8 kernel a SmolLM2 4w step's products
took 3.22 against 3.79 ms (best of 7 rounds, 1 row; 6.92 against 7.22 ms
at 8 rows), 120 calls instead of 210 (bench/fused_siblings.py).

The stacked weight is never built in memory: it is an uninitialized tensor
(its pages are never touched) whose parts are recorded in `FusedWeights`,
and the package writer writes the parts one after the other. Nothing reads
a weight's values between tracing and writing (AOTInductor compiles around
stand-ins), so a model larger than memory stays on disk.
"""

from __future__ import annotations

import os
import re

import torch
import torch.fx
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from kvexport.passes.packed_weights import PANEL_ROWS  # (the module defines kvexport::int8_rows and kvexport::dequantize_blocks)
from kvexport.passes.base import arguments, emit

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_ROUNDINGS = (torch.ops.kvexport.int8_rows.default, torch.ops.kvexport.int8x2_rows.default,
              torch.ops.kvexport.int16_rows.default, torch.ops.kvexport.int8_peak_rows.default)
_DEQUANTIZE_BLOCKS = torch.ops.kvexport.dequantize_blocks.default


class FusedWeights:
    """Stacked weights shared by every method: the same parts give the same
    tensor, and `parts(tensor)` says what to write for it."""

    def __init__(self) -> None:
        self._by_parts: dict[tuple[int, ...], torch.Tensor] = {}
        self._parts: dict[int, list[torch.Tensor]] = {}  # data_ptr of a stacked tensor -> its parts

    def stacked(self, parts: list[torch.Tensor]) -> torch.Tensor:
        key = tuple(id(p) for p in parts)
        if key not in self._by_parts:
            rows = sum(p.shape[0] for p in parts)
            empty = torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, device=parts[0].device)
            tensor = torch.nn.Parameter(empty, requires_grad=False)
            self._by_parts[key] = tensor
            self._parts[tensor.data_ptr()] = parts
        return self._by_parts[key]

    def parts(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        return self._parts.get(tensor.data_ptr()) if tensor.numel() else None


def _parameter(node, parameters: dict[str, str]) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return node.op == "placeholder" and node.name in parameters and isinstance(val, torch.Tensor) and val.dtype in _FLOATS


def fuse_sibling_linears(program: torch.export.ExportedProgram, fused: FusedWeights) -> int:
    """Rewrites every group of two or more linears over one input whose
    weights (and biases, all or none) are parameters of one dtype; drops the
    parameters no longer used. Returns the number of groups fused."""
    graph = program.graph_module.graph
    parameters = program.graph_signature.inputs_to_parameters  # placeholder name -> state dict key
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.linear.default:
            given = arguments(node)
            weight, bias = given["weight"], given.get("bias")
            if _parameter(weight, parameters) and weight.meta["val"].dim() == 2 and (bias is None or _parameter(bias, parameters)):
                groups.setdefault(given["input"], []).append(node)
    count = 0
    replaced: set[torch.fx.Node] = set()
    for x, nodes in groups.items():
        nodes = _compatible(nodes)
        if len(nodes) < 2:
            continue
        weights = [arguments(n)["weight"] for n in nodes]
        biases = [arguments(n).get("bias") for n in nodes]
        sizes = [w.meta["val"].shape[0] for w in weights]
        stacked_weight = _add_parameter(program, weights, fused)
        stacked_bias = _add_parameter(program, biases, fused) if biases[0] is not None else None
        replaced.update(weights + [b for b in biases if b is not None])
        with graph.inserting_before(nodes[0]):
            _slice_back(graph, nodes, emit(graph, nodes[0], aten.linear.default, x, stacked_weight, stacked_bias), sizes)
        for node in nodes:
            graph.erase_node(node)
        count += 1
    return _finish(program, replaced, count)


def fuse_sibling_int8_products(program: torch.export.ExportedProgram, fused: FusedWeights) -> int:
    """Rewrites every group of two or more products with int8 activations
    over one input (exporter/quantization's Int8Linear:
    linear(int8_rows(x), dequantize_blocks(data, scale, offset, bits, dtype)),
    or the same with int8x2_rows(x), int16_rows(x) or int8_peak_rows(x), never two mixed), whose codes have
    one width, group and code size, whose scales one dtype, and whose biases
    are all parameters or all absent: their codes, scales and offsets stacked
    along the rows (codes in blocks are panel by panel of 8 rows, so the
    stacked codes are the parts' bytes one after the other, and each row's
    product is its part's), x rounded once, one product, sliced back. Returns the number of groups
    fused."""
    graph = program.graph_module.graph
    signature = program.graph_signature
    stored = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        given = arguments(node)
        rounded, weight, bias = given["input"], given["weight"], given.get("bias")
        if not (any(_calls(rounded, r) for r in _ROUNDINGS) and _calls(weight, _DEQUANTIZE_BLOCKS)
                and len(weight.args) == 5):
            continue
        data, scale, offset, bits, dtype = weight.args
        if not all(_stored(t, stored) for t in (data, scale, offset)) or (
                bias is not None and not _parameter(bias, signature.inputs_to_parameters)):
            continue
        shapes = tuple(tuple(t.meta["val"].shape[1:]) for t in (data, scale, offset))
        key = (rounded.target, rounded.args[0], bits, dtype, shapes, scale.meta["val"].dtype,
               None if bias is None else bias.meta["val"].dtype)
        groups.setdefault(key, []).append(node)
    count = 0
    replaced: set[torch.fx.Node] = set()
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        weights = [arguments(n)["weight"] for n in nodes]
        biases = [arguments(n).get("bias") for n in nodes]
        data, scale, offset = ([w.args[i] for w in weights] for i in range(3))
        bits, dtype = weights[0].args[3:]
        stacked = [_add_parameter(program, parts, fused) for parts in (data, scale, offset)]
        stacked_bias = _add_parameter(program, biases, fused) if biases[0] is not None else None
        replaced.update(data + scale + offset + [b for b in biases if b is not None])
        rounded = arguments(nodes[0])["input"]
        with graph.inserting_before(nodes[0]):
            weight = emit(graph, nodes[0], _DEQUANTIZE_BLOCKS, *stacked, bits, dtype)
            product = emit(graph, nodes[0], aten.linear.default, rounded, weight, stacked_bias)
            _slice_back(graph, nodes, product, [part.meta["val"].shape[0] * PANEL_ROWS for part in data])
        for node in nodes:
            inputs = [arguments(node)["input"], arguments(node)["weight"]]
            graph.erase_node(node)
            for left in inputs:
                if not left.users:
                    graph.erase_node(left)
        count += 1
    return _finish(program, replaced, count)


def _slice_back(graph: torch.fx.Graph, nodes: list[torch.fx.Node], product: torch.fx.Node, sizes: list[int]) -> None:
    """Each of `nodes` is replaced by its columns of the stacked product, in order."""
    start = 0
    for node, size in zip(nodes, sizes):
        node.replace_all_uses_with(emit(graph, node, aten.slice.Tensor, product, -1, start, start + size))
        start += size


def _finish(program: torch.export.ExportedProgram, replaced: set[torch.fx.Node], count: int) -> int:
    """The stacked parts' inputs dropped and the graph checked, after `count` groups fused."""
    if count:
        _drop_unused(program, replaced)
        program.graph_module.graph.lint()
        program.graph_module.recompile()
    return count


def _calls(node: object, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _stored(node: object, stored: dict[str, str]) -> bool:
    """A parameter or buffer of the program (an input the runtime binds)."""
    return (isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.name in stored
            and isinstance(node.meta.get("val"), torch.Tensor))


def _compatible(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The largest set of siblings that can stack: one dtype, one input
    width, all biased or none (in graph order)."""
    def key(node):
        given = arguments(node)
        w = given["weight"].meta["val"]
        return w.dtype, w.shape[1], given.get("bias") is None

    keys = [key(n) for n in nodes]
    best = max(keys, key=keys.count)  # on a tie, the first in graph order: the same in every export
    return [n for n, k in zip(nodes, keys) if k == best]


def _add_parameter(program: torch.export.ExportedProgram, placeholders: list[torch.fx.Node], fused: FusedWeights) -> torch.fx.Node:
    """The parameters (or buffers: an int8 product's codes, scales and
    offsets) stacked, as a new parameter of the program (an input the
    runtime binds, as the parts were: a compiler folds nothing from it),
    named from theirs: `...self_attn.q_k_v_proj.weight`."""
    signature = program.graph_signature
    stored = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    keys = [stored[p.name] for p in placeholders]
    tensor = fused.stacked([program.state_dict[k] for k in keys])
    name = _stacked_name(keys)
    while name in program.state_dict and program.state_dict[name] is not tensor:
        name += "_stacked"
    graph = program.graph_module.graph
    specs = program.graph_signature.input_specs
    position = max(i for i, s in enumerate(specs) if s.kind == InputKind.PARAMETER) + 1
    anchor = next(n for n in graph.nodes if n.op == "placeholder" and n.name == specs[position].arg.name)
    with graph.inserting_before(anchor):
        node = graph.placeholder("p_" + re.sub(r"\W", "_", name))
    node.meta["val"] = placeholders[0].meta["val"].fake_mode.from_tensor(tensor, static_shapes=True)
    specs.insert(position, InputSpec(InputKind.PARAMETER, TensorArgument(node.name), name, persistent=None))
    program.state_dict[name] = tensor
    return node


def _stacked_name(keys: list[str]) -> str:
    """'a.q_proj.weight', 'a.k_proj.weight' -> 'a.q_k_proj.weight' (the
    modules' names joined, their common suffix once)."""
    split = [k.split(".") for k in keys]
    if not all(len(s) == len(split[0]) and s[:-2] == split[0][:-2] and s[-1] == split[0][-1] for s in split):
        return "stacked." + split[0][-1]
    modules = [s[-2] for s in split]
    suffix = os.path.commonprefix([m[::-1] for m in modules])[::-1]
    suffix = suffix[suffix.find("_"):] if "_" in suffix else ""
    joined = "_".join(m[: len(m) - len(suffix)] for m in modules) + suffix
    return ".".join(split[0][:-2] + [joined, split[0][-1]])


def _drop_unused(program: torch.export.ExportedProgram, placeholders: set[torch.fx.Node]) -> None:
    """The stacked parameters' parts: their inputs leave the program."""
    specs = program.graph_signature.input_specs
    for node in placeholders:
        if node.users:
            continue
        spec = next(s for s in specs if getattr(s.arg, "name", None) == node.name)
        specs.remove(spec)
        if not any(s.target == spec.target for s in specs):
            program.state_dict.pop(spec.target, None)
        program.graph_module.graph.erase_node(node)
