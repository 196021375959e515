"""The size-agreement frontier of quantization recipes, run eagerly (the
exported packages give the same tokens as the eagerly quantized model;
tests/test_packed_quant.py): teacher-forced top-1 agreement with the float
model over bench/quant.py's 256-token text, and the stored bytes of the
quantized model over its fp32 bytes, for each recipe. Prints the recipes by
size, marking those no other recipe beats on both.

    python bench/quant_frontier.py [--model smollm2-135m]

SmolLM2's float weights are its GGUF dequantized (linears Q4_1, blocks of
32 along the input width): a 4-bit recipe with groups of 32 finds those
codes again, so its agreement says nothing about full-precision sources.
Groups of 64 straddle two GGUF blocks and lose accuracy as re-quantizing a
full-precision weight does: the g64 rows are the ones to read for that.
"""

from __future__ import annotations

import argparse

import torch

from common import emit
from kvexport.exporter.sources.models import load_model
from kvexport.exporter.quantization.quantize import quantize_model
from quant import TEXT

RECIPES = {
    "8w": dict(qlinear="8w"),
    "4w g32": dict(qlinear="4w"),
    "4w g64": dict(qlinear="4w", group_size=64),
    "4w g64 hqq": dict(qlinear="4w", group_size=64, algorithm="hqq"),
    "4w g64, down_proj 8w": dict(qlinear="4w", group_size=64, keep_8w=("*.down_proj",)),
    "4w g64, sensitive 10% 8w": dict(qlinear="4w", group_size=64, keep_8w=("sensitive:0.1",)),
    "4w g64, sensitive 25% 8w": dict(qlinear="4w", group_size=64, keep_8w=("sensitive:0.25",)),
    "4w g64 hqq, sensitive 25% 8w": dict(qlinear="4w", group_size=64, algorithm="hqq", keep_8w=("sensitive:0.25",)),
    "4w g64, sensitive 50% 8w": dict(qlinear="4w", group_size=64, keep_8w=("sensitive:0.5",)),
    "4w g64 hqq, sensitive 50% 8w": dict(qlinear="4w", group_size=64, algorithm="hqq", keep_8w=("sensitive:0.5",)),
    "4w g64 hqq, sensitive 75% 8w": dict(qlinear="4w", group_size=64, algorithm="hqq", keep_8w=("sensitive:0.75",)),
}


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once."""
    seen, total = set(), 0
    for tensor in list(model.state_dict(keep_vars=True).values()):
        key = (tensor.untyped_storage().data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--only", action="append", choices=sorted(RECIPES), help="run only these recipes (repeatable)")
    args = parser.parse_args()
    loaded = load_model(args.model, "fp32")
    ids = torch.tensor([loaded.tokenizer(TEXT)["input_ids"][:256]])
    with torch.no_grad():
        reference = loaded.model(ids).logits[0].argmax(-1)
    fp32_bytes = stored_bytes(loaded.model)
    rows = []
    for name, recipe in RECIPES.items():
        if args.only and name not in args.only:
            continue
        model = load_model(args.model, "fp32").model
        quantize_model(model, recipe["qlinear"], recipe.get("group_size", 0), "8w", algorithm=recipe.get("algorithm", "minmax"),
                       keep_8w=recipe.get("keep_8w", ()), tokenizer=loaded.tokenizer)
        with torch.no_grad():
            agree = float((model(ids).logits[0].argmax(-1) == reference).float().mean())
        rows.append({"recipe": name + " (+ --qembedding 8w)", "size_over_fp32": round(stored_bytes(model) / fp32_bytes, 3),
                     "top1_agreement_with_fp32": round(agree, 4)})
    for row in rows:
        row["on_frontier"] = not any(
            o["size_over_fp32"] <= row["size_over_fp32"] and o["top1_agreement_with_fp32"] >= row["top1_agreement_with_fp32"]
            and o is not row and (o["size_over_fp32"], o["top1_agreement_with_fp32"]) != (row["size_over_fp32"], row["top1_agreement_with_fp32"])
            for o in rows
        )
    emit({"model": args.model, "tokens": ids.shape[1], "recipes": sorted(rows, key=lambda r: r["size_over_fp32"])})


if __name__ == "__main__":
    main()
