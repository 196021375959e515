"""Greedy continuations of chat prompts against a reference package: for
each package, how many prompts' first `--new-tokens` tokens are the
reference's exactly, and how many tokens each keeps in common with it
before the first difference. Teacher-forced agreement (bench/quant.py)
scores each position on the reference's own history; here one flipped
near-tie changes everything after it, which is what a user reads.

    python bench/greedy_match.py --reference PKG --package LABEL=PKG ... [--new-tokens 32]

The prompts are PROMPTS below (short questions and tasks, each in the
package's chat template), all sessions batched at once.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from common import cpu_model, emit
from kvexport.runtime import generate, load

PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "Write a haiku about the sea.", "What is 12 times 12?", "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.", "What is the boiling point of water in Celsius?",
    "Explain photosynthesis in one sentence.", "What is the largest planet in our solar system?",
    "Translate 'good morning' into Spanish.", "List the days of the week.", "What does a thermometer measure?",
    "Suggest a name for a pet cat.", "Why is the sky blue?", "What is the square root of 81?",
    "Write one sentence about autumn.", "Who painted the Mona Lisa?", "What is the opposite of cold?",
    "How do you make a cup of tea?", "What language is spoken in Brazil?", "Name a fruit that is yellow.",
    "What is the freezing point of water in Fahrenheit?", "Give an example of a mammal that can fly.",
    "What is the main ingredient of guacamole?", "How many continents are there?",
    "Describe a rainbow in a few words.", "What is the chemical symbol for gold?",
    "Recommend a book for a child.", "What do bees make?", "What is 15 plus 27?", "Tell me a fun fact about octopuses.",
]


def matches(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """Identical continuations and the common prefix of each (tokens)."""
    prefixes = []
    for want, got in zip(reference, outputs):
        n = 0
        while n < min(len(want), len(got)) and want[n] == got[n]:
            n += 1
        prefixes.append(n)
    return {"identical": sum(want == got for want, got in zip(reference, outputs)),
            "median_common_prefix": statistics.median(prefixes), "mean_common_prefix": round(statistics.mean(prefixes), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reference", required=True, type=Path)
    parser.add_argument("--package", action="append", default=[], help="LABEL=PKG")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    def continuations(path: Path) -> list[list[int]]:
        runtime = load(path)
        text = runtime.package.tokenizer()
        if text is None:
            parser.error(f"{path} has no tokenizer")
        prompts = [text.encode(p) for p in PROMPTS]
        return generate(runtime, prompts, args.new_tokens, stop_at_eos=True)

    reference = continuations(args.reference)
    result = {"cpu": cpu_model(), "reference": str(args.reference), "prompts": len(PROMPTS),
              "new_tokens": args.new_tokens, "packages": {}}
    for spec in args.package:
        label, _, path = spec.partition("=")
        result["packages"][label] = matches(reference, continuations(Path(path)))
    emit(result)


if __name__ == "__main__":
    main()
