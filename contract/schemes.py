"""The quantization schemes, one row each: what `--qlinear` and
`--qembedding` accept, what each value means, and what it costs. The CLI's
choices and help, the spec's validation, the memory plan, quantize and the
manifest's quantization section all read this table, so a scheme is one row
here plus the code that makes its codes (exporter/quantization/).

The contract holds it because a package's manifest names its scheme, and
`validate` checks that name against the rows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    name: str
    help: str
    bits: int  # code bits of its weights; 0: each tensor's own (gguf)
    default_group: int  # values per scale of a linear's row when --qlinear-group-size is 0; 0 = the whole row
    storage: str  # "packed": words, scale and offset per group (PackedLinear); "gguf": the GGUF's own blocks; "torchao"
    linears: bool = True  # a --qlinear value
    embeddings: bool = False  # a --qembedding value (an embedding's rows: per row)
    group_sizes: bool = True  # takes --qlinear-group-size
    algorithms: bool = True  # takes --qlinear-algorithm (how a group's scale and offset are chosen)
    keeps_8w: bool = False  # takes --qlinear-keep-8w (some linears kept at 8 bits)
    own_embeddings: bool = False  # quantizes the embeddings itself: --qembedding is refused
    # what the memory plan counts per weight value for the quantized copy:
    # codes, and scales and offsets at most one in ten more
    plan_bytes_per_value: float = 0.55

    def plan_bytes(self, values: int) -> int:
        return int(values * self.plan_bytes_per_value)


SCHEMES = (
    Scheme("8w", "8-bit codes per row (or per group with --qlinear-group-size)", 8, 0, "packed", embeddings=True,
           plan_bytes_per_value=1.1),
    Scheme("4w", "4-bit codes per group of 32, packed two a byte", 4, 32, "packed", keeps_8w=True),
    Scheme("gguf", "keep a GGUF source's own quantization, embeddings included", 0, 0, "gguf", group_sizes=False,
           algorithms=False, own_embeddings=True),
    Scheme("8da4w", "torchao's int8 dynamic activations with int4 weights per group of 32 (torchao)", 4, 32,
           "torchao", algorithms=False),
)
BY_NAME = {scheme.name: scheme for scheme in SCHEMES}
ALGORITHMS = ("minmax", "hqq")  # a group's scale and offset from its range, or from HQQ's search
# --qact: a packed linear's activations kept float, rounded to int8 per block
# of 32, rounded so plus their rounding error rounded alike (two int8 terms),
# rounded to int16 per block of 32, or int8 with a second term on each row's
# peak block (the one holding its largest magnitude). The int8 kernel's
# `qact` argument is a value's index here: keep the order
QACT = ("none", "int8", "int8x2", "int16", "int8-peak")
ROUNDED = QACT[1:]  # the --qact values that make integer products
# --qact left out where the backend multiplies rounded activations on its own
# kernels: each linear takes the rounding of its codes' width. int16 over
# 8-bit codes: on AVX2 as fast as int8 at every row count, and within 0.13
# points of weight-only's agreement where int8 fell 1.56 short; int8-peak
# over 4-bit codes, where int16 costs twice the integer products and int8
# fell 1.7-2.2 points short: its second term on each row's peak block took
# SmolLM2 4w to 0.78 points of weight-only for about 3% of a step (README,
# "Int16 activations" and "A second term on the peak block")
BY_WIDTH = "by width"
QACT_BY_BITS = {8: "int16", 4: "int8-peak"}
QLINEAR = tuple(s.name for s in SCHEMES if s.linears)
QEMBEDDING = tuple(s.name for s in SCHEMES if s.embeddings)


def scheme(name: str) -> Scheme:
    return BY_NAME[name]


def help_text(kind: str) -> str:
    """The CLI help of --qlinear or --qembedding, from the rows."""
    names = QLINEAR if kind == "linear" else QEMBEDDING
    return "; ".join(f"{name}: {BY_NAME[name].help}" for name in names)


def rounding_named(activations: list[str]) -> str:
    """The --qact values among coverage rows' `activations`, joined by "/"
    when several ("int8" when none)."""
    return "/".join(sorted(set(activations) & set(ROUNDED))) or "int8"


def qact_for(qact: str, bits: int) -> str:
    """The rounding a linear of `bits`-bit codes takes under `qact`."""
    return QACT_BY_BITS.get(bits, "int8") if qact == BY_WIDTH else qact


def int8_activations(row: Scheme | None) -> bool:
    """Whether a scheme's linears can take int8 activations (--qact int8)."""
    return row is not None and row.linears and row.storage in ("packed", "gguf")


def check(qlinear: str, qembedding: str, group_size: int, algorithm: str, keep_8w: str, qact: str = "") -> str | None:
    """Why this combination of quantization flags cannot be honoured, or None."""
    if qlinear not in ("", *QLINEAR):
        return f"--qlinear must be one of {', '.join(QLINEAR)}, got {qlinear!r}"
    if qembedding not in ("", *QEMBEDDING):
        return f"--qembedding must be {', '.join(QEMBEDDING)}, got {qembedding!r}"
    if algorithm not in ALGORITHMS:
        return f"--qlinear-algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}"
    row = BY_NAME.get(qlinear)
    if qact not in ("", *QACT):
        return f"--qact must be one of {', '.join(QACT)}, got {qact!r}"
    if qact in ROUNDED and not int8_activations(row):
        able = [s.name for s in SCHEMES if int8_activations(s)]
        return (f"--qact {qact} rounds the activations of linears with packed codes ({', '.join(able)}): "
                f"add --qlinear {able[0]}" + (" (8da4w rounds its own)" if qlinear == "8da4w" else ""))
    if keep_8w and not (row and row.keeps_8w):
        able = [s.name for s in SCHEMES if s.keeps_8w]
        return f"--qlinear-keep-8w keeps some linears at 8 bits in a --qlinear {'/'.join(able)} export; add --qlinear {able[0]}"
    if row and row.own_embeddings and (qembedding or group_size):
        return (f"--qlinear {qlinear} keeps the source's own quantization of every tensor, embeddings and groups "
                f"included: drop --qembedding and --qlinear-group-size")
    if row and group_size and not row.group_sizes:
        return f"--qlinear {qlinear} takes no --qlinear-group-size"
    if row and algorithm != ALGORITHMS[0] and not row.algorithms:
        return f"--qlinear {qlinear} chooses its own scales: drop --qlinear-algorithm {algorithm}"
    return None
