"""Weight quantization before tracing, with a coverage report: every linear
and embedding, with the scheme applied (and the source's own type) or the
reason it was skipped.

Schemes:
- `--qlinear 8w`: 8-bit codes per row (or per group with a group size);
- `--qlinear 4w`: 4-bit codes per group of 32, two a byte;
- `--qlinear gguf`: a GGUF source's own quantization kept exactly (Q4_0 ...
  Q6_K; exporter/gguf_codes.py), embeddings and head included;
- `--qlinear 8da4w`: torchao's int8 dynamic activations, int4 weights;
- `--qembedding 8w`: 8-bit codes per row; a tied LM head shares them.

Every scheme but 8da4w stores packed row-lane words with a float scale and
offset per group, `w = scale * code + offset` (passes/packed_weights.py),
read through PackedLinear / PackedEmbedding. With `--qact int8` a linear's
activations are rounded too, per row in blocks of 32 to int8 codes and a
step (passes/packed_weights.py, int8_rows), and its codes are stored in
blocks along K, in panels of 8 rows (Int8Linear): the arithmetic of integer
dot products, which the eager reference, the portable backend and the aoti
kernel all compute. `--qact int8x2` adds each block's rounding error,
rounded the same way (int8x2_rows): two int8 terms, about 15 bits;
`--qact int16` rounds each block to int16 codes instead (int16_rows, a step
of its largest magnitude / 32767); `--qact int8-peak` adds int8x2's second
term on each row's peak blocks alone, those holding its largest magnitude
(int8_peak_rows). A tied LM head that shares a quantized
embedding's codes takes them too: the embedding stores them in that format, and its
lookups read them there. A linear whose rows are not a multiple of 8 or
whose groups are not whole blocks, or a head tied to such an embedding,
keeps float activations; the coverage report says which. The scale and offset of a group
come from its minimum and maximum (the offset is a float, like GGUF's Q4_1,
so both ends of every group are exact) or from HQQ's search
(`--qlinear-algorithm hqq`), stored in fp32 (fp16 under int8 activations
where fp16 holds them: narrow_tables). `--qlinear-keep-8w` keeps linears at 8
bits by name pattern, or the most sensitive ones (`sensitive:FRACTION`:
each linear's relative output error on a calibration text, 4-bit against
its float weight).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvexport.contract import schemes
from kvexport.contract.errors import SpecError
from kvexport.exporter.memory import release_freed_memory
from kvexport.exporter.quantization.gguf_codes import GroupCodes, read_gguf_codes
from kvexport.passes.packed_weights import (
    BLOCK, PANEL_ROWS, dequantize_block_rows, dequantize_blocks, dequantize_packed, dequantize_rows, rounded_rows,
    narrow_tables, pack, pack_blocks, pack_table, pad_rows,
)

KEPT_8W = schemes.scheme("8w")  # what --qlinear-keep-8w keeps a linear at
FOUR_BIT = schemes.scheme("4w")  # what the sensitivity of a linear is measured at
CALIBRATION_TEXT = (
    "The river rose through the night, and by morning the low fields were under water. Farmers moved their "
    "animals to the hills while engineers checked the old stone bridge. In the town, the bakery stayed open, "
    "the school became a shelter, and volunteers carried sandbags along the main street. A week later the "
    "water fell, leaving mud, broken fences and a long list of repairs, but no one had been lost."
)


class PackedLinear(nn.Module):
    """A linear over packed codes: F.linear(x, dequantize_packed(...)); the
    backend's passes pick the kernel."""

    def __init__(self, words: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                 out_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("words", words)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.bits, self.out_features, self.in_features = bits, out_features, words.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize_packed(self.words, self.scale, self.offset, self.bits, self.out_features, x.dtype)
        return F.linear(x, weight, self.bias)


class Int8Linear(nn.Module):
    """A linear with int8 activations over codes in blocks:
    F.linear(int8_rows(x), dequantize_blocks(...)), the arithmetic of an
    integer dot product per block of 32 (`qact` int8x2: int8x2_rows(x), two
    such products; int16: int16_rows(x), products of int16 codes; int8-peak:
    int8_peak_rows(x), two on each row's peak blocks); the
    backend's passes pick the kernel."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None, qact: str = "int8"):
        super().__init__()
        self.qact = qact
        self.register_buffer("data", data)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.bits, self.out_features, self.in_features = bits, data.shape[0] * PANEL_ROWS, data.shape[1] // bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize_blocks(self.data, self.scale, self.offset, self.bits, x.dtype)
        return F.linear(rounded_rows(x, self.qact), weight, self.bias)


class PackedEmbedding(nn.Module):
    """An embedding over packed codes: only the looked-up rows are unpacked.
    Codes in row lanes, or (`blocks`) in the blocks format, where a tied LM
    head multiplies them with int8 activations. Keeps a scaled embedding's
    `embed_scale` (Gemma's)."""

    def __init__(self, words: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                 num_embeddings: int, dtype: torch.dtype, embed_scale: Any = None, blocks: bool = False):
        super().__init__()
        self.register_buffer("words", words)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.bits, self.num_embeddings, self.dtype, self.blocks = bits, num_embeddings, dtype, blocks
        self.embedding_dim = words.shape[1] // bits if blocks else words.shape[1]
        self.embed_scale = embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lookup = dequantize_block_rows if self.blocks else dequantize_rows
        values = lookup(self.words, self.scale, self.offset, self.bits, ids, self.dtype)
        if self.embed_scale is not None:
            values = values * torch.as_tensor(self.embed_scale).to(self.dtype)
        return values


def packed(codes: GroupCodes, blocks: bool = False, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(words, scale, offset, lane bits) to store: 4-bit codes two a byte,
    wider ones a byte each, in row lanes or (`blocks`) in panels of 8 rows
    along K. Row lanes keep scales and offsets in fp32 (in fp16, a compiled
    product converted each one scalar by scalar: 4 x slower); blocks store
    them in fp16 where that keeps them (narrow_tables; `exact`: a GGUF's own,
    kept only if every value survives), read 8 at a time by the kernel."""
    bits = 4 if codes.bits <= 4 else 8
    if blocks:
        scale, offset = narrow_tables(codes.scale, codes.offset, exact)
        return pack_blocks(codes.codes, bits), pack_table(scale), pack_table(offset), bits
    return pack(codes.codes, bits), pad_rows(codes.scale.float(), bits), pad_rows(codes.offset.float(), bits), bits


def int8_refusal(codes: GroupCodes, shares: str | None) -> str | None:
    """Why a linear with these codes keeps float activations under --qact int8,
    or None. `shares`: the embedding whose codes it shares, when they are
    stored for lookups alone (row lanes)."""
    if shares:
        return f"shares the codes of {shares}, stored for lookups"
    if codes.group % BLOCK or codes.codes.shape[1] % BLOCK:
        return f"its groups of {codes.group} are not whole blocks of {BLOCK}"
    if codes.codes.shape[0] % PANEL_ROWS:
        return f"its {codes.codes.shape[0]} rows are not a multiple of {PANEL_ROWS}"
    return None


CHUNK_VALUES = 1 << 24  # minmax quantizes this many values at a time (64 MB of fp32 temporaries)


def quantize_weight(weight: torch.Tensor, bits: int, group: int, algorithm: str = "minmax") -> GroupCodes:
    """Codes for a float weight [N, K]: a scale and an offset per group
    (group 0: per row) from its range or HQQ's search. minmax works through
    the rows in chunks: groups never cross rows, so the codes are the same,
    and a 1 GB embedding needs 64 MB of temporaries instead of 4 GB."""
    n, k = weight.shape
    size = group or k
    top = (1 << bits) - 1
    if algorithm == "hqq":
        from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_affine_hqq

        w = weight.detach().float()
        _, inverse, zero, _ = _choose_qparams_and_quantize_affine_hqq(
            w, nbits=bits, group_size=size, compute_dtype=torch.float32, device="cpu", raw_output=True
        )
        offset = -zero.reshape(n, k // size) * inverse.reshape(n, k // size)
        codes, scale = _encode(w.reshape(n, k // size, size), offset, inverse.reshape(n, k // size), top)
        return GroupCodes(codes.view(n, k), scale, offset, size, bits, str(weight.dtype).removeprefix("torch."))
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, k // size)
    offset = torch.empty(n, k // size)
    step = max(1, CHUNK_VALUES // k)
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        grouped = weight[rows].detach().float().reshape(-1, k // size, size)
        low, high = grouped.amin(-1), grouped.amax(-1)
        part_codes, scale[rows] = _encode(grouped, low, (high - low) / top, top)
        codes[rows], offset[rows] = part_codes.view(-1, k), low
    return GroupCodes(codes, scale, offset, size, bits, str(weight.dtype).removeprefix("torch."))


def _encode(grouped: torch.Tensor, offset: torch.Tensor, scale: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes of `grouped` [rows, groups, size] and the scale used (a
    zero scale, a constant group, becomes 1)."""
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round((grouped - offset[..., None]) / scale[..., None]).clamp(0, top).to(torch.uint8), scale


def quantize_model(
    model: nn.Module, qlinear: str, group_size: int, qembedding: str, *,
    algorithm: str = "minmax", keep_8w: tuple[str, ...] = (), gguf: str | None = None, tokenizer: Any = None,
    qact: str = "none", progress: Callable[[str], None] = lambda message: None,
) -> list[dict[str, Any]]:
    """Quantizes in place; returns one coverage row per linear and
    embedding. A tied LM head shares the embedding's codes when both are
    quantized (one stored copy); other tied weights are skipped, since
    quantizing one would untie them and store both. With `qact` int8,
    int8x2, int16 or int8-peak the linears that can take rounded activations do
    (`activations` in their row: the qact, or why they stay float); with
    schemes.BY_WIDTH each takes the rounding of its codes' width."""
    rounds = qact in schemes.ROUNDED or qact == schemes.BY_WIDTH
    if qlinear == "8da4w":
        return _torchao_8da4w(model, group_size, qembedding)
    modules = {fqn: m for fqn, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    owners: dict[int, list[str]] = {}
    for fqn, module in modules.items():
        owners.setdefault(id(module.weight), []).append(fqn)
    sources = _gguf_sources(gguf, model) if qlinear == "gguf" else None
    sensitive = _sensitive(model, modules, keep_8w, group_size, algorithm, tokenizer, progress) if qlinear == "4w" else set()
    rows, done, packed_by = [], {}, {}
    in_blocks: set[str] = set()  # embeddings stored in the blocks format, for their tied heads' int8 products
    for fqn, module in modules.items():
        kind = "linear" if isinstance(module, nn.Linear) else "embedding"
        row: dict[str, Any] = {"module": fqn, "kind": kind, "shape": list(module.weight.shape), "scheme": None, "skipped": None}
        tied = [o for o in owners[id(module.weight)] if o != fqn]
        shares = _shared_tie([fqn, *tied], modules)
        if sources is not None:
            row["source"] = sources[1].get(f"{fqn}.weight", sources[1].get(f"{tied[0]}.weight") if tied else None)
        if tied and not shares:
            codes, why = None, f"tied with {tied[0]}.weight (quantizing one would untie and store it twice)"
        else:
            codes, why = _codes_for(fqn, module, kind, qlinear, qembedding, group_size, algorithm, keep_8w, sensitive, sources, shares, done)
        if codes is None:
            row["skipped"] = why
            rows.append(row)
            continue
        row.update(scheme=f"{codes.bits}w" if qlinear != "gguf" else "gguf", bits=codes.bits,
                   granularity="per row" if codes.group == module.weight.shape[1] else f"per group of {codes.group}")
        if kind == "linear" and rounds:
            why_not = None if shares in in_blocks else int8_refusal(codes, shares)  # in_blocks: checked as the embedding
            row["activations"] = schemes.qact_for(qact, codes.bits) if why_not is None else f"float ({why_not})"
        elif kind == "embedding" and rounds and shares == fqn and int8_refusal(codes, None) is None:
            in_blocks.add(fqn)  # its tied head shares these codes and can multiply them with int8 activations
        if shares and shares in done and done[shares] is codes:
            row["shared_with"] = shares
        elif id(codes) not in packed_by:
            # packed now, the unpacked codes dropped: a model's codes and words are never held at once
            words = packed(codes, blocks=row.get("activations") in schemes.ROUNDED or fqn in in_blocks,
                           exact=qlinear == "gguf")
            codes = dataclasses.replace(codes, codes=torch.empty(0, dtype=torch.uint8))
            packed_by[id(codes)] = words
        done[fqn] = codes
        rows.append(row)
        release_freed_memory()
    _install(model, modules, done, rows, packed_by, in_blocks)
    return rows


def _codes_for(fqn, module, kind, qlinear, qembedding, group_size, algorithm, keep_8w, sensitive, sources, shares, done):
    """(codes, None) or (None, why not)."""
    weight = module.weight
    if sources is not None:
        name = f"{fqn}.weight"
        if shares and shares in done:
            return done[shares], None
        codes = sources[0].get(name) or (sources[0].get(f"{shares}.weight") if shares else None)
        if codes is None:
            return None, f"stored as {sources[1].get(name, 'float')} in the GGUF (kept as float)"
        return codes, None
    scheme = qlinear if kind == "linear" else qembedding
    if kind == "linear" and shares:
        if qembedding and shares in done:
            return done[shares], None
        return None, f"tied with {shares}.weight, which is not quantized (add --qembedding 8w to share its codes)"
    if not scheme:
        return None, f"no --q{kind} scheme asked for"
    row = KEPT_8W if fqn in sensitive or _matches(fqn, keep_8w) else schemes.scheme(scheme)
    bits = row.bits
    group = (group_size or row.default_group) if kind == "linear" else 0
    if group and weight.shape[1] % group:
        return None, f"width {weight.shape[1]} is not divisible by the group size {group}"
    return quantize_weight(weight, bits, group, algorithm if kind == "linear" else "minmax"), None


def _matches(fqn: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(fqn, p) for p in patterns if not p.startswith("sensitive:"))


def _install(model: nn.Module, modules: dict[str, nn.Module], done: dict[str, GroupCodes], rows: list[dict],
             packed_by: dict[int, tuple], in_blocks: set[str]) -> None:
    """Swaps each quantized module for its packed form (`packed_by`, by the
    id of its codes); modules sharing one Codes share one set of stored
    tensors."""
    by_module = {row["module"]: row for row in rows}
    for fqn, codes in done.items():
        module = modules[fqn]
        words, scale, offset, bits = packed_by[id(codes)]
        n = module.weight.shape[0]
        if isinstance(module, nn.Linear):
            bias = module.bias.detach() if module.bias is not None else None
            qact = by_module[fqn].get("activations")
            if qact in schemes.ROUNDED:
                new: nn.Module = Int8Linear(words, scale, offset, bits, bias, qact)
            else:
                new = PackedLinear(words, scale, offset, bits, n, bias)
        else:
            new = PackedEmbedding(words, scale, offset, bits, n, module.weight.dtype, getattr(module, "embed_scale", None),
                                  blocks=fqn in in_blocks)
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, new)
        by_module[fqn]["stored"] = {"data" if isinstance(new, Int8Linear) else "words": words, "scale": scale, "offset": offset}


def _shared_tie(group: list[str], modules: dict[str, nn.Module]) -> str | None:
    """The embedding of a tie of one embedding and one linear, else None."""
    if len(group) != 2:
        return None
    embeddings = [fqn for fqn in group if isinstance(modules[fqn], nn.Embedding)]
    return embeddings[0] if len(embeddings) == 1 else None


def _gguf_sources(gguf: str | None, model: nn.Module) -> tuple[dict[str, GroupCodes], dict[str, str]]:
    """Codes by weight name for every quantized tensor of the GGUF source,
    and every tensor's GGUF type by weight name."""
    if not gguf:
        raise SpecError("--qlinear gguf keeps a GGUF source's own quantization: the model must be a .gguf file "
                        "(or the built-in smollm2-135m)")
    return read_gguf_codes(gguf, model.config)


@torch.no_grad()
def _sensitive(model, modules, keep_8w, group_size, algorithm, tokenizer, progress) -> set[str]:
    """With `sensitive:FRACTION` among the patterns: the linears whose 4-bit
    weight changes their output on a calibration text the most, relative to
    that output, a FRACTION of them by count."""
    fractions = [p.removeprefix("sensitive:") for p in keep_8w if p.startswith("sensitive:")]
    if not fractions:
        return set()
    try:
        fraction = float(fractions[0])
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise SpecError(f"--qlinear-keep-8w sensitive:FRACTION needs a fraction in (0, 1], got {fractions[0]!r}")
    weights = [id(m.weight) for m in modules.values()]
    linears = {fqn: m for fqn, m in modules.items() if isinstance(m, nn.Linear) and weights.count(id(m.weight)) == 1}
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, fqn=fqn: inputs.setdefault(fqn, args[0].reshape(-1, args[0].shape[-1])))
             for fqn, m in linears.items()]
    try:
        ids = tokenizer(CALIBRATION_TEXT)["input_ids"] if tokenizer is not None else None
    except Exception:
        ids = None
    if ids is None:  # no tokenizer: a fixed token sequence still exercises every layer
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    progress(f"measuring the sensitivity of {len(linears)} linears on {len(ids)} calibration tokens")
    try:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    errors = {}
    for fqn, module in linears.items():
        if fqn not in inputs or _matches(fqn, keep_8w):
            continue
        group = group_size or FOUR_BIT.default_group
        if module.weight.shape[1] % group:
            continue
        x = inputs[fqn].float()
        exact = x @ module.weight.float().T
        approx = x @ quantize_weight(module.weight, FOUR_BIT.bits, group, algorithm).dequantize().T
        errors[fqn] = float((approx - exact).norm() / exact.norm().clamp_min(1e-12))
    ranked = sorted(errors, key=errors.get, reverse=True)
    return set(ranked[: round(fraction * len(ranked))])


def _torchao_8da4w(model: nn.Module, group_size: int, qembedding: str) -> list[dict[str, Any]]:
    """torchao's int8 dynamic activations with int4 weights per group (its
    arithmetic is traced through its unwrapped tensors); embeddings as 8w."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import MappingType

    group = group_size or schemes.scheme("8da4w").default_group
    embedding_rows = quantize_model(model, "", 0, qembedding) if qembedding else []
    rows = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            row = {"module": fqn, "kind": "linear", "shape": list(module.weight.shape), "scheme": None, "skipped": None}
            if module.weight.shape[1] % group:
                row["skipped"] = f"width {module.weight.shape[1]} is not divisible by the group size {group}"
            else:
                row.update(scheme="8da4w", bits=4, granularity=f"per group of {group}")
            rows.append(row)
    chosen = {r["module"] for r in rows if r["scheme"]}
    config = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(group), weight_mapping_type=MappingType.ASYMMETRIC
    )
    quantize_(model, config, filter_fn=lambda m, fqn: fqn in chosen)
    return rows + [r for r in embedding_rows if r["kind"] == "embedding" or r["scheme"]]


def plain_weights(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Replaces every torchao (tensor subclass) weight with its plain inner
    tensors, held by torchao's unwrapping parametrization, so tracing
    records torchao's own arithmetic on plain tensors. Returns, per
    quantized weight, its inner tensors by role (qdata, scale, ...)."""
    from torchao.utils import unwrap_tensor_subclass

    layout: dict[str, dict[str, Any]] = {}
    for fqn, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None and hasattr(weight, "__tensor_flatten__") and type(weight) is not nn.Parameter:
            names, _ = weight.__tensor_flatten__()
            layout[fqn] = {n: getattr(weight, n) for n in names}
    if layout:
        unwrap_tensor_subclass(model)
    return layout


def coverage_summary(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for kind in ("linear", "embedding"):
        of_kind = [r for r in rows if r["kind"] == kind]
        done = [r for r in of_kind if r["scheme"]]
        if not of_kind:
            continue
        used = sorted({f"{r['scheme']}" + (f" from {r['source']}" if r.get("source") else "") for r in done})
        lines.append(f"quantized {len(done)} of {len(of_kind)} {kind}s" + (f" ({', '.join(used)})" if used else ""))
        for r in of_kind:
            if r["skipped"] and not r["skipped"].startswith("no --q"):
                lines.append(f"  skipped {r['module']}: {r['skipped']}")
            if r.get("shared_with"):
                lines.append(f"  {r['module']} shares the codes of {r['shared_with']} (tied)")
        asked = [r for r in done if "activations" in r]
        if asked:
            floats = [r for r in asked if r["activations"] not in schemes.ROUNDED]
            named = schemes.rounding_named([r["activations"] for r in asked])
            lines.append(f"{named} activations on {len(asked) - len(floats)} of {len(asked)} quantized {kind}s")
            lines += [f"  {r['module']}: activations {r['activations']}" for r in floats]
    return lines
