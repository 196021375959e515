"""The first token a chat prompt gets under each activation rounding: the
top 3 of the last row's logits (token and logit) of the float model, of its
weight-only quantization and of each `--qact`, in eager PyTorch (the
schemes' definitions, which packages compute). Teacher-forced agreement
over a text (bench/quant.py) counts tokens; this shows whether a rounding
flips a near-tie at the start of an answer, which greedy decoding then
follows.

    python bench/first_token.py [--model smollm2-135m] [--qlinear 4w] [--prompt "What is the capital of France?"]
"""

from __future__ import annotations

import argparse
import copy

import torch

from common import cpu_model, emit
from kvexport.contract import schemes
from kvexport.exporter.quantization.quantize import quantize_model
from kvexport.exporter.sources.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--qlinear", default="4w", choices=("4w", "8w"))
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--qact", default="none,int8,int8-peak,int16,by width",
                        help="comma-separated roundings (`by width`: the default where the kernels exist)")
    args = parser.parse_args()
    roundings = args.qact.split(",")
    if any(q not in (*schemes.QACT, schemes.BY_WIDTH) for q in roundings):
        parser.error(f"--qact takes {', '.join((*schemes.QACT, schemes.BY_WIDTH))}")
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        parser.error(f"{args.model} has no tokenizer with a chat template")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    ids = torch.tensor([ids if isinstance(ids, list) else ids["input_ids"]])
    result = {"cpu": cpu_model(), "model": args.model, "qlinear": args.qlinear, "prompt": args.prompt, "top3": {}}
    for rounding in ["float", *roundings]:
        model = copy.deepcopy(loaded.model)
        if rounding != "float":
            quantize_model(model, args.qlinear, 0, "8w", qact=rounding)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
        values, tokens = logits.topk(3)
        result["top3"][rounding] = [[tokenizer.decode([int(t)]), round(float(v), 3)] for t, v in zip(tokens, values)]
    emit(result)


if __name__ == "__main__":
    main()
