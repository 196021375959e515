"""Quantized packages against fp32, in one run: size, teacher-forced top-1
agreement with the fp32 model over a fixed 256-token text, greedy decode
tokens/s at batch 1 and over 8 sessions as ratios to HF `generate` fp32 at
batch 1, and the rate at which each decode step reads the package's weights
(weight bytes / step time, GB/s), with the instruction set its methods were
compiled for. To see AVX2 code on an AVX-512 machine, export and run with
ATEN_CPU_CAPABILITY=avx2 (inductor and ATen both read it).

    python bench/quant.py --fp32 PKG --quantized 8w=PKG --quantized 4w-aoti=PKG ...

Each package must come from the same model; forward_others must take 128
tokens (export with --max-step-tokens >= 129). A label is free text; a
package's size is compared with the fp32 package of its backend (pass an
aoti fp32 package as `fp32-aoti=PKG` to get that ratio for aoti ones). The
floor of a batch-1 step is the package's weight bytes read once at the read
rate this machine's BLAS reaches (bench/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from common import cpu_model, emit, weight_read_gbps
from decode import decode_seconds
from kvexport.contract.schemes import ROUNDED
from kvexport.exporter.sources.models import load_model
from kvexport.runtime.verify import method_logits
from kvexport.runtime import generate, load

TEXT = (
    "The history of astronomy begins with people who watched the sky and kept records of what they saw. "
    "Farmers needed calendars, sailors needed directions, and priests needed to know when festivals fell. "
    "Over many centuries these needs produced careful tables of the motions of the Sun, the Moon and the planets. "
    "Greek astronomers built geometric models in which the Earth stood still at the centre, while later thinkers "
    "in Persia, India and the Islamic world refined the measurements and questioned the models. In the sixteenth "
    "century Copernicus proposed that the Earth and the other planets move around the Sun. Kepler found that the "
    "orbits are ellipses, Galileo turned a telescope to the heavens and saw the moons of Jupiter, and Newton "
    "explained all of it with a single law of gravitation. Today astronomers study light from galaxies billions of "
    "years old, measure the expansion of the universe, and search for planets around distant stars, some of which "
    "might be warm enough for liquid water. Each new instrument has changed the questions people ask about the sky. "
    "Radio dishes revealed cold clouds of gas where stars are born, satellites above the atmosphere caught X-rays "
    "from matter falling into black holes, and detectors buried deep underground counted the faint neutrinos that "
    "stream out of the Sun. Gravitational waves, first recorded in 2015, let astronomers hear two black holes merge "
    "more than a billion light years away. Amateur observers still matter too: they find comets, track variable "
    "stars and share careful notes, much as the first sky watchers did thousands of years ago."
)
# more text for --tokens beyond 256: kinds of writing a chat model meets (a recipe, code, a letter, a report)
MORE_TEXT = (
    " To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt and seven grams of dry "
    "yeast, then add three hundred and fifty millilitres of warm water. Knead the dough for ten minutes until it is "
    "smooth and springs back when pressed. Leave it covered in a warm place for an hour, until it has doubled in "
    "size. Shape it into a round, place it on a floured tray, and let it rise for another forty minutes while the "
    "oven heats to two hundred and twenty degrees. Bake for thirty minutes, until the crust is brown and the loaf "
    "sounds hollow when tapped underneath. Let it cool before cutting, or the crumb will be gummy.\n\n"
    "def moving_average(values, window):\n"
    "    \"\"\"Return the averages of each run of `window` consecutive values.\"\"\"\n"
    "    if window <= 0:\n"
    "        raise ValueError(\"window must be positive\")\n"
    "    total = sum(values[:window])\n"
    "    averages = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        averages.append(total / window)\n"
    "    return averages\n\n"
    "Dear Ms. Patel, thank you for your letter of the twelfth about the delayed delivery of your order. I am sorry "
    "that the parcel did not arrive on the date we promised. Our warehouse moved to a new building last month, and "
    "some orders were held while the shelves were set up again. Your order left us yesterday and should reach you "
    "within three working days. I have refunded the delivery charge to your card, and I have added a note to your "
    "account so that our team will call you if anything else goes wrong. Please write to me directly if you have any "
    "further questions. Yours sincerely, Daniel Moreau, Customer Service.\n\n"
    "Quarterly report. Sales rose by eight percent compared with the same quarter last year, led by the northern "
    "region, where two new shops opened in April. Costs grew more slowly than sales, so the operating margin improved "
    "from eleven to thirteen percent. The online store now accounts for a quarter of all revenue. Staff turnover "
    "fell after the new training programme began, and customer complaints were the lowest since records started. "
    "The main risks for the next quarter are higher energy prices, a shortage of delivery drivers, and the cost of "
    "replacing the old payment system, which the board approved in May. We expect to finish that project by the end "
    "of the year, within the budget set in the spring."
)


def teacher_forced_top1(runtime, tokens: list[int], chunk: int = 128) -> torch.Tensor:
    rows = []
    for start in range(0, len(tokens), chunk):
        rows.append(method_logits(runtime, "forward_others", tokens[:start], tokens[start : start + chunk]).argmax(-1))
    return torch.cat(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fp32", required=True, type=Path)
    parser.add_argument("--quantized", action="append", default=[], help="SCHEME=PKG")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=256,
                        help="teacher-forced tokens for the agreement (one is 100/N points; SmolLM2's tokenizer makes 810 of the text)")
    parser.add_argument("--agreement-only", action="store_true",
                        help="Only the top-1 agreement and sizes: no decode timings (any backend's packages, portable ones export fastest).")
    args = parser.parse_args()
    fp32 = load(args.fp32)
    text = fp32.package.tokenizer()
    tokens = text.tokenizer(TEXT + MORE_TEXT)["input_ids"][: args.tokens]
    if len(tokens) != args.tokens:
        parser.error(f"the bench's text has {len(tokens)} tokens; ask --tokens {len(tokens)} or fewer")
    reference = teacher_forced_top1(fp32, tokens)
    prompts = [tokens[i * 24 : i * 24 + 24] for i in range(8)]
    result = {"cpu": cpu_model(), "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "default"), "schemes": {}}
    if not args.agreement_only:  # HF's fp32 decode, the timings' reference
        source = json.loads((args.fp32 / "manifest.json").read_text())["provenance"]["source"]
        hf = load_model(source.get("builtin") or source["path"]).model

        def hf_run(n: int) -> None:
            ids = torch.tensor(prompts[:1])
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)

        hf_run(2)
        hf_tps = (args.new_tokens - 1) / decode_seconds(hf_run, args.new_tokens, 2)
        read_gbps = weight_read_gbps()["mm_2_columns"]
        result |= {"hf_generate_fp32_batch1_tokens_per_s": round(hf_tps, 2), "read_gbps": round(read_gbps, 1)}
    fp32_bytes: dict[str, int] = {}
    for item in ["fp32=" + str(args.fp32)] + args.quantized:
        scheme, path = item.split("=", 1)
        runtime = fp32 if scheme == "fp32" else load(path)
        manifest = runtime.package.manifest
        backend = manifest["backend"]["id"]
        package_bytes = sum(f["bytes"] for f in manifest["files"].values())
        weights_bytes = manifest["files"][manifest["weights"]["file"]]["bytes"]
        if scheme.startswith("fp32"):
            fp32_bytes.setdefault(backend, package_bytes)
        agree = float((teacher_forced_top1(runtime, tokens) == reference).float().mean())
        row = {"backend": backend, "top1_agreement_with_fp32": round(agree, 4), "weights_mb": round(weights_bytes / 1e6, 1)}
        isa = manifest["backend"].get("options", manifest["backend"]).get("target", {}).get("cpu_isa")
        if isa:
            row["compiled_for"] = isa
        if backend in fp32_bytes:
            row["package_over_fp32_package"] = round(package_bytes / fp32_bytes[backend], 3)
        linears = [c for c in manifest.get("quantization", {}).get("coverage", []) if c["kind"] == "linear"]
        if linears:  # how many linears take rounded activations (--qact int8, int8x2: two int8 terms, or int16)
            for qact in ROUNDED:
                taking = sum(c.get("activations") == qact for c in linears)
                if taking or qact == "int8":
                    row[f"linears_with_{qact}_activations"] = f"{taking}/{len(linears)}"
        for batch in () if args.agreement_only else (1, 8):
            def ours(n: int, batch=batch) -> None:
                generate(runtime, prompts[:batch], n, stop_at_eos=False)

            ours(2)
            seconds = decode_seconds(ours, args.new_tokens, 2)
            tps = batch * (args.new_tokens - 1) / seconds
            row[f"batch{batch}_tokens_per_s"] = round(tps, 2)
            row[f"batch{batch}_over_hf_fp32_batch1"] = round(tps / hf_tps, 3)
            row[f"batch{batch}_weight_read_gbps"] = round(weights_bytes * tps / batch / 1e9, 1)
            if batch == 1:
                floor_ms = weights_bytes / (read_gbps * 1e9) * 1000
                row["batch1_step_over_floor"] = round(1000 / tps / floor_ms, 3)
        result["schemes"][scheme] = row
    emit(result)


if __name__ == "__main__":
    main()
