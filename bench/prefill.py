"""Prefill tokens/s of a package for one long prompt, against HF's forward
over the same prompt, in one run.

    python bench/prefill.py --package PKG [--prompt-len 512] [--sessions 16]

The package selects only the last row for the LM head; HF is measured both
as a plain forward (all rows through the LM head) and with logits_to_keep=1.
With --sessions N, also N sessions' prompts of --prompt-len tokens each (a
server's prefill of N new requests): in one step (the runtime's plan splits
it by --max-step-tokens) against one session a step, and HF's forward over
the N prompts as one batch (last rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import best_of, emit
from kvexport.contract.package import WEIGHTS_MEMORY
from kvexport.exporter.sources.models import load_model
from kvexport.runtime import StepEntry, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--package", required=True, type=Path)
    parser.add_argument("--model", help="HF reference (default: the package's source)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", choices=WEIGHTS_MEMORY, default="mapped",
                        help="how the runtime holds the weights (runtime.load's `weights`)")
    parser.add_argument("--hf-slice", type=int, default=0,
                        help="Also time HF's forward over the prompt in slices of this many tokens, through its cache "
                             "(what slicing itself costs: the package's slices are its --max-step-tokens).")
    parser.add_argument("--sessions", type=int, default=1, help="Also time this many sessions' prompts together.")
    parser.add_argument("--profile", action="store_true", help="Also print each run's top operators (torch.profiler self time, ms).")
    args = parser.parse_args()
    manifest = json.loads((args.package / "manifest.json").read_text())
    source = manifest["provenance"]["source"]
    hf = load_model(args.model or source.get("builtin") or source.get("gguf") or source["path"]).model
    runtime = load(args.package, weights=args.weights)
    ids = torch.randint(3, manifest["metadata"]["get_vocab_size"], (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

    def ours() -> None:
        session = runtime.new_session()
        runtime.step([StepEntry(session, ids)])
        runtime.release(session)

    def hf_full() -> None:
        with torch.no_grad():
            hf(torch.tensor([ids]))

    def hf_last() -> None:
        with torch.no_grad():
            hf(torch.tensor([ids]), logits_to_keep=1)

    def hf_sliced() -> None:
        from transformers import DynamicCache

        cache = DynamicCache(config=hf.config)
        with torch.no_grad():
            for start in range(0, len(ids), args.hf_slice):
                hf(torch.tensor([ids[start:start + args.hf_slice]]), past_key_values=cache, use_cache=True,
                   logits_to_keep=1)

    n = args.prompt_len
    ours_s, full_s, last_s = (best_of(f, args.repeats) for f in (ours, hf_full, hf_last))
    sliced = {}
    if args.hf_slice:
        sliced_s = best_of(hf_sliced, args.repeats)
        sliced = {"hf_slice": args.hf_slice, "hf_sliced_last_row_tokens_per_s": round(n / sliced_s, 1),
                  "ratio_over_hf_sliced_last_row": round(sliced_s / ours_s, 3)}
    if args.sessions > 1:
        sliced |= sessions_prefill(runtime, hf, args.sessions, n, manifest["metadata"]["get_vocab_size"], args.repeats)
    profiles = {name: top_operators(f) for name, f in (("package", ours), ("hf_last_row", hf_last))} if args.profile else None
    emit({
        "profile_self_ms": profiles,
        "package": str(args.package),
        "backend": manifest.get("backend", {}).get("id", "portable"),
        "prompt_len": n,
        "package_tokens_per_s": round(n / ours_s, 1),
        "hf_forward_tokens_per_s": round(n / full_s, 1),
        "hf_forward_last_row_tokens_per_s": round(n / last_s, 1),
        "ratio_over_hf_forward": round(full_s / ours_s, 3),
        "ratio_over_hf_last_row": round(last_s / ours_s, 3),
    } | sliced)


def sessions_prefill(runtime, hf, sessions: int, length: int, vocab: int, repeats: int) -> dict:
    """Tokens/s of `sessions` prompts (each its own tokens) prefilled in one
    step, one session a step, and by HF as one batch."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(sessions)]

    def run(together: bool) -> None:
        made = [runtime.new_session() for _ in prompts]
        if together:
            runtime.step([StepEntry(s, p) for s, p in zip(made, prompts)])
        else:
            for s, p in zip(made, prompts):
                runtime.step([StepEntry(s, p)])
        for s in made:
            runtime.release(s)

    def hf_batch() -> None:
        with torch.no_grad():
            hf(torch.tensor(prompts), logits_to_keep=1)

    together_s, apart_s, hf_s = (best_of(f, repeats) for f in (lambda: run(True), lambda: run(False), hf_batch))
    tokens = sessions * length
    return {"sessions": sessions, "sessions_together_tokens_per_s": round(tokens / together_s, 1),
            "sessions_apart_tokens_per_s": round(tokens / apart_s, 1),
            "hf_batch_last_row_tokens_per_s": round(tokens / hf_s, 1),
            "together_over_apart": round(apart_s / together_s, 3), "together_over_hf_batch": round(hf_s / together_s, 3)}


def top_operators(fn, count: int = 8) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    return {e.key: round(e.self_cpu_time_total / 1e3, 1) for e in events}


if __name__ == "__main__":
    main()
