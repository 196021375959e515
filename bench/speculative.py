"""Speculative decoding against plain greedy decoding, batch 1, one run.

    python bench/speculative.py --package PKG [--draft DRAFT_PKG] [--new-tokens 128]

Prompt lookup runs on 20 prompts whose answers reuse their input (edit this
code, quote a text, extract fields, rewrite a list); with --draft, the draft
package also runs on 10 ordinary chat prompts. Every prompt runs plainly and
speculatively; the tokens must be identical (the script fails otherwise).
Decode time excludes the prompt: (time for P + N tokens) - (time for P + 1
token), best of --repeats. Prints JSON: tokens/s of each mode over all the
prompts of a set, their ratio, the share of drafts kept, and the CPU.

With --bound, also what prompt lookup could reach at best on these prompts:
each static method's step timed here (one session, every row selected), and
the greedy tokens replayed with a lookup that knew, before each step, how
many of its proposals the target would keep and drafted the number that
decodes fastest at those step times (`lookup_bound_speedup`, in step time
alone: no host work). It bounds what any choice of draft widths can do with
lookup's proposals on this model's text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common import cpu_model, emit
from kvexport.runtime import StepEntry, generate, load
from kvexport.runtime.speculative import NgramIndex, Speculation

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
'''

TEXT = (
    "The river rose through the night, and by morning the low fields were under water. Farmers moved their "
    "animals to the hills while engineers checked the old stone bridge. In the town, the bakery stayed open, "
    "the school became a shelter, and volunteers carried sandbags along the main street."
)

RECORD = "Name: Maria Lopez. Email: maria.lopez@example.com. Phone: +34 612 555 019. City: Valencia. Role: head of logistics."

# answers that reuse their input: what prompt lookup is for
LOOKUP_PROMPTS = [
    f"Rename the function mean to average everywhere in this code and print the whole code:\n{CODE}",
    f"Add a docstring to each function and print the whole code:\n{CODE}",
    f"Rewrite this code with type hints and print all of it:\n{CODE}",
    f"Print this code again, unchanged:\n{CODE}",
    f"Change every 'total' to 'acc' in this code and show the result:\n{CODE}",
    f"Copy this text exactly:\n{TEXT}",
    f"Summarise this text, quoting its sentences:\n{TEXT}",
    f"Quote the first two sentences of this text:\n{TEXT}",
    f"Rewrite this text in the past tense, keeping every detail:\n{TEXT}",
    f"Split this text into one sentence per line:\n{TEXT}",
    f"Extract the name, email and phone from this record as JSON:\n{RECORD}",
    f"Write this record as a YAML mapping:\n{RECORD}",
    f"Repeat this record, one field per line:\n{RECORD}",
    f"Turn this record into a markdown table:\n{RECORD}",
    f"Write this record as a Python dict:\n{RECORD}",
    "Sort these words alphabetically and list them: river, bridge, bakery, school, volunteer, sandbag, field, hill, "
    "farmer, engineer, street, town, water, night, morning.",
    "Put each of these items on its own numbered line: apples, pears, bread, milk, eggs, rice, beans, coffee, tea, "
    "butter, cheese, onions.",
    "Convert this list to uppercase: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, kappa.",
    f"Fix any bug in this code and print the corrected code in full:\n{CODE}",
    f"Repeat this text twice:\n{TEXT}",
]

CHAT_PROMPTS = [
    "Give me three tips for learning a new language.",
    "What is the capital of France, and what is it known for?",
    "Explain what a rainbow is to a child.",
    "Write a short poem about the sea.",
    "Why do we have seasons on Earth?",
    "Describe how to make a cup of tea.",
    "What are the benefits of regular exercise?",
    "Tell me a fun fact about octopuses.",
    "How does a bicycle stay upright?",
    "Suggest a name for a small bakery.",
]


def decode_time(run, new_tokens: int, repeats: int) -> tuple[float, list[int]]:
    """Best-of decode seconds (the prompt's step excluded) and the tokens."""
    best, tokens = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run(new_tokens)
        middle = time.perf_counter()
        run(1)
        best = min(best, (middle - start) - (time.perf_counter() - middle))
    return max(best, 1e-9), tokens


def step_seconds(runtime, widths: list[int], repeats: int = 9) -> dict[int, float]:
    """Median seconds of a step of each width, one session over 300 cells."""
    session = runtime.new_session()
    runtime.step([StepEntry(session, list(range(100, 400)))])
    seconds = {}
    for width in widths:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runtime.step([StepEntry(session, [5] * width, True, rows=width)])
            times.append(time.perf_counter() - start)
            runtime.rewind(session, session.length - width)
        seconds[width] = sorted(times)[len(times) // 2]
    runtime.release(session)
    return seconds


def lookup_bound(outputs: list[tuple[list[int], list[int]]], cost: dict[int, float], ngram: int, max_draft: int) -> float:
    """Plain decoding's step time over the best a lookup that knew each
    step's outcome could take (see the module's docstring)."""
    narrowest = lambda tokens: min(n for n in cost if n >= tokens)  # noqa: E731
    plain = best = 0.0
    for prompt, out in outputs:
        index = NgramIndex(prompt + out[:1], ngram)
        t = 1  # the first token comes from the prompt's step
        plain += (len(out) - 1) * cost[narrowest(1)]
        while t < len(out):
            proposal = index.propose(min(max_draft, len(out) - t - 1, max(cost) - 1))
            run = 0
            while run < len(proposal) and proposal[run] == out[t + run]:
                run += 1
            # drafting k of them keeps min(k, run): the fastest k is 0 or one that keeps the whole run
            _, k = max(((min(k, run) + 1) / cost[narrowest(k + 1)], k) for k in range(len(proposal) + 1))
            best += cost[narrowest(k + 1)]
            index.extend(out[t : t + min(k, run) + 1])
            t += min(k, run) + 1
    return plain / best


def compare(runtime, prompts: list[list[int]], new_tokens: int, repeats: int, speculation_of) -> dict:
    plain_s = spec_s = 0.0
    tokens = 0
    drafted = accepted = 0
    outputs = []
    for prompt in prompts:
        plain_t, plain = decode_time(lambda n: generate(runtime, [prompt], n)[0], new_tokens, repeats)
        stats = []

        def speculative(n):
            speculation = speculation_of()
            out = generate(runtime, [prompt], n, speculation=speculation)[0]
            stats.append(speculation.stats)
            return out

        spec_t, fast = decode_time(speculative, new_tokens, repeats)
        if fast != plain:
            raise SystemExit(f"speculative tokens differ from greedy ones on prompt {prompt[:8]}...: {fast} vs {plain}")
        plain_s, spec_s, tokens = plain_s + plain_t, spec_s + spec_t, tokens + len(plain) - 1
        outputs.append((list(prompt), plain))
        drafted += stats[0].drafted
        accepted += stats[0].accepted
    return {
        "prompts": len(prompts),
        "decoded_tokens": tokens,
        "plain_tokens_per_s": round(tokens / plain_s, 1),
        "speculative_tokens_per_s": round(tokens / spec_s, 1),
        "speedup": round(plain_s / spec_s, 2),
        "drafts_kept": round(accepted / drafted, 3) if drafted else None,
    }, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--package", required=True, type=Path)
    parser.add_argument("--draft", type=Path, help="a draft package sharing the tokenizer")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-draft", type=int, default=8)
    parser.add_argument("--limit", type=int, help="run only the first N prompts of each set")
    parser.add_argument("--bound", action="store_true", help="also the best prompt lookup could reach (see above)")
    args = parser.parse_args()

    runtime = load(args.package)
    text = runtime.package.tokenizer()
    encode = lambda prompts: [text.encode(p) for p in prompts[: args.limit]]  # noqa: E731  (the chat template)
    result: dict = {"package": str(args.package), "cpu": cpu_model(), "torch_threads": torch.get_num_threads(),
                    "new_tokens": args.new_tokens, "static_sizes": runtime.static_sizes}
    result["lookup"], outputs = compare(runtime, encode(LOOKUP_PROMPTS), args.new_tokens, args.repeats,
                                        lambda: Speculation("lookup", max_draft=args.max_draft))
    if args.bound:
        cost = step_seconds(runtime, list(runtime.static_sizes))
        result["step_ms"] = {n: round(1e3 * s, 2) for n, s in cost.items()}
        result["lookup_bound_speedup"] = round(lookup_bound(outputs, cost, Speculation().ngram, args.max_draft), 3)
    if args.draft is not None:
        draft = load(args.draft)
        result["draft_package"] = str(args.draft)
        result["draft"], _ = compare(runtime, encode(CHAT_PROMPTS), args.new_tokens, args.repeats,
                                  lambda: Speculation("draft", draft=draft, max_draft=args.max_draft))
    emit(result)


if __name__ == "__main__":
    main()
