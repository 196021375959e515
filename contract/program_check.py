"""What a stored program may hold, checked before torch's deserializer sees it.

A package is data. torch 2.13's program deserializer hands every symbolic
size (`expr_str`, e.g. `Mul(Integer(16), Symbol('s27', positive=True,
integer=True))`) to `sympy.sympify`, which evaluates Python, and resolves
node targets by walking attributes of `torch`, `operator` and `math`. So a
program is checked here first, and refused with its method and the
offending text named, unless:
- the graph holds at most the nodes its package's layers need, counted
  before anything else is walked;
- every node calls one of the exact operator overloads kvexport emits, or
  a symbolic-integer helper, with arguments the allowlist admits
  (op_allowlist: layouts, devices, literal allocation sizes);
- every symbolic expression parses, with Python's `ast` (never `eval`),
  into the small grammar of integer arithmetic torch writes: `Symbol`,
  `Integer`, `Add`, `Mul`, `Min`, `Max`, `FloorDiv`, `Mod`, ... ;
- every value name, and every argument name and keyword of the call
  signature, is a plain identifier, and the signature's pytree specs hold
  only tuples, lists and dicts: torch writes those names into the Python
  source of the rebuilt module, and decodes a spec's context with a hook
  that imports whatever module it names;
- the graph signature holds only the input and output kinds kvexport's
  methods have, and every tensor and module name in it (`parameter_name`,
  `buffer_name`, a call's `fqn`, ...) is a dotted name: torch writes those
  into `getattr(self, "...")` lines of the rebuilt module's source.

`parse_sym_expr` also builds the sympy expression itself from the parse, so
loading never calls `sympify` on package text (see torch_compat).
"""

from __future__ import annotations

import ast
import functools
import json
import keyword
import re
from typing import Any, Callable, Iterator

from kvexport.contract.op_allowlist import DEFAULT_LIMITS, ProgramLimits, argument_problem, target_problem

SYMBOL_NAME = re.compile(r"[a-z]{1,8}[0-9]{1,9}")
MAX_EXPR_CHARS = 4096  # torch writes a few hundred at most; bounds the parse
# sympy's Min and Max compare their arguments pairwise as they are built:
# 64 symbols in one Max took 3.5 s, 280 took 25 s. kvexport's programs hold
# at most a few symbols and integers an expression, and about ten distinct
# expressions a program.
MAX_EXPR_LEAVES = 12
MAX_PROGRAM_EXPRS = 128
_ASSUMPTIONS = ("positive", "integer", "nonnegative", "negative", "real", "finite")


class UnsafeProgram(ValueError):
    """A program holds something the package format does not allow."""


def check_target(target: Any) -> str | None:
    """None when the node target is allowed, else why not."""
    return target_problem(target)


# ----------------------------------------------------------------- grammar
def _functions() -> dict[str, Callable]:
    """Name -> sympy constructor, for every function the grammar allows."""
    import sympy
    from torch.utils._sympy import functions as tf

    return {
        "Add": sympy.Add, "Mul": sympy.Mul, "Min": sympy.Min, "Max": sympy.Max,
        "FloorDiv": tf.FloorDiv, "Mod": tf.Mod, "PythonMod": tf.PythonMod, "CeilDiv": tf.CeilDiv,
        "CleanDiv": tf.CleanDiv, "PowByNatural": tf.PowByNatural, "ModularIndexing": tf.ModularIndexing,
        "Equality": sympy.Eq, "Unequality": sympy.Ne, "StrictLessThan": sympy.Lt, "LessThan": sympy.Le,
        "StrictGreaterThan": sympy.Gt, "GreaterThan": sympy.Ge, "And": sympy.And, "Or": sympy.Or, "Not": sympy.Not,
    }


_FUNCTIONS: dict[str, Callable] | None = None


def parse_sym_expr(text: Any) -> Any:
    """The sympy expression a stored `expr_str` denotes, built from its
    `ast` parse; raises UnsafeProgram for anything outside the grammar.
    The check and torch's deserializer parse each expression of a program,
    hundreds of times the same few: each text is built once."""
    if not isinstance(text, str):
        raise UnsafeProgram(f"expression is not a string: {text!r:.80}")
    return _parse_text(text)


@functools.lru_cache(maxsize=4 * MAX_PROGRAM_EXPRS)
def _parse_text(text: str) -> Any:
    global _FUNCTIONS
    if len(text) > MAX_EXPR_CHARS:
        raise UnsafeProgram(f"expression of {len(text)} characters (at most {MAX_EXPR_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise UnsafeProgram(f"expression {text!r:.120} does not parse ({type(e).__name__})") from None
    leaves = sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("Symbol", "Integer") for n in ast.walk(tree))
    if leaves > MAX_EXPR_LEAVES:
        raise UnsafeProgram(f"expression {text!r:.120} has {leaves} symbols and integers (at most {MAX_EXPR_LEAVES})")
    if _FUNCTIONS is None:
        _FUNCTIONS = _functions()
    try:
        return _build(tree.body, text)
    except RecursionError:
        raise UnsafeProgram(f"expression {text[:120]!r} nests too deeply") from None


def _build(node: ast.AST, text: str) -> Any:
    import sympy

    if isinstance(node, ast.Constant) and type(node.value) is bool:
        return sympy.true if node.value else sympy.false
    if isinstance(node, ast.Name) and node.id in ("true", "false"):  # sympy's srepr of booleans
        return sympy.true if node.id == "true" else sympy.false
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise UnsafeProgram(f"expression {text!r:.120}: {ast.dump(node)[:80]} is not allowed")
    name = node.func.id
    if name == "Symbol":
        return _symbol(node, text)
    if name == "Integer":
        if len(node.args) != 1 or node.keywords:
            raise UnsafeProgram(f"expression {text!r:.120}: Integer takes one integer")
        return sympy.Integer(_int_literal(node.args[0], text))
    if name not in _FUNCTIONS or node.keywords or not node.args:
        raise UnsafeProgram(f"expression {text!r:.120}: function {name!r} is not in the grammar")
    return _FUNCTIONS[name](*(_build(arg, text) for arg in node.args))


def _int_literal(node: ast.AST, text: str) -> int:
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        sign, node = -1, node.operand
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value < 1 << 63:
        return sign * node.value
    raise UnsafeProgram(f"expression {text!r:.120}: Integer needs an integer literal")


def _symbol(node: ast.Call, text: str) -> Any:
    import sympy

    if len(node.args) != 1 or not isinstance(node.args[0], ast.Constant) or not isinstance(node.args[0].value, str):
        raise UnsafeProgram(f"expression {text!r:.120}: Symbol takes one name")
    name = node.args[0].value
    if not SYMBOL_NAME.fullmatch(name):
        raise UnsafeProgram(f"expression {text!r:.120}: symbol name {name!r:.40} is not like s27")
    assumptions = {}
    for assumption in node.keywords:
        value = assumption.value
        if assumption.arg not in _ASSUMPTIONS or not (isinstance(value, ast.Constant) and type(value.value) is bool):
            raise UnsafeProgram(f"expression {text!r:.120}: Symbol assumption {assumption.arg!r} is not allowed")
        assumptions[assumption.arg] = value.value
    return sympy.Symbol(name, **assumptions)


# ------------------------------------------------------------------- walk
def _walk(program: Any) -> Iterator[tuple[str, Any]]:
    """(key, value) of every dict entry in the JSON tree, iteratively (a
    hostile file may nest deeper than Python's recursion limit)."""
    stack = [program]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                yield key, value
                if isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (dict, list)))


def _nodes(program: dict) -> Iterator[dict]:
    """Every node of the program's graph and of any nested graph."""
    for key, value in _walk(program):
        if key == "nodes" and isinstance(value, list):
            yield from (n for n in value if isinstance(n, dict))


def check_program(method: str, program: Any, limits: ProgramLimits = DEFAULT_LIMITS) -> list[str]:
    """Every violation of the allowlist (and of the little structure read
    before the deserializer), each naming the method. `limits` come from
    the package's manifest (op_allowlist.program_limits)."""
    where = f"methods.{method}.program"
    if not isinstance(program, dict):
        return [f"{where}: not a JSON object"]
    graph = program.get("graph_module", {}).get("graph") if isinstance(program.get("graph_module"), dict) else None
    if not isinstance(graph, dict) or not isinstance(graph.get("nodes"), list):
        return [f"{where}: no graph_module.graph.nodes"]
    # torch's deserializer spends about a millisecond and 24 KB a node:
    # count them before walking anything else.
    if len(graph["nodes"]) > limits.max_nodes:
        return [f"{where}: {len(graph['nodes'])} nodes, more than the {limits.max_nodes} its package's layers need"]
    # what the loader reads itself before torch's deserializer sees the program
    problems = [f"{where}: graph_module.graph.nodes[{i}] is not an object" for i, n in enumerate(graph["nodes"]) if not isinstance(n, dict)]
    calls = program["graph_module"].get("module_call_graph")
    if isinstance(calls, list) and calls and not (isinstance(calls[0], dict) and calls[0].get("fqn") == ""):
        problems.append(f"{where}: graph_module.module_call_graph[0] must be the root module's (fqn ''), found {calls[0]!r:.80}")
    problems += [f"{where}: {why}" for why in _signature_problems(calls)]
    problems += [f"{where}: {why}" for why in _graph_signature_problems(program["graph_module"].get("signature"))]
    module_names = [c.get("fqn") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
    problems += [
        f"{where}: graph_module.module_call_graph names module {n!r:.120}, not a dotted name"
        for n in module_names if n != "" and not dotted_name(n)
    ]
    # torch 2.13 writes a graph input's name verbatim into the rebuilt
    # module's `def forward(...)` line; every value name must be plain.
    names = {v for k, v in _walk(program["graph_module"]) if k in ("name", "as_name") and isinstance(v, str) and v}
    problems += [f"{where}: value name {n!r:.120} is not a plain identifier" for n in sorted(names) if not _identifier(n)]
    problems += [f"{where}: {why}" for why in _node_problems(program, limits)]
    stored = [v for k, v in _walk(program) if k == "expr_str"]
    problems += [f"{where}: expression is not a string: {v!r:.80}" for v in stored if not isinstance(v, str)][:3]
    expressions = {v for v in stored if isinstance(v, str)}
    if len(expressions) > MAX_PROGRAM_EXPRS:
        problems.append(f"{where}: {len(expressions)} distinct symbolic expressions (at most {MAX_PROGRAM_EXPRS})")
        expressions = set()
    for value in sorted(expressions):
        try:
            parse_sym_expr(value)
        except UnsafeProgram as e:
            problems.append(f"{where}: {e}")
    return problems[:20] + ([f"{where}: ... and {len(problems) - 20} more"] if len(problems) > 20 else [])


def _node_problems(program: dict, limits: ProgramLimits) -> Iterator[str]:
    """Each node's target against the allowlist, then its arguments; nodes
    of nested graphs count towards the cap too."""
    count = 0
    for node in _nodes(program):
        count += 1
        if count > limits.max_nodes:
            yield f"more than {limits.max_nodes} nodes in its graphs, more than its package's layers need"
            return
        if "target" not in node:
            yield "a node has no target"
        elif (why := target_problem(node["target"])) is not None:
            yield why
        else:
            yield from _argument_problems(node["target"], node.get("inputs"), limits)


def _argument_problems(target: str, inputs: Any, limits: ProgramLimits) -> Iterator[str]:
    for entry in inputs if isinstance(inputs, list) else ():
        if isinstance(entry, dict) and (why := argument_problem(target, entry.get("name"), entry.get("arg"), limits)):
            yield why


# ------------------------------------------------------- call signatures
# torch 2.13 rebuilds each module's calling convention from its signature:
# the argument names go verbatim into the Python source of the rebuilt
# forward, a dict's keys into a dict literal there, and a spec's context is
# JSON-decoded with a hook that imports whatever module an `__enum__` object
# names. So: plain identifiers only, and only the containers torch.export
# writes for a method of positional tensors.
SPEC_CONTAINERS = ("builtins.tuple", "builtins.list", "builtins.dict")
MAX_SPEC_CHARS = 1 << 20


def _identifier(name: Any) -> bool:
    return isinstance(name, str) and name.isascii() and name.isidentifier() and not keyword.iskeyword(name)


DOTTED_NAME = re.compile(r"[A-Za-z0-9_]{1,200}(\.[A-Za-z0-9_]{1,200}){0,63}")
# the kinds of graph-signature entries a kvexport method has: tensors in,
# parameters, buffers and lifted constants bound, tensors and mutated state out
INPUT_KINDS = ("user_input", "parameter", "buffer", "tensor_constant")
OUTPUT_KINDS = ("user_output", "buffer_mutation", "user_input_mutation")


def dotted_name(name: Any) -> bool:
    """A tensor or module name as torch and Hugging Face write them
    (`model.layers.0.mlp.down_proj.weight`): parts of letters, digits and
    underscores, nothing that could close a string in generated code."""
    return isinstance(name, str) and name.isascii() and DOTTED_NAME.fullmatch(name) is not None


def _graph_signature_problems(signature: Any) -> Iterator[str]:
    where = "graph_module.signature"
    if not isinstance(signature, dict):
        yield f"{where}: not an object"
        return
    for key, kinds in (("input_specs", INPUT_KINDS), ("output_specs", OUTPUT_KINDS)):
        specs = signature.get(key)
        if not isinstance(specs, list):
            yield f"{where}.{key}: not a list"
            continue
        for i, spec in enumerate(specs):
            kind = next(iter(spec), None) if isinstance(spec, dict) and len(spec) == 1 else None
            if kind not in kinds or not isinstance(spec[kind], dict):
                yield f"{where}.{key}[{i}]: expected one of {', '.join(kinds)}, found {spec!r:.120}"
                continue
            for field, value in spec[kind].items():
                if field.endswith("_name") and not dotted_name(value):
                    yield f"{where}.{key}[{i}].{kind}.{field}: {value!r:.120} is not a dotted name"


def _signature_problems(calls: Any) -> list[str]:
    problems = []
    for i, call in enumerate(calls if isinstance(calls, list) else ()):
        signature = call.get("signature") if isinstance(call, dict) else None
        if signature is None:
            continue
        where = f"graph_module.module_call_graph[{i}].signature"
        if not isinstance(signature, dict):
            problems.append(f"{where}: not an object")
            continue
        names = signature.get("forward_arg_names")
        if names is not None and not (isinstance(names, list) and all(map(_identifier, names))):
            problems.append(f"{where}.forward_arg_names: expected plain identifiers, found {names!r:.120}")
        for key in ("in_spec", "out_spec"):
            if (why := treespec_problem(signature.get(key))) is not None:
                problems.append(f"{where}.{key}: {why}")
    return problems


def treespec_problem(text: Any) -> str | None:
    """Why a serialized pytree spec is not one a package may hold, or None."""
    if not isinstance(text, str) or len(text) > MAX_SPEC_CHARS:
        return f"expected a tree spec string, found {text!r:.80}"
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        return "not JSON"
    if not (isinstance(spec, list) and len(spec) == 2 and spec[0] == 1):
        return "not a protocol 1 tree spec"
    stack = [spec[1]]
    while stack:
        node = stack.pop()
        if not (isinstance(node, dict) and isinstance(node.get("children_spec"), list)):
            return "a node is not {type, context, children_spec}"
        kind, context = node.get("type"), node.get("context")
        if kind is None:
            if context is not None or node["children_spec"]:
                return "a leaf has a context or children"
        elif kind in ("builtins.tuple", "builtins.list"):
            if context != "null":
                return f"a {kind} has a context: {context!r:.80}"
        elif kind == "builtins.dict":
            keys = _json(context)
            if not (isinstance(keys, list) and all(map(_identifier, keys))):
                return f"a dict's keys {context!r:.80} are not plain identifiers"
        else:
            return f"container type {kind!r:.80} is not allowed ({', '.join(SPEC_CONTAINERS)})"
        stack.extend(node["children_spec"])
    return None


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None


def symbol_of(size: Any) -> Any:
    """A stored dim as validate compares it: an int, a symbol's name
    (`s27`, as range_constraints keys it), or an expression's string."""
    if isinstance(size, int):
        return size
    expr = parse_sym_expr(size)
    return expr.name if getattr(expr, "is_Symbol", False) else str(expr)
