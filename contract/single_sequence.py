"""The single-sequence contracts, v1: ingraph_kv (docs/contracts/ingraph_kv-v1.md,
the cache inside the program) and hf_static (docs/contracts/hf_static-v1.md,
the cache as inputs in HF's static layout): their one method, its inputs,
their metadata and their check."""

from __future__ import annotations

from typing import Any

from kvexport.contract.manifest import (
    DTYPES,
    HF_STATIC,
    HF_STATIC_VERSION,
    INGRAPH_KV,
    INGRAPH_KV_VERSION,
    MAX_CONTEXT,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_STEP_TOKENS,
    MAX_VOCAB,
    TORCH_DTYPE_NAMES,
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


def build_metadata(
    name: str,
    geometry: CacheGeometry,
    vocab_size: int,
    context: int,
    max_step_tokens: int,
    bos_id: int | None,
    eos_ids: list[int],
    dtype: str,
    architecture: str,
) -> dict[str, Any]:
    """ingraph_kv's or hf_static's metadata; `check_single_sequence_manifest` checks it."""
    common = {
        "get_max_seq_len": max_step_tokens,
        "get_vocab_size": vocab_size,
        "get_n_layers": geometry.n_layers,
        "get_bos_id": bos_id,
        "get_eos_ids": eos_ids,
        "dtype": dtype,
        "architecture": architecture,
    }
    if name == INGRAPH_KV:
        return {**common, "get_max_context_len": context, "use_kv_cache": True, "enable_dynamic_shape": True}
    return {
        **common,
        "get_max_cache_len": context,
        "get_kv_heads": list(geometry.kv_heads),
        "get_head_dims": list(geometry.head_dims),
        "get_windows": list(geometry.windows),
    }


def single_sequence_io(
    vocab_size: int, max_step: int, geometry: CacheGeometry | None = None, cache_dtype: str = "", cache_len: int = 0
) -> tuple[list[dict], list[dict]]:
    """ingraph_kv's forward (geometry None: the cache is inside the program)
    or hf_static's (the cache as inputs, HF's static layout)."""
    t = dyn("T", 1, max_step)
    inputs = [tensor_spec("tokens", "int64", [1, t], "tokens"), tensor_spec("input_pos", "int64", [t], "input_pos")]
    if geometry is not None:
        for layer, (heads, dim) in enumerate(zip(geometry.kv_heads, geometry.head_dims)):
            for kind in ("k", "v"):
                inputs.append(tensor_spec(f"kv.{layer}.{kind}", cache_dtype, [1, heads, cache_len, dim], f"kv_{kind}", layer=layer))
    return inputs, [tensor_spec("logits", "float32", [1, vocab_size], "logits")]


_SINGLE_COMMON: dict[str, tuple[str, Any]] = {
    "get_max_seq_len": bounded(MAX_STEP_TOKENS),
    "get_vocab_size": bounded(MAX_VOCAB),
    "get_n_layers": bounded(MAX_LAYERS),
    "get_bos_id": ("int or null", lambda v: v is None or is_int(v)),
    "get_eos_ids": bounded_list(MAX_VOCAB, lo=0),
    "dtype": (f"one of {', '.join(DTYPES)}", lambda v: v in DTYPES),
}


_INGRAPH_METADATA = {
    **_SINGLE_COMMON,
    "get_max_context_len": bounded(MAX_CONTEXT),
    "use_kv_cache": ("true", lambda v: v is True),
    "enable_dynamic_shape": ("true", lambda v: v is True),
}


_HF_STATIC_METADATA = {
    **_SINGLE_COMMON,
    "get_max_cache_len": bounded(MAX_CONTEXT),
    "get_kv_heads": bounded_list(MAX_HEADS),
    "get_head_dims": bounded_list(MAX_HEAD_DIM),
    "get_windows": bounded_list(MAX_CONTEXT, lo=0),
}


def check_single_sequence_manifest(manifest: Any, name: str) -> list[str]:
    """ingraph_kv v1 or hf_static v1."""
    problems = check_contract(manifest, name)
    if problems:
        return problems
    md = manifest["metadata"]
    problems = check_types(md, _INGRAPH_METADATA if name == INGRAPH_KV else _HF_STATIC_METADATA)
    if problems:
        return problems
    context_key = "get_max_context_len" if name == INGRAPH_KV else "get_max_cache_len"
    if md["get_max_seq_len"] > md[context_key]:
        problems.append(f"metadata.get_max_seq_len: {md['get_max_seq_len']} exceeds {context_key}={md[context_key]}")
    geometry = None
    if name == HF_STATIC:
        for key in ("get_kv_heads", "get_head_dims", "get_windows"):
            if len(md[key]) != md["get_n_layers"]:
                problems.append(f"metadata.{key}: has {len(md[key])} entries, get_n_layers is {md['get_n_layers']}")
        if problems:
            return problems
        geometry = CacheGeometry(tuple(md["get_kv_heads"]), tuple(md["get_head_dims"]), tuple(md["get_windows"]))
    if set(manifest["methods"]) != {"forward"}:
        problems.append(f"methods: {name} has exactly one method, forward; found {sorted(manifest['methods'])}")
        return problems
    expected = single_sequence_io(md["get_vocab_size"], md["get_max_seq_len"], geometry, TORCH_DTYPE_NAMES[md["dtype"]], md.get("get_max_cache_len", 0))
    return (
        problems
        + check_method("forward", manifest["methods"]["forward"], "forward", expected)
        + check_backend(manifest)
        + check_bindings(manifest)
        + check_sections(manifest)
    )


register_contract(INGRAPH_KV, INGRAPH_KV_VERSION, lambda manifest: check_single_sequence_manifest(manifest, INGRAPH_KV))
register_contract(HF_STATIC, HF_STATIC_VERSION, lambda manifest: check_single_sequence_manifest(manifest, HF_STATIC))
