"""Quantized weights (torchao tensor subclasses) in a safetensors file.

Layout: a subclass tensor named N is stored as its inner plain tensors,
`N.__qdata`, `N.__scale`, `N.__zero_point`, ...; the manifest's
`weights.subclasses[N]` records the class, the inner names, the flatten
context as JSON (dtypes as {"dtype": name}, tuples as {"tuple": [...]}) and
the outer size and stride. Loading rebuilds it with the class's
`__tensor_unflatten__`; only classes on the allowlist below are ever
constructed, so a manifest cannot name code to run.
"""

from __future__ import annotations

from typing import Any

import torch

from kvexport.runtime.errors import PackageError

ALLOWED = {
    "torchao.quantization.Int8Tensor",
    "torchao.quantization.IntxUnpackedToInt8Tensor",
}
SEPARATOR = ".__"


def _class_name(tensor: torch.Tensor) -> str:
    return f"{type(tensor).__module__}.{type(tensor).__name__}"


def is_subclass(tensor: torch.Tensor) -> bool:
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__")


def _encode(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": {k: _encode(v) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} in a manifest")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        if "tuple" in value:
            return tuple(_decode(v) for v in value["tuple"])
        if "dict" in value:
            return {k: _decode(v) for k, v in value["dict"].items()}
    return value


def flatten(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The plain tensors to store for a subclass tensor, and its record."""
    cls = _class_name(tensor)
    if cls not in ALLOWED:
        raise TypeError(f"{name}: tensor subclass {cls} is not one kvexport can store")
    inner_names, ctx = tensor.__tensor_flatten__()
    inner = {f"{name}{SEPARATOR}{k}": getattr(tensor, k).detach().contiguous() for k in inner_names}
    record = {
        "class": cls,
        "inner": {k: f"{name}{SEPARATOR}{k}" for k in inner_names},
        "ctx": _encode(ctx),
        "size": list(tensor.shape),
        "stride": list(tensor.stride()),
    }
    return inner, record


def unflatten(name: str, record: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    cls_name = record.get("class")
    if cls_name not in ALLOWED:
        raise PackageError(f"weights.subclasses.{name}: class {cls_name!r} is not on kvexport's allowlist")
    import torchao.quantization as tq

    cls = getattr(tq, cls_name.rsplit(".", 1)[1])
    try:
        inner = {k: tensors[v] for k, v in record["inner"].items()}
    except KeyError as e:
        raise PackageError(f"weights.subclasses.{name}: inner tensor {e} is not in the weights file") from e
    return cls.__tensor_unflatten__(inner, _decode(record["ctx"]), tuple(record["size"]), tuple(record["stride"]))
