"""The offgraph_kv contract, v1 (docs/contracts/offgraph_kv-v1.md): its
methods, their inputs in the contract's order, its metadata and its check.

A forward takes `tokens [1, T], input_pos [T], logits_to_keep [K], k0, v0,
k1, v1, ... [C, n_kv_heads, head_dim], cells [T], one mask [T, C] per
distinct window` and returns `logits float32 [K, V]`. `ForwardInputs` is
that order's one home: the traced forward unpacks it, the runtime and
verification pack it, and `forward_io` declares it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvexport.contract.manifest import (
    LOGITS_MODE_SELECTED,
    MAX_CELLS,
    MAX_CONTEXT,
    MAX_FORWARD_SIZES,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_STEP_TOKENS,
    MAX_VOCAB,
    OFFGRAPH_KV,
    OFFGRAPH_KV_VERSION,
    STATIC_FORWARD,
    TORCH_DTYPE_NAMES,
    DTYPES,
    CacheGeometry,
    bounded,
    bounded_list,
    check_backend,
    check_bindings,
    check_contract,
    check_method,
    check_types,
    dyn,
    is_int,
    register_contract,
    tensor_spec,
)

from kvexport.contract.sections import check_sections


@dataclass
class ForwardInputs:
    """A forward call's inputs; `pack` gives them in the contract's order."""

    tokens: Any  # [1, T] int64
    input_pos: Any  # [T] int64
    logits_to_keep: Any  # [K] int64: the rows whose logits come back
    pools: Sequence[Any]  # k0, v0, k1, v1, ... each [C, n_kv_heads, head_dim]
    cells: Any  # [T] int64: the cell each token's K/V is written to
    masks: Sequence[Any]  # bool [T, C], one per distinct window, ascending

    def pack(self) -> tuple:
        return (self.tokens, self.input_pos, self.logits_to_keep, *self.pools, self.cells, *self.masks)

    @classmethod
    def unpack(cls, args: Sequence[Any], geometry: CacheGeometry) -> "ForwardInputs":
        n_pools = 2 * geometry.n_layers
        pools = tuple(args[3 : 3 + n_pools])
        return cls(args[0], args[1], args[2], pools, args[3 + n_pools], tuple(args[4 + n_pools :]))


def build_metadata(
    geometry: CacheGeometry,
    vocab_size: int,
    max_context_len: int,
    max_step_tokens: int,
    max_cells: int,
    min_prefill_chunk: int,
    forward_sizes: list[int],
    bos_id: int | None,
    eos_ids: list[int],
    dtype: str,
    architecture: str,
) -> dict[str, Any]:
    """The contract's metadata; `check_offgraph_metadata` is its check."""
    return {
        "get_max_context_len": max_context_len,
        "get_max_seq_len": max_step_tokens,
        "get_vocab_size": vocab_size,
        "get_logits_to_keep_mode": LOGITS_MODE_SELECTED,
        "get_n_caches": geometry.n_layers,
        "get_kv_heads": list(geometry.kv_heads),
        "get_head_dims": list(geometry.head_dims),
        "get_windows": list(geometry.windows),
        "get_offgraph_kv_max_cells": max_cells,
        "get_min_prefill_chunk": min_prefill_chunk,
        "bos_id": bos_id,
        "eos_ids": eos_ids,
        "dtype": dtype,
        "forward_sizes": forward_sizes,
        "architecture": architecture,
    }


def forward_io(
    geometry: CacheGeometry,
    cache_dtype: str,
    vocab_size: int,
    max_cells: int,
    tokens_dim: int | dict,
    rows_dim: int | dict,
) -> tuple[list[dict], list[dict]]:
    """Inputs and outputs of one forward method, in the contract's order."""
    cells = dyn("C", 1, max_cells)
    inputs = [
        tensor_spec("tokens", "int64", [1, tokens_dim], "tokens"),
        tensor_spec("input_pos", "int64", [tokens_dim], "input_pos"),
        tensor_spec("logits_to_keep", "int64", [rows_dim], "logits_to_keep"),
    ]
    for layer, (heads, dim) in enumerate(zip(geometry.kv_heads, geometry.head_dims)):
        for kind in ("k", "v"):
            inputs.append(
                tensor_spec(f"kv.{layer}.{kind}", cache_dtype, [cells, heads, dim], f"kv_{kind}", layer=layer)
            )
    inputs.append(tensor_spec("kv.cells", "int64", [tokens_dim], "kv_cells"))
    for window in geometry.distinct_windows:
        inputs.append(tensor_spec(f"kv.mask.w{window}", "bool", [tokens_dim, cells], "kv_mask", window=window))
    outputs = [tensor_spec("logits", "float32", [rows_dim, vocab_size], "logits")]
    return inputs, outputs


def sampler_io(vocab_size: int, with_params: bool) -> tuple[list[dict], list[dict]]:
    rows = dyn("R", 1, 1 << 16)
    inputs = [tensor_spec("logits", "float32", [rows, vocab_size], "logits")]
    if with_params:
        inputs.append(tensor_spec("params", "float32", [rows, 4], "sampling_params"))
    return inputs, [tensor_spec("tokens", "int64", [rows], "tokens")]


_OFFGRAPH_METADATA_TYPES: dict[str, tuple[str, Any]] = {
    "get_max_context_len": bounded(MAX_CONTEXT),
    "get_max_seq_len": bounded(MAX_STEP_TOKENS),
    "get_vocab_size": bounded(MAX_VOCAB),
    "get_logits_to_keep_mode": ("int", is_int),
    "get_n_caches": bounded(MAX_LAYERS),
    "get_kv_heads": bounded_list(MAX_HEADS),
    "get_head_dims": bounded_list(MAX_HEAD_DIM),
    "get_windows": bounded_list(MAX_CONTEXT, lo=0),
    "get_offgraph_kv_max_cells": bounded(MAX_CELLS),
    "bos_id": ("int or null", lambda v: v is None or is_int(v)),
    "eos_ids": bounded_list(MAX_VOCAB, lo=0),
    "dtype": (f"one of {', '.join(DTYPES)}", lambda v: v in DTYPES),
    "forward_sizes": bounded_list(MAX_STEP_TOKENS, max_len=MAX_FORWARD_SIZES),
}


# a cell of Llama 3.1 405B holds 258,048 values (126 layers, 8 heads of 128);
# 64 x that bounds the pool a package can ask for per cell
MAX_CELL_VALUES = 1 << 24


def check_offgraph_metadata(metadata: dict) -> list[str]:
    problems = check_types(metadata, _OFFGRAPH_METADATA_TYPES)
    chunk = metadata.get("get_min_prefill_chunk", 1)  # optional, default 1
    if not (is_int(chunk) and chunk > 0):
        problems.append(f"metadata.get_min_prefill_chunk: expected positive int, found {chunk!r}")
    if problems:
        return problems
    n = metadata["get_n_caches"]
    for key in ("get_kv_heads", "get_head_dims", "get_windows"):
        if len(metadata[key]) != n:
            problems.append(f"metadata.{key}: has {len(metadata[key])} entries, get_n_caches is {n}")
    geometry = CacheGeometry(tuple(metadata["get_kv_heads"]), tuple(metadata["get_head_dims"]), tuple(metadata["get_windows"]))
    if not problems and (values := geometry.cell_values) > MAX_CELL_VALUES:
        problems.append(
            f"metadata: a cell of {values} values (2 x kv heads x head dim over {n} layers) is more than the "
            f"{MAX_CELL_VALUES} a model needs"
        )
    if metadata["get_logits_to_keep_mode"] != LOGITS_MODE_SELECTED:
        problems.append(
            f"metadata.get_logits_to_keep_mode: this contract selects rows (mode {LOGITS_MODE_SELECTED}), "
            f"found {metadata['get_logits_to_keep_mode']}"
        )
    sizes = metadata["forward_sizes"]
    if len(set(sizes)) != len(sizes):
        problems.append(f"metadata.forward_sizes: duplicates in {sizes}")
    max_seq = metadata["get_max_seq_len"]
    if metadata["get_offgraph_kv_max_cells"] <= max_seq:
        problems.append(
            f"metadata.get_offgraph_kv_max_cells: {metadata['get_offgraph_kv_max_cells']} must be above the widest "
            f"step get_max_seq_len={max_seq}"
        )
    if chunk > max_seq:
        problems.append(f"metadata.get_min_prefill_chunk: {chunk} exceeds get_max_seq_len={max_seq}")
    return problems


def _dim_ok(dim: Any) -> bool:
    if is_int(dim):
        return dim >= 0
    return (
        isinstance(dim, dict)
        and isinstance(dim.get("name"), str)
        and is_int(dim.get("min"))
        and is_int(dim.get("max"))
        and 0 <= dim["min"] <= dim["max"]
    )


def check_offgraph_methods(manifest: dict) -> list[str]:
    """Method set and every method's I/O against the contract; assumes the
    metadata already passed check_offgraph_metadata."""
    metadata, methods = manifest["metadata"], manifest["methods"]
    problems: list[str] = []
    static = {}
    for name in methods:
        match = STATIC_FORWARD.fullmatch(name)
        if match:
            static[int(match.group(1))] = name
        elif name.startswith("forward_") and name != "forward_others":
            problems.append(f"methods.{name}: not a contract method name (forward_<N> with N > 0, or forward_others)")
        elif name not in ("forward_others", "sample", "sample_argmax"):
            problems.append(f"methods.{name}: unknown method")
    if not static:
        problems.append("methods: the contract needs at least one forward_<N>")
    if "sample_argmax" in methods and "sample" not in methods:
        problems.append("methods.sample_argmax: only allowed together with sample")
    if sorted(static) != sorted(metadata["forward_sizes"]):
        problems.append(f"metadata.forward_sizes: {metadata['forward_sizes']} does not match the methods {sorted(static)}")

    geometry = CacheGeometry(
        tuple(metadata["get_kv_heads"]), tuple(metadata["get_head_dims"]), tuple(metadata["get_windows"])
    )
    cache_dtype = TORCH_DTYPE_NAMES[metadata["dtype"]]
    vocab, max_cells = metadata["get_vocab_size"], metadata["get_offgraph_kv_max_cells"]
    widest = max(static) if static else 0
    for n, name in static.items():
        expected = forward_io(geometry, cache_dtype, vocab, max_cells, n, n)
        problems += check_method(name, methods[name], "forward", expected)
    if "forward_others" in methods:
        entry = methods["forward_others"]
        try:
            t_dim = entry["inputs"][0]["shape"][1]
            k_dim = entry["inputs"][2]["shape"][0]
        except (KeyError, IndexError, TypeError):
            problems.append("methods.forward_others: inputs do not follow the contract (tokens, input_pos, logits_to_keep, ...)")
        else:
            if not (_dim_ok(t_dim) and isinstance(t_dim, dict)):
                problems.append("methods.forward_others: the token count T must be a dynamic dim")
            else:
                if t_dim["max"] <= widest:
                    problems.append(f"methods.forward_others: T up to {t_dim['max']} is not wider than forward_{widest}")
                if t_dim["min"] > widest + 1:
                    problems.append(
                        f"methods.forward_others: T from {t_dim['min']} leaves widths {widest + 1}..{t_dim['min'] - 1} "
                        f"that no method takes"
                    )
                if t_dim["max"] != metadata["get_max_seq_len"]:
                    problems.append(
                        f"metadata.get_max_seq_len: {metadata['get_max_seq_len']} but forward_others takes up to {t_dim['max']}"
                    )
                expected_k = dyn("K", metadata.get("get_min_prefill_chunk", 1), t_dim["max"])
                expected = forward_io(geometry, cache_dtype, vocab, max_cells, t_dim, expected_k)
                problems += check_method("forward_others", entry, "forward", expected)
    elif static and metadata["get_max_seq_len"] != widest:
        problems.append(f"metadata.get_max_seq_len: {metadata['get_max_seq_len']} but the widest method takes {widest}")
    if "sample" in methods:
        problems += check_method("sample", methods["sample"], "sampler", sampler_io(vocab, True))
    if "sample_argmax" in methods:
        problems += check_method("sample_argmax", methods["sample_argmax"], "sampler", sampler_io(vocab, False))
    return problems


def check_offgraph_manifest(manifest: Any) -> list[str]:
    problems = check_contract(manifest, OFFGRAPH_KV)
    if problems:
        return problems
    problems = check_offgraph_metadata(manifest["metadata"])
    if problems:
        return problems
    return check_offgraph_methods(manifest) + check_backend(manifest) + check_bindings(manifest) + check_sections(manifest)


register_contract(OFFGRAPH_KV, OFFGRAPH_KV_VERSION, check_offgraph_manifest)
