"""Where rounded activations lose agreement: teacher-forced top-1 of a
quantized model against its float model, in eager PyTorch, with int16
activations (--qact int16) on one part of the linears at a time and the
default rounding (each linear's by its codes' width) on the rest.

    python bench/qact_mix.py [--model smollm2-135m] [--qlinear 4w] [--tokens 768] [--by kind|layer]

It answers whether a few linears could take int16 and the rest keep int8's
speed: if one kind of linear (q_proj, down_proj, ...) or a few layers hold
most of the loss, int16 on those alone recovers it. The products are the
schemes' definitions (the eager reference that `verify` and the portable
backend compute), over the whole text in one forward; packages run it in
slices of 128 (bench/quant.py), so the figures here differ from that
bench's by a token or two. `--qembedding 8w` as in the README's packages.
"""

from __future__ import annotations

import argparse
import copy
import re

import torch

from common import cpu_model, emit
from kvexport.contract import schemes
from kvexport.exporter.quantization.quantize import Int8Linear, quantize_model
from kvexport.exporter.sources.models import load_model
from quant import MORE_TEXT, TEXT


@torch.no_grad()
def top1(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits[0].argmax(-1)


def kind_of(fqn: str) -> str:
    return fqn.rsplit(".", 1)[-1]


def layer_of(fqn: str) -> str:
    found = re.search(r"\.layers\.(\d+)\.", fqn)
    return f"layer {found.group(1)}" if found else kind_of(fqn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--qlinear", default="4w", choices=("8w", "4w"))
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--by", default="kind", choices=("kind", "layer"),
                        help="int16 on each kind of linear (q_proj, ...) or on each layer's linears in turn")
    args = parser.parse_args()
    loaded = load_model(args.model)
    ids = loaded.tokenizer(TEXT + MORE_TEXT)["input_ids"][: args.tokens] if loaded.tokenizer is not None else None
    if ids is None:  # a model without a tokenizer: random ids exercise every layer alike
        vocab = loaded.model.config.vocab_size
        ids = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    x = torch.tensor([ids])
    reference = top1(loaded.model, x)

    def agreement(model) -> float:
        return round(100 * float((top1(model, x) == reference).float().mean()), 2)

    weight_only = copy.deepcopy(loaded.model)
    quantize_model(weight_only, args.qlinear, 0, "8w", qact="none")
    result = {"cpu": cpu_model(), "model": args.model, "qlinear": args.qlinear, "tokens": len(ids),
              "weight_only": agreement(weight_only)}
    del weight_only
    model = loaded.model
    quantize_model(model, args.qlinear, 0, "8w", qact=schemes.BY_WIDTH)
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Int8Linear)}
    default = {fqn: m.qact for fqn, m in linears.items()}
    result["default"] = {"agreement": agreement(model), "activations": sorted(set(default.values()))}
    group_of = kind_of if args.by == "kind" else layer_of
    groups = sorted(set(map(group_of, linears)), key=lambda g: (len(g), g))
    result["int16_on"] = {}
    for group in [*groups, "all"]:
        chosen = [fqn for fqn in linears if group in ("all", group_of(fqn))]
        for fqn in chosen:
            linears[fqn].qact = "int16"
        result["int16_on"][group] = {"linears": len(chosen), "agreement": agreement(model)}
        for fqn in chosen:
            linears[fqn].qact = default[fqn]
    emit(result)


if __name__ == "__main__":
    main()
