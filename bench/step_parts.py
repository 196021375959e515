"""Where a decode step's time goes, at 1 and 8 sessions: the runtime's host
work (validation, cell placement, packing, masks) against the method call,
and, for a portable package, the method's operators grouped as the weights'
products, attention and the rest (from torch.profiler).

    python bench/step_parts.py --package PKG [--context 256]

Each session first holds a prompt of `--context` tokens, so attention reads
as many cells as a conversation of that length would.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from common import cpu_model, emit
from kvexport.runtime import StepEntry, load

PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention", "aten::_softmax")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--package", required=True, type=Path)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    runtime = load(args.package)
    manifest = json.loads((args.package / "manifest.json").read_text())
    vocab = manifest["metadata"]["get_vocab_size"]
    run = runtime.package.run
    result = {"cpu": cpu_model(), "package": str(args.package), "context": args.context}
    for sessions in (1, 8):
        live = [runtime.new_session() for _ in range(sessions)]
        for i, s in enumerate(live):
            prompt = torch.randint(3, vocab, (args.context,), generator=torch.Generator().manual_seed(i)).tolist()
            runtime.step([StepEntry(s, prompt)])
        in_method = [0.0]

        def timed_run(*a, **k):
            start = time.perf_counter()
            out = run(*a, **k)
            in_method[0] += time.perf_counter() - start
            return out

        runtime.package.run = timed_run
        step = lambda: runtime.step([StepEntry(s, [7]) for s in live])  # noqa: E731
        step()
        in_method[0] = 0.0
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        total = (time.perf_counter() - start) / args.steps
        method = in_method[0] / args.steps
        runtime.package.run = run
        row = {"step_ms": round(total * 1e3, 2), "method_ms": round(method * 1e3, 2),
               "host_ms": round((total - method) * 1e3, 2), "tokens_per_s": round(sessions / total, 1)}
        if manifest.get("backend", {}).get("id", "portable") == "portable":
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            groups = {"products": 0.0, "attention": 0.0, "other": 0.0}
            for event in prof.key_averages():
                key = "products" if event.key in PRODUCTS else "attention" if event.key in ATTENTION else "other"
                groups[key] += event.self_cpu_time_total / 1e3
            row["profiled_ms"] = {k: round(v, 2) for k, v in groups.items()}
        result[f"sessions_{sessions}"] = row
        for s in live:
            runtime.release(s)
    emit(result)


if __name__ == "__main__":
    main()
