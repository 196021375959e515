"""Reference tokens stored in the package at export: the source model, run
eagerly by its own Hugging Face code in the export's dtype (quantized as the
package is), greedy on a few probe prompts. The package's runtime reruns
them alone and batched (runtime/verify.py, `kvexport verify`), so a package
proves it still computes its model, not only that it keeps its contract.

Probes: the model's chat template on a question (fixed ids when the model
has no tokenizer), a prompt wider than the widest static method (so
forward_others and slicing run), and a short one; the three also run
together as one batch. Each probe keeps its prompt, the greedy tokens, the
margin between the two best logits at each step (a differing token where
the margin is below `tie_margin` is a near-tie, not a failure), and the
five best logits of the first step.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from kvexport.contract.chat_template import render_chat
from kvexport.contract.sections import ReferenceSection

QUESTION = "What is the capital of France?"
TOP = 5
# (tie margin, logit tolerance: atol, rtol) by dtype: the package computes the
# same function with other kernels, so its logits differ in rounding. In bf16
# both sides round: on an Intel Xeon with AMX, SmolLM2's first logits in
# eager bf16 were up to 0.96 from the fp32 model's, the aoti package's up to
# 0.67, in opposite directions, and the two 0.875 apart on a top logit of
# 25.9 (AMD's EPYC had kept them within 0.25 + 2%).
# Int8 activations (--qact int8) round every linear's input to 127 steps a
# block: a rounding difference upstream that moves a value across a half step
# moves it by a whole step, and over 30 layers those flips add up. On
# SmolLM2 the compiled package's first logits differed from the eager
# model's by up to 0.46 on a logit of 24 at 4w and by up to 0.91 at gguf
# (Q4_1 kept, AVX-512 with VNNI), the top logits mostly moving together;
# the portable package, the same arithmetic in another order, by up to 0.20.
# Such packages get bf16's logit tolerances and a wider tie margin; so do
# --qact int8x2 and int16 ones, whose finer steps leave far smaller flips.
TOLERANCES = {"fp32": (0.05, 1e-2, 1e-3), "bf16": (0.5, 0.5, 4e-2), "int8 activations": (1.0, 0.5, 4e-2)}
INT8_ACTIVATIONS = "int8 activations"


def probe_prompts(tokenizer: Any, vocab_size: int, widest_static: int, room: int) -> dict[str, list[int]]:
    """name -> prompt ids, each leaving `room` positions free."""
    gen = torch.Generator().manual_seed(20261130)
    high = max(4, min(vocab_size, 4096))

    def ids(n: int) -> list[int]:
        return torch.randint(3, high, (max(1, n),), generator=gen).tolist()

    chat = None
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        # the source's template is text that runs: rendered with bounded work, as the runtime renders it
        text = render_chat(tokenizer.get_chat_template(), [{"role": "user", "content": QUESTION}],
                           special_tokens=tokenizer.special_tokens_map, name="the source model's chat template")
        chat = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    elif tokenizer is not None:
        chat = [int(t) for t in tokenizer(QUESTION)["input_ids"]]
    prompts = {"chat": chat or ids(12), "wide": ids(widest_static + 3), "short": ids(3)}
    return {name: p[-room:] for name, p in prompts.items()}


@torch.no_grad()
def greedy(model: Any, prompt: list[int], steps: int) -> dict[str, Any]:
    """Greedy tokens from the model's raw logits (no generation-config
    processors), with each step's top-2 margin and the first step's best
    logits."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)  # filled in place, step by step
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    feed = torch.tensor([prompt], device=device)
    tokens, margins, top = [], [], []
    for step in range(steps):
        out = model(feed, use_cache=True, **{name: cache})
        logits = out.logits[0, -1].float().cpu()
        best = torch.topk(logits, TOP)
        if step == 0:
            top = [[int(i), round(float(v), 5)] for v, i in zip(best.values, best.indices)]
        margins.append(round(float(best.values[0] - best.values[1]), 5))
        tokens.append(int(best.indices[0]))
        feed = torch.tensor([[tokens[-1]]], device=device)
    return {"tokens": tokens, "margins": margins, "top": top}


def reference(model: Any, tokenizer: Any, *, dtype: str, steps: int, widest_static: int, context: int,
              int8_activations: bool = False,
              progress: Callable[[str], None] = lambda message: None) -> ReferenceSection:
    vocab = int(model.config.get_text_config().vocab_size)
    room = max(1, context - steps)
    prompts = probe_prompts(tokenizer, vocab, widest_static, room)
    probes = []
    for name, prompt in prompts.items():
        progress(f"reference tokens: probe {name} ({len(prompt)} prompt tokens, {steps} greedy)")
        probes.append({"name": name, "prompt": prompt, **greedy(model, prompt, steps)})
    tie, atol, rtol = TOLERANCES[INT8_ACTIVATIONS if int8_activations else dtype]
    return ReferenceSection(steps, tie, atol, rtol, probes, [p["name"] for p in probes])


def agreement(a: ReferenceSection, tokens_by_probe: dict[str, list[int]]) -> float:
    """Share of reference tokens another model's greedy run agrees with."""
    total = same = 0
    for probe in a.probes:
        other = tokens_by_probe[probe["name"]]
        total += len(probe["tokens"])
        same += sum(x == y for x, y in zip(probe["tokens"], other))
    return round(same / total, 4) if total else 1.0
