"""Where a decode step's time goes, at 1 and 8 sessions: the runtime's host
work (validation, cell placement, packing, masks) against the method call,
and, for a portable package, the method's operators grouped as the weights'
products, attention and the rest (from torch.profiler).

    python bench/step_parts.py --package PKG [--context 256]

Each session first holds a prompt of `--context` tokens, so attention reads
as many cells as a conversation of that length would.

`host_ms` is a step less its method call, measured in a real decode, where
the method's streaming of the weights has evicted the host's data from the
caches; `host_ms_stubbed` is the same steps with the model's computation
replaced by its first result (for an aoti package, the compiled code's
call), so it is the runtime's own work alone, steadier from run to run.
`host_parts_ms` times some of the host work's parts in the real decode
(HOST_PARTS: validation, cell placement, the pools' views, the masks, the
I/O copies); the rest of `host_ms` is the Python between them.
"""

from __future__ import annotations

import argparse
import copy
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
        parts = timed_parts(runtime)
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        total = (time.perf_counter() - start) / args.steps
        method = in_method[0] / args.steps
        runtime.package.run = run
        untimed_parts(runtime)
        row = {"step_ms": round(total * 1e3, 2), "method_ms": round(method * 1e3, 2),
               "host_ms": round((total - method) * 1e3, 2), "tokens_per_s": round(sessions / total, 1),
               "host_parts_ms": {k: round(v / args.steps * 1e3, 3) for k, v in parts.items()}}
        if manifest.get("backend", {}).get("id", "portable") == "portable":
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            groups = {"products": 0.0, "attention": 0.0, "other": 0.0}
            for event in prof.key_averages():
                key = "products" if event.key in PRODUCTS else "attention" if event.key in ATTENTION else "other"
                groups[key] += event.self_cpu_time_total / 1e3
            row["profiled_ms"] = {k: round(v, 2) for k, v in groups.items()}
        row["host_ms_stubbed"] = round(stubbed_host_seconds(runtime, step, args.steps * 10) * 1e3, 3)
        result[f"sessions_{sessions}"] = row
        for s in live:
            runtime.release(s)
    emit(result)


# the runtime's host work a step, by part: (object's attribute, method) -> label
HOST_PARTS = {("runtime", "_validate"): "validate", ("cache", "make_room"): "make_room", ("cache", "views"): "pool_views",
              ("cache", "masks"): "masks", ("runtime", "_on_device"): "io_copies"}


def timed_parts(runtime) -> dict[str, float]:
    """Times each of HOST_PARTS from now on (seconds, summed), each wrapped
    as an instance attribute over its method; untimed_parts removes them."""
    seconds = dict.fromkeys(HOST_PARTS.values(), 0.0)
    for (owner, name), label in HOST_PARTS.items():
        target = runtime if owner == "runtime" else runtime.cache
        method = getattr(target, name)

        def timed(*a, method=method, label=label, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - start

        setattr(target, name, timed)
    return seconds


def untimed_parts(runtime) -> None:
    for owner, name in HOST_PARTS:
        delattr(runtime if owner == "runtime" else runtime.cache, name)


def stubbed_host_seconds(runtime, step, steps: int) -> float:
    """A step's time with the model's computation answered from a cache
    of its first result. The sessions' lengths grow as in the real steps."""
    package = runtime.package
    saved = dict(package._methods)
    answers: dict = {}

    def stub(name, call):
        def answer(flat):
            key = (name, tuple(flat[0].shape))  # tokens [1, T] (the pools' views grow every step)
            if key not in answers:
                answers[key] = call(flat)
            return list(answers[key])
        return answer

    class Loader:  # a compiled method's loader, answering from the cache
        def __init__(self, name, loader):
            self.boxed_run = stub(name, loader.boxed_run)
            self.get_call_spec = loader.get_call_spec  # torch's own call reads it

    for name, method in saved.items():
        if hasattr(method, "loader"):  # runtime/loader.py's CompiledMethod
            package._methods[name] = copy.copy(method)
            package._methods[name].loader = Loader(name, method.loader)
        else:
            answer = stub(name, lambda flat, m=method: [m(*flat)])
            package._methods[name] = lambda *a, answer=answer: answer(list(a))[0]
    try:
        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) / steps
    finally:
        package._methods.clear()
        package._methods.update(saved)


if __name__ == "__main__":
    main()
