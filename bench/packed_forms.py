"""Three ways to write a product over packed 8- or 4-bit weights for a few
rows, each compiled by inductor, at 1 and 8 rows, on SmolLM2's shapes:

- fused: what passes/packed_weights.py emits (one reduction per lane, the
  scale multiplied inside; each row unpacks the words again);
- tiled: dequantize cache-sized tiles of the weight once, then `mm` with
  all rows (the weight is unpacked once per call, for every row);
- group_sum: per-group sums of x * code, then the scales (one multiply
  fewer per value, two reductions).

    python bench/packed_forms.py [--bits 8]

Prints ms per call of each form (a fresh inductor cache per run).
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="kvexport-forms-"))

import torch  # noqa: E402

from common import best_of, cpu_model, emit  # noqa: E402
from kvexport.passes.packed_weights import lanes_of, pack  # noqa: E402

SHAPES = [(1536, 576), (576, 1536), (49152, 576)]
GROUP = 32


def fused(x, words, scale, offset, bits):
    rows, width = x.shape
    per_word, groups = words.shape[0], scale.shape[1]
    xg = x.reshape(rows, 1, groups, width // groups)
    scales = scale.reshape(lanes_of(bits), per_word, groups, 1)
    lanes = []
    for b in range(lanes_of(bits)):
        codes = ((words >> (bits * b)) & ((1 << bits) - 1)).reshape(per_word, groups, width // groups)
        lanes.append((xg * (codes.float() * scales[b])).sum([-1, -2]))
    sums = x.reshape(rows, groups, width // groups).sum(-1)
    return torch.cat(lanes, 1) + (sums.unsqueeze(1) * offset).sum(-1)


def tiled(x, words, scale, offset, bits, tile_bytes=256 * 1024):
    rows, width = x.shape
    per_word, groups, lanes = words.shape[0], scale.shape[1], lanes_of(bits)
    chunk = max(1, tile_bytes // (lanes * width * 4))
    sc, of = scale.reshape(lanes, per_word, groups, 1), offset.reshape(lanes, per_word, groups, 1)
    parts = []
    for c0 in range(0, per_word, chunk):
        c1 = min(per_word, c0 + chunk)
        codes = torch.stack([(words[c0:c1] >> (bits * b)) & ((1 << bits) - 1) for b in range(lanes)])
        values = codes.float().reshape(lanes, c1 - c0, groups, width // groups) * sc[:, c0:c1] + of[:, c0:c1]
        parts.append(torch.mm(x, values.reshape(lanes * (c1 - c0), width).t()).reshape(rows, lanes, c1 - c0))
    return torch.cat(parts, 2).reshape(rows, lanes * per_word)


def group_sum(x, words, scale, offset, bits):
    rows, width = x.shape
    per_word, groups = words.shape[0], scale.shape[1]
    xg = x.reshape(rows, 1, groups, width // groups)
    scales = scale.reshape(lanes_of(bits), per_word, groups)
    lanes = []
    for b in range(lanes_of(bits)):
        codes = ((words >> (bits * b)) & ((1 << bits) - 1)).reshape(per_word, groups, width // groups)
        lanes.append(((xg * codes.float()).sum(-1) * scales[b]).sum(-1))
    sums = x.reshape(rows, groups, width // groups).sum(-1)
    return torch.cat(lanes, 1) + (sums.unsqueeze(1) * offset).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=8, choices=(4, 8))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows_out = []
    for n, k in SHAPES:
        words = pack(torch.randint(0, 2**args.bits, (n, k), dtype=torch.uint8), args.bits)
        scale = torch.rand(lanes_of(args.bits) * words.shape[0], k // GROUP) * 0.01
        offset = torch.rand_like(scale) * 0.01
        for rows in (1, 8):
            x = torch.randn(rows, k)
            forms = {f.__name__: torch.compile(f, dynamic=False) for f in (fused, tiled, group_sum)}
            want = fused(x, words, scale, offset, args.bits)
            row = {"shape": [n, k], "rows": rows}
            for name, fn in forms.items():
                torch.testing.assert_close(fn(x, words, scale, offset, args.bits), want, rtol=1e-3, atol=1e-2)
                row[f"{name}_ms"] = round(best_of(lambda: fn(x, words, scale, offset, args.bits), 20) * 1e3, 3)
            rows_out.append(row)
    emit({"cpu": cpu_model(), "bits": args.bits, "rows": rows_out})


if __name__ == "__main__":
    main()
