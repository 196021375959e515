"""GGUF block-quantized tensors as unsigned integer codes with a float scale
and a float offset per group: `w = scale * q + offset`.

Dequantizing in float32 (`scale[..., None] * q.float() + offset[..., None]`)
gives the very values `gguf.quants.dequantize` gives. Why that holds bit for
bit: every product `scale * q` is exact in float32 (an fp16 significand
below 2**11, times a sub-block scale of at most 2**7, times a code below 2**6
- or below 2**8 for Q8_0, which has no sub-block scale - stays below 2**24),
so fma and mul-then-add agree, and
- Q4_1, Q5_1, Q4_K, Q5_K: gguf computes `d * q + m` (K: `(d*sc) * q - dmin*m`)
  with the same exact product and the same one rounding add, so every bit
  matches, signed zeros included;
- Q4_0, Q5_0, Q8_0, Q6_K: gguf computes `d * (q - z)` in one exact product;
  `d * q + (-z * d)` has the same exact value, so no rounding happens either.
  The one difference is the sign of a zero: where `q == z`, gguf gives
  `d * 0`, which is -0.0 for a negative `d`, and this form gives `x + -x`,
  always +0.0. They are equal as numbers (`torch.equal`, `np.array_equal`).

Groups run along K (the input features), so selecting or permuting rows of
the codes, scales and offsets is the same as doing it to the weight; that is
how `read_gguf_codes` replays the q/k row order transformers applies to Llama.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvexport.contract.errors import ModelError

FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class GroupCodes:
    """One weight [N, K] as codes with a scale and an offset per group of
    `group` consecutive values along K."""

    codes: torch.Tensor  # uint8 [N, K], each < 2**bits
    scale: torch.Tensor  # float32 [N, K // group]
    offset: torch.Tensor  # float32 [N, K // group]
    group: int
    bits: int
    source_type: str

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]: scale * q + offset per group."""
        n, k = self.codes.shape
        q = self.codes.view(n, k // self.group, self.group).float()  # [N, K/group, group]
        return (self.scale[..., None] * q + self.offset[..., None]).reshape(n, k)

    def rows(self, index: torch.Tensor) -> GroupCodes:
        """The same codes with rows (dim 0) selected or permuted by `index`
        (1-D, integer)."""
        # index_select: several times faster than `codes[index]` on uint8
        return replace(
            self,
            codes=self.codes.index_select(0, index),
            scale=self.scale.index_select(0, index),
            offset=self.offset.index_select(0, index),
        )


# --- unpacking: blocks [n_blocks, type_size] uint8 -> codes, scale, offset ---

Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes [n, block], scale and offset [n, block // group]


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., m] bytes -> [..., 2m]: the m low nibbles, then the m high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bit_planes(packed: np.ndarray, planes: int, width: int) -> np.ndarray:
    """[..., m] bytes -> [..., planes, m]: field `width` bits wide at bit `i * width` of each byte, for plane i."""
    shifts = (np.arange(planes, dtype=np.uint8) * width)[:, None]
    return (packed[..., None, :] >> shifts) & ((1 << width) - 1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of a Q4_K/Q5_K super-block,
    from its 12 bytes: bytes 0-3 and 4-7 hold scales and mins 0-3 in their
    low 6 bits and the top 2 bits of scales and mins 4-7 in their high 2;
    bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7."""
    scales, mins, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([scales & 63, (low & 0x0F) | ((scales >> 6) << 4)], axis=-1)
    m = np.concatenate([mins & 63, (low >> 4) | ((mins >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _q4_0(blocks: np.ndarray) -> Unpacked:
    d = _fp16(blocks, 0)
    return _nibbles(blocks[:, 2:18]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> Unpacked:
    return _nibbles(blocks[:, 4:20]), _fp16(blocks, 0), _fp16(blocks, 2)


def _q5_0(blocks: np.ndarray) -> Unpacked:
    d = _fp16(blocks, 0)
    high = np.unpackbits(blocks[:, 2:6], axis=-1, bitorder="little")  # bit j of the uint32 is code j's fifth bit
    return _nibbles(blocks[:, 6:22]) | (high << 4), d, -16 * d


def _q5_1(blocks: np.ndarray) -> Unpacked:
    high = np.unpackbits(blocks[:, 4:8], axis=-1, bitorder="little")
    return _nibbles(blocks[:, 8:24]) | (high << 4), _fp16(blocks, 0), _fp16(blocks, 2)


def _q8_0(blocks: np.ndarray) -> Unpacked:
    d = _fp16(blocks, 0)
    return blocks[:, 2:34] ^ 0x80, d, -128 * d  # int8 q -> q + 128


def _q4_k(blocks: np.ndarray) -> Unpacked:
    n = len(blocks)
    sc, m = _k_scales(blocks[:, 4:16])
    # 4 chunks of 32 bytes: sub-block 2c in the low nibbles of chunk c, 2c + 1 in the high ones
    codes = _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 256)
    return codes, _fp16(blocks, 0) * sc, -(_fp16(blocks, 2) * m)


def _q5_k(blocks: np.ndarray) -> Unpacked:
    n = len(blocks)
    sc, m = _k_scales(blocks[:, 4:16])
    high = _bit_planes(blocks[:, 16:48], 8, 1).reshape(n, 256)  # sub-block s takes bit s of the 32 bytes
    low = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 256)
    return low | (high << 4), _fp16(blocks, 0) * sc, -(_fp16(blocks, 2) * m)


def _q6_k(blocks: np.ndarray) -> Unpacked:
    n = len(blocks)
    # two halves of 128 values: 64 bytes of low nibbles and 32 bytes of 2-bit pairs each
    low = _nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 256)
    high = _bit_planes(blocks[:, 128:192].reshape(n, 2, 32), 4, 2).reshape(n, 256)
    scale = _fp16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    return low | (high << 4), scale, -32 * scale


@dataclass(frozen=True)
class _Layout:
    bits: int
    group: int
    unpack: Callable[[np.ndarray], Unpacked]


_LAYOUTS = {
    "Q4_0": _Layout(4, 32, _q4_0),
    "Q4_1": _Layout(4, 32, _q4_1),
    "Q5_0": _Layout(5, 32, _q5_0),
    "Q5_1": _Layout(5, 32, _q5_1),
    "Q8_0": _Layout(8, 32, _q8_0),
    "Q4_K": _Layout(4, 32, _q4_k),
    "Q5_K": _Layout(5, 32, _q5_k),
    "Q6_K": _Layout(6, 16, _q6_k),
}
SUPPORTED: tuple[str, ...] = tuple(_LAYOUTS)


def _gguf() -> Any:
    try:
        return importlib.import_module("gguf")
    except ImportError:
        raise ModelError("reading GGUF blocks needs the gguf package: pip install gguf") from None


def _type_name(qtype: Any, name: str | None = None) -> str:
    """The GGML type name of a `GGMLQuantizationType` or its int value."""
    try:
        return _gguf().GGMLQuantizationType(int(qtype)).name
    except ValueError:
        where = f"{name}: " if name else ""
        raise ModelError(f"{where}unknown GGML type id {qtype!r}; is the gguf package older than the file?") from None


def is_float_type(qtype: Any) -> bool:
    """Whether tensors of this GGML type are plain floats (kept as they are)."""
    return _type_name(qtype) in FLOAT_TYPES


def group_codes(name: str, qtype: Any, data: np.ndarray, shape: tuple[int, int]) -> GroupCodes:
    """Codes, scales and offsets of the tensor `name`, logical shape (N, K),
    from its raw GGUF blocks (`GGUFReader(...).tensors[i].data`)."""
    type_name = _type_name(qtype, name)
    layout = _LAYOUTS.get(type_name)
    if layout is None:
        kind = "a float type, not block-quantized: keep it as float" if type_name in FLOAT_TYPES else "not supported"
        raise ModelError(
            f"{name}: GGUF type {type_name} is {kind}; supported quantized types: {', '.join(SUPPORTED)} "
            f"(float types {', '.join(FLOAT_TYPES)} stay float). Re-quantize the file to one of these."
        )
    n, k = shape
    gguf = _gguf()
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = np.asarray(data).view(np.uint8)
    if k % block or raw.size != n * (k // block) * type_size:
        raise ModelError(f"{name}: {raw.size} bytes of {type_name} blocks cannot hold a {n}x{k} tensor")
    codes, scale, offset = layout.unpack(raw.reshape(-1, type_size))
    return GroupCodes(
        codes=torch.from_numpy(codes.reshape(n, k)),
        scale=torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, -1)),
        offset=torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(n, -1)),
        group=layout.group,
        bits=layout.bits,
        source_type=type_name,
    )


# --- a whole file, under the names and in the row order transformers gives ---
# This mirrors transformers' legacy GGUF loader (modeling_gguf_pytorch_utils,
# transformers 5.x): dequantize with gguf.quants, then a per-architecture
# TensorProcessor (Llama: un-permute the rotary rows of q_proj and k_proj).


def read_gguf_codes(gguf_path: str | Path, hf_config: Any) -> tuple[dict[str, GroupCodes], dict[str, str]]:
    """(codes of every quantized tensor, GGML type name of every tensor), both
    keyed by the Hugging Face parameter name transformers loads it under.

    `hf_config` is the config transformers builds from this file. Each
    tensor's codes are in the row order transformers' loader leaves the
    weight in: its processor is run on a probe of row numbers, and anything
    other than a row permutation of a quantized tensor is refused."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = _gguf().GGUFReader(str(gguf_path))
    arch = str(reader.fields["general.architecture"].contents())
    if arch in _packed_loader_archs():
        raise ModelError(
            f"{gguf_path}: transformers loads GGUF architecture {arch!r} through its packed GGUF path "
            f"(transformers.integrations.gguf), whose transforms read_gguf_codes does not replay; "
            f"it replays the legacy loader only (llama, mistral and the like)"
        )
    processor_cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    processor = processor_cls(config=_file_config(reader, arch))
    with _one_name_map():
        hf_names = get_gguf_hf_weights_map(_meta_model(hf_config), processor)

    codes: dict[str, GroupCodes] = {}
    types: dict[str, str] = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists K first
        quantized = not is_float_type(tensor.tensor_type)
        name, probe, processed = _process_probe(processor, tensor.name, shape, hf_names)
        if name is None and quantized:
            raise ModelError(f"{tensor.name}: transformers' {processor_cls.__name__} stores it by a path of its own")
        hf_name = hf_names.get(name)
        if hf_name is None:
            continue  # transformers does not load it either
        types[hf_name] = tensor.tensor_type.name
        if not quantized:
            continue
        if len(shape) != 2:
            raise ModelError(f"{tensor.name}: quantized with shape {list(shape)}; only 2-D weights are supported")
        grouped = group_codes(hf_name, tensor.tensor_type, tensor.data, shape)
        if processed is not probe:
            order = _row_order(probe, processed)
            if order is None:
                raise ModelError(
                    f"{tensor.name} ({hf_name}): transformers' {processor_cls.__name__} for GGUF architecture "
                    f"{arch!r} changes it beyond a row permutation, so its {grouped.source_type} codes cannot be kept"
                )
            grouped = grouped.rows(order)
        codes[hf_name] = grouped
    return codes, types


def _packed_loader_archs() -> frozenset[str]:
    """Architectures transformers loads through its packed GGUF path instead."""
    try:
        from transformers.integrations.gguf import GGUF_ARCHS
    except ImportError:  # older 5.x: every architecture takes the legacy path
        return frozenset()
    return frozenset(GGUF_ARCHS)


def _file_config(reader: Any, arch: str) -> dict[str, Any]:
    """The scalar hyperparameters transformers' loader hands its processor:
    the file's own `<arch>.*` fields under their config names. Not the HF
    config's: a value the file lacks must stay absent (Llama's processor
    skips its permutation without head counts)."""
    from transformers.integrations import GGUF_CONFIG_MAPPING

    config_names = GGUF_CONFIG_MAPPING.get(arch, {})
    config = {}
    for key, field in reader.fields.items():
        prefix, _, rest = key.partition(".")
        config_name = config_names.get(rest)
        if prefix == arch and config_name not in (None, -1) and len(field.data) == 1:
            config[config_name] = field.contents()
    return config


def _meta_model(hf_config: Any) -> torch.nn.Module:
    """The model transformers would load into, without memory: only its names are needed."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


@contextmanager
def _one_name_map() -> Iterator[None]:
    """`get_gguf_hf_weights_map` rebuilds gguf's tensor name map for each of
    the model's ~400 modules (~7 s on SmolLM2); the map depends only on its
    arguments, so build it once while the function runs."""
    gguf = _gguf()
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _process_probe(
    processor: Any, gguf_name: str, shape: tuple[int, ...], hf_names: Mapping[str, str]
) -> tuple[str | None, np.ndarray, Any]:
    """Runs transformers' processor on a probe of the tensor's shape whose rows
    hold their 1-based row number: (the GGUF name it returns, probe, processed probe)."""
    rows = np.arange(1, shape[0] + 1, dtype=np.int32).reshape(-1, *[1] * (len(shape) - 1))
    probe = np.broadcast_to(rows, shape)  # a view: no memory even for the embedding
    try:
        with np.errstate(all="ignore"):
            result = processor.process(
                weights=probe, name=gguf_name, tensor_key_mapping=hf_names, parsed_parameters={"tensors": {}}
            )
    except Exception as e:  # it needs real weights: whatever it does is no row permutation
        raise ModelError(f"{gguf_name}: transformers' {type(processor).__name__} cannot be replayed ({e})") from e
    return result.name, probe, result.weights


def _row_order(probe: np.ndarray, processed: Any) -> torch.Tensor | None:
    """The row order (int64 [N]) a processor left the probe's rows in, or
    None when it did anything other than reorder whole rows."""
    out = np.asarray(processed)
    if out.shape != probe.shape or out.dtype != probe.dtype or not (out == out[:, :1]).all():
        return None
    order = out[:, 0].astype(np.int64) - 1
    if not np.array_equal(np.sort(order), np.arange(len(order))):
        return None
    return torch.from_numpy(order)
