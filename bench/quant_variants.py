"""Which torchao config to use for each scheme: teacher-forced top-1
agreement with the fp32 model over bench/quant.py's 256-token text, for
torchao configs run eagerly (no export), with how many flipped tokens were
near-ties in fp32 (top-two logits within 0.1) and the largest fp32 margin
that flipped.

    python bench/quant_variants.py [--model smollm2-135m]

The LM head stays fp32 here (it is tied to the embedding), so the figures
isolate the linears' quantization.
"""

from __future__ import annotations

import argparse

import torch

from common import emit
from kvexport.exporter.models import load_model
from quant import TEXT


def variants() -> dict:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup, PerRow
    from torchao.quantization.quant_primitives import MappingType

    asym, sym = MappingType.ASYMMETRIC, MappingType.SYMMETRIC
    return {
        "8w Int8WeightOnly per row (symmetric)": Int8WeightOnlyConfig(granularity=PerRow()),
        "8w intx per row, symmetric": IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0), mapping_type=sym),
        "8w intx per row, asymmetric (kvexport)": IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0), mapping_type=asym),
        "8w intx group 32, asymmetric": IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32), mapping_type=asym),
        "4w intx group 32, symmetric": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=sym),
        "4w intx group 32, asymmetric (kvexport)": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32), mapping_type=asym),
        "4w intx group 16, asymmetric": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(16), mapping_type=asym),
        "8da4w group 32, symmetric weights": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
        "8da4w group 32, asymmetric weights (kvexport)": Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32), weight_mapping_type=asym
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    from torchao.quantization import quantize_

    loaded = load_model(args.model, "fp32")
    ids = torch.tensor([loaded.tokenizer(TEXT)["input_ids"][:256]])
    with torch.no_grad():
        logits = loaded.model(ids).logits[0]
    reference = logits.argmax(-1)
    top2 = logits.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    result: dict = {"model": args.model, "tokens": ids.shape[1], "fp32_margins_under_0.1": int((margin < 0.1).sum()), "variants": {}}
    for name, config in variants().items():
        model = load_model(args.model, "fp32").model
        quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head")
        with torch.no_grad():
            flips = model(ids).logits[0].argmax(-1) != reference
        flipped = margin[flips]
        result["variants"][name] = {
            "top1_agreement_with_fp32": round(1 - float(flips.float().mean()), 4),
            "flips": int(flips.sum()),
            "flips_at_fp32_margin_under_0.1": int((flipped < 0.1).sum()),
            "largest_fp32_margin_flipped": round(float(flipped.max()), 2) if len(flipped) else None,
        }
    emit(result)


if __name__ == "__main__":
    main()
