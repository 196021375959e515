"""The exact operator overloads a stored program may call, and why each is safe.

A package is data: loading a portable one runs PyTorch's kernels on its
graphs, so a graph may call only kernels that check what they are given.
Many ATen kernels trust their arguments (`_sparse_coo_tensor_with_dims_and_
tensors` takes indices unchecked and `_to_dense` then writes past its
buffer; `_reshape_alias` and `as_strided` take strides against no storage
bound; `empty` hands back the allocator's old bytes), so the list is not
"aten minus a few" but exactly the overloads kvexport's exporter and passes
emit, each under the reason its kernel is safe. Nothing else passes.

The list was gathered from tiny packages of every family, contract, dtype
and quantization scheme, on both backends (`tests/test_op_allowlist.py`
regenerates and checks it: `python tests/test_op_allowlist.py` prints the
targets the exporter emits now). A new overload the exporter starts to emit
fails that test until it is added here with its reason.

Arguments are checked too (`argument_problem`): no listed overload takes
strides or a storage, so a view can only describe part of its own input;
the sizes that make memory (`arange`'s end, `expand`'s sizes, padding) must
be literal, as the exporter writes them, and are bounded by the package's
own tensor sizes; only strided CPU/CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (reason, overloads): one row per reason a kernel is safe on any arguments.
_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "elementwise or broadcasting math: the kernel checks that shapes broadcast and allocates its own output",
        ("__and__.Tensor", "add.Tensor", "bitwise_and.Scalar", "bitwise_not.default", "bitwise_right_shift.Tensor_Scalar",
         "clamp.default", "cos.default", "div.Tensor", "div.Tensor_mode", "gelu.default", "gt.Scalar", "gt.Tensor",
         "le.Scalar", "le.Tensor", "lt.Scalar", "lt.Tensor", "masked_fill.Scalar", "maximum.default", "minimum.default",
         "mul.Tensor", "neg.default", "pow.Tensor_Scalar", "reciprocal.default", "remainder.Scalar", "round.default",
         "rsqrt.default", "rsub.Scalar", "silu.default", "sin.default", "sub.Tensor", "tanh.default", "where.self",
         "dropout.default"),
    ),
    (
        "reductions, scans and normalisations over the input's own dims: the dim is checked against the rank",
        ("amax.default", "amin.default", "argmax.default", "cumsum.default", "layer_norm.default", "mean.dim",
         "softmax.int", "sort.stable", "sum.dim_IntList"),
    ),
    (
        "matrix products: the kernel checks that the inner sizes agree (matmul: transformers 5.17 computes "
        "the rotary angles with one, as `inv_freq @ positions`)",
        ("bmm.default", "linear.default", "matmul.default", "mm.default", "scaled_dot_product_attention.default"),
    ),
    (
        "copies and conversions: a fresh output of the input's own size (layout and device are checked below)",
        ("_to_copy.default", "clone.default", "ones_like.default", "zeros_like.default", "to.device", "to.dtype",
         "to.dtype_layout", "type_as.default"),
    ),
    (
        "joins: the output is the sum of the inputs, whose other sizes the kernel checks agree",
        ("cat.default", "stack.default"),
    ),
    (
        "views computed from the input's own sizes and strides: sizes must divide its elements (view, reshape, "
        "unflatten), slices clamp to its size, select and squeeze check the index and dim; none takes a stride",
        ("alias.default", "chunk.default", "expand.default", "permute.default", "reshape.default", "select.int",
         "slice.Tensor", "squeeze.dim", "t.default", "transpose.int", "unbind.int", "unflatten.int", "unsqueeze.default",
         "view.default"),
    ),
    (
        "indexing: the CPU and CUDA kernels check every index against the indexed dim before reading or writing",
        ("embedding.default", "gather.default", "index_copy_.default", "index_select.default"),
    ),
    (
        "allocations whose literal sizes are bounded by the package's tensor sizes (LITERAL_SIZE_ARGS)",
        ("arange.default", "constant_pad_nd.default"),
    ),
    (
        "shape queries: the dim is checked against the rank",
        ("sym_size.int",),
    ),
)

# prims the backends' product passes write into stored programs (the aoti
# backend's fused products over quantized weights pin their input's layout)
_PRIMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "a layout hint: the eager kernel clones its input and views the clone with the given literal stride "
        "through as_strided, which checks the view against the clone's storage (LITERAL_SIZE_ARGS)",
        ("inductor_force_stride_order.default",),
    ),
)

ALLOWED_OPS: dict[str, str] = {
    **{f"torch.ops.aten.{op}": reason for reason, ops in _GROUPS for op in ops},
    **{f"torch.ops.prims.{op}": reason for reason, ops in _PRIMS for op in ops},
}
assert len(ALLOWED_OPS) == sum(len(ops) for _, ops in _GROUPS + _PRIMS), "an overload is listed twice"

# The symbolic-integer helpers torch.export writes as plain targets: Python
# arithmetic on sizes, never on memory.
SYMBOLIC_TARGETS = frozenset(
    {f"_operator.{name}" for name in ("getitem", "add", "sub", "mul", "floordiv", "mod", "neg", "truediv", "pow",
                                      "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_")}
    | {f"torch.{name}" for name in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_ite")}
)

# Arguments that say how much memory an allowed overload makes; each literal
# int in them is bounded by ProgramLimits.max_literal_elements (one bound
# for a size list's product, for `arange`'s end, and for each pad width).
LITERAL_SIZE_ARGS: dict[str, tuple[str, ...]] = {
    "torch.ops.aten.arange.default": ("end",),
    "torch.ops.aten.constant_pad_nd.default": ("pad",),
    "torch.ops.aten.expand.default": ("size",),
    "torch.ops.prims.inductor_force_stride_order.default": ("stride",),
}
_STRIDED = 7  # torch._export.serde.schema.Layout.Strided; sparse and mkldnn layouts skip the dense invariants
_DEVICES = ("cpu", "cuda")  # a meta tensor has no storage to read an output from


@dataclass(frozen=True)
class ProgramLimits:
    """What one stored program may hold, derived from its package's manifest
    (`program_limits`) or, without one, the absolute caps."""

    max_nodes: int
    max_literal_elements: int


# A forward's nodes grow with its layers: about 100 a layer in fp32, about
# 420 with 8da4w's per-token quantization (the most measured, tiny-llama);
# 1024 a layer leaves room for new families. A 126-layer model then fits
# the absolute cap, which keeps a manifest that claims 1024 layers from
# buying a graph that takes minutes to rebuild.
NODES_PER_LAYER = 1024
NODES_BASE = 1024  # embedding, head, rotary, sampler
MAX_NODES = 1 << 17
# Without a manifest: the largest literal size any package may describe.
MAX_LITERAL_ELEMENTS = 1 << 32
DEFAULT_LIMITS = ProgramLimits(max_nodes=MAX_NODES, max_literal_elements=MAX_LITERAL_ELEMENTS)


def program_limits(manifest: Any) -> ProgramLimits:
    """The limits of a package's programs. Nodes: NODES_PER_LAYER per layer
    the manifest declares. Literal sizes: no larger than the largest tensor
    the contract itself hands a program or takes back, the widest step's
    logits [T, V] or its mask over the pool [T, C] (or the context)."""
    metadata = manifest.get("metadata") if isinstance(manifest, dict) else None
    metadata = metadata if isinstance(metadata, dict) else {}

    def number(*keys: str) -> int:
        values = [metadata.get(k) for k in keys]
        return max([v for v in values if type(v) is int and v > 0] or [1])

    layers = number("get_n_caches", "get_n_layers")
    step = number("get_max_seq_len")
    width = number("get_vocab_size", "get_offgraph_kv_max_cells", "get_max_context_len", "get_max_cache_len")
    return ProgramLimits(
        max_nodes=min(MAX_NODES, NODES_BASE + NODES_PER_LAYER * layers),
        max_literal_elements=min(MAX_LITERAL_ELEMENTS, step * width),
    )


def target_problem(target: Any) -> str | None:
    """None when the node target is on the allowlist, else why not."""
    if not isinstance(target, str):
        return f"target is not a string: {target!r:.80}"
    if target in ALLOWED_OPS or target in SYMBOLIC_TARGETS:
        return None
    return (f"operator {target!r:.120} is not on the allowlist of overloads kvexport emits "
            "(contract/op_allowlist.py); export the package again with this kvexport")


def argument_problem(target: str, name: Any, arg: Any, limits: ProgramLimits) -> str | None:
    """None when one serialized argument of an allowed node is within what
    the package format allows, else why not."""
    if not isinstance(arg, dict):
        return None  # the deserializer rejects a malformed argument itself
    if "as_layout" in arg and arg["as_layout"] != _STRIDED:
        return f"operator {target} argument {name!r:.40}: only strided tensors (layout {arg['as_layout']!r:.20})"
    device = arg.get("as_device")
    if device is not None and not (isinstance(device, dict) and device.get("type") in _DEVICES):
        return f"operator {target} argument {name!r:.40}: device {device!r:.60} is not one of {', '.join(_DEVICES)}"
    if name in LITERAL_SIZE_ARGS.get(target, ()):
        if _symbolic(arg):
            return (f"operator {target} argument {name!r:.40} is computed in the graph; the exporter writes it "
                    "as literal ints, which are checked against the package's sizes")
        elements = _literal_elements(arg)
        if elements > limits.max_literal_elements:
            return (f"operator {target} argument {name!r:.40} asks for {elements} elements; this package's "
                    f"tensors hold at most {limits.max_literal_elements} (max_seq_len x vocab, cells or context)")
    return None


def _symbolic(arg: dict) -> bool:
    """Whether a size-like argument holds a value computed in the graph
    (a SymInt: symbolic arithmetic can multiply it past any bound)."""
    return bool({"as_sym_int", "as_sym_float"} & arg.keys()) or any(
        not (isinstance(e, dict) and e.keys() == {"as_int"}) for e in _list(arg.get("as_sym_ints")))


def _literal_elements(arg: dict) -> int:
    """How many elements the literal ints of a size-like argument describe
    (a negative one counts by its magnitude: -1 means 'keep', a huge
    negative is no smaller)."""
    ints = [arg[key] for key in ("as_int", "as_float") if key in arg]
    for entry in _list(arg.get("as_ints")) + _list(arg.get("as_sym_ints")):
        ints.append(entry.get("as_int") if isinstance(entry, dict) else entry)
    elements = 1
    for value in ints:
        if not isinstance(value, (int, float)) or value != value:  # NaN is never a size
            return 1 << 62
        elements = min(elements * max(1, min(abs(value), 1 << 62)), 1 << 62)
    return int(elements)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []
