"""Verifying a package against the Hugging Face model it came from: each
forward method's logits, and greedy tokens against HF `generate`."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvexport.contract.offgraph_kv import ForwardInputs
from kvexport.runtime import OffgraphKVManager, StepEntry, generate
from kvexport.runtime.cell_cache import sequence_bit


def method_logits(runtime: OffgraphKVManager, method: str, prefix: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """Feeds `prefix` through the runtime, then `tokens` through `method`
    itself with every row selected; returns logits [len(tokens), V]. The
    session is released afterwards."""
    session = runtime.new_session()
    try:
        if prefix:
            runtime.step([StepEntry(session, list(prefix), wants_logits=False)])
        cache = runtime.cache
        cache.check_step({session.seq: len(tokens)})
        cells, positions = cache.place([session.seq] * len(tokens))
        n_cells = cache.read_len()
        masks = cache.masks(torch.full((len(tokens),), sequence_bit(session.seq)), positions, n_cells)
        with torch.inference_mode():
            inputs = ForwardInputs(
                torch.tensor([list(tokens)]), positions, torch.arange(len(tokens)), cache.views(n_cells), cells, masks
            )
            return runtime.package.method(method)(*inputs.pack())
    finally:
        runtime.release(session)


def hf_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)], device=model.device)).logits[0].float().cpu()


def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([list(prompt)], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def method_widths(runtime: OffgraphKVManager) -> dict[str, int]:
    """A width each forward method takes: N for forward_N, and one past the
    widest static size for forward_others."""
    widths = {f"forward_{n}": n for n in runtime.static_sizes}
    if runtime.others_min_tokens is not None:
        widths["forward_others"] = runtime.others_min_tokens
    return widths


def verify(runtime: OffgraphKVManager, model: Any, prompts: Sequence[Sequence[int]], new_tokens: int = 32) -> dict[str, Any]:
    """Max |logits - HF| per method (after a prefix of the first prompt), and
    whether greedy tokens equal HF `generate` for every prompt, alone and
    batched."""
    prefix = list(prompts[0])
    diffs = {}
    for method, width in method_widths(runtime).items():
        tokens = [(7 * i + 3) % runtime.vocab_size for i in range(width)]
        got = method_logits(runtime, method, prefix, tokens).cpu()
        want = hf_logits(model, prefix + tokens)[len(prefix) :]
        diffs[method] = float((got - want).abs().max())
    want = [hf_greedy(model, p, new_tokens) for p in prompts]
    alone = [generate(runtime, [p], new_tokens)[0] for p in prompts]
    batched = generate(runtime, prompts, new_tokens)
    return {
        "max_abs_logits_diff": diffs,
        "greedy_equal_alone": alone == want,
        "greedy_equal_batched": batched == want,
        "hf_tokens": want,
        "tokens": batched,
    }
