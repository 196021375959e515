"""Every forward method against the Hugging Face model, and greedy decoding
against HF generate (fp32)."""

from __future__ import annotations

import pytest
import torch

from helpers import MODEL_BACKENDS, hf_greedy, prompt_of
from kvexport.runtime import generate
from kvexport.runtime.verify import hf_logits, method_logits


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
@pytest.mark.parametrize("prefix_len", [0, 11])
def test_forward_logits_match_hf(model, prefix_len, tiny_runtime, hf_model):
    """Every method of the package (its static sizes and forward_others),
    after an empty and an 11-token history."""
    runtime = tiny_runtime(model)
    prefix = prompt_of(prefix_len, seed=1)
    for method, width in [(f"forward_{n}", n) for n in runtime.static_sizes] + [("forward_others", 13)]:
        tokens = prompt_of(width, seed=2)
        got = method_logits(runtime, method, prefix, tokens)
        want = hf_logits(hf_model(model), prefix + tokens)[prefix_len:]
        assert got.shape == want.shape, method
        assert (got - want).abs().max().item() <= 1e-4, method


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
@pytest.mark.parametrize("prompt_len", [1, 5, 8, 17, 40])  # 40 > max_step_tokens (24): several forwards
def test_greedy_matches_hf_generate(model, prompt_len, tiny_runtime, hf_model):
    prompt = prompt_of(prompt_len, seed=prompt_len)
    want = hf_greedy(hf_model(model), prompt, 32)
    got = generate(tiny_runtime(model), [prompt], 32)[0]
    assert got == want
    assert len(got) == 32 or got[-1] in tiny_runtime(model).eos_ids
