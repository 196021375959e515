"""The package's `sample` draws what the host sampler draws (docs/contracts/offgraph_kv-v1.md)."""

from __future__ import annotations

import pytest
import torch

from kvexport.runtime import SamplingConfig, generate, sample, sample_argmax
from kvexport.contract.sampler import params_row
from helpers import AOTI_MODEL, prompt_of

CASES = [
    SamplingConfig(temperature=0.0),
    SamplingConfig(temperature=0.8),
    SamplingConfig(temperature=1.3, top_k=5),
    SamplingConfig(temperature=1.0, top_p=0.9),
    SamplingConfig(temperature=0.7, top_k=40, top_p=0.5),  # top-k takes precedence
    SamplingConfig(temperature=2.0, top_k=1),
]


def rows_for(config: SamplingConfig, seeds: range) -> torch.Tensor:
    return torch.tensor([params_row(config, torch.Generator().manual_seed(s)) for s in seeds], dtype=torch.float32)


@pytest.mark.parametrize("config", CASES, ids=lambda c: f"t{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_package_sampler_equals_host(config, tiny_runtime):
    runtime = tiny_runtime(AOTI_MODEL)
    logits = torch.randn(64, runtime.vocab_size, generator=torch.Generator().manual_seed(3)) * 3
    params = rows_for(config, range(64))
    host = sample(logits, params)
    device = runtime.package.method("sample")(logits, params)
    assert torch.equal(host, device)
    if config.greedy or config.top_k == 1:
        assert torch.equal(host, sample_argmax(logits))
    else:
        assert not torch.equal(host, sample_argmax(logits))  # it really samples


def test_argmax_method_equals_host(tiny_runtime):
    runtime = tiny_runtime(AOTI_MODEL)
    logits = torch.randn(7, runtime.vocab_size)
    assert torch.equal(runtime.package.method("sample_argmax")(logits), sample_argmax(logits))


def test_filters_keep_only_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    top2 = sample(logits, rows_for(SamplingConfig(temperature=5.0, top_k=2), range(200)))
    assert set(top2.tolist()) == {0, 1}
    # softmax(x / 5): p0 ~ .31, p0 + p1 ~ .56: top_p .5 keeps two tokens
    nucleus = sample(logits, rows_for(SamplingConfig(temperature=5.0, top_p=0.5), range(200)))
    assert set(nucleus.tolist()) == {0, 1}
    full = sample(logits, rows_for(SamplingConfig(temperature=5.0), range(200)))
    assert set(full.tolist()) == {0, 1, 2, 3, 4}


def test_coin_edges_clamp_to_kept_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    for coin in (0.0, 0.999999, 1.0):
        params = torch.tensor([[1.0, 1.0, 2.0, coin]])
        assert int(sample(logits, params)[0]) in (0, 1)


@pytest.mark.parametrize("config", CASES[1:4], ids=["temp", "topk", "topp"])
def test_generate_same_tokens_on_device_and_host(config, tiny_runtime):
    prompts = [prompt_of(n, seed=n) for n in (3, 12)]
    on_device = generate(tiny_runtime(AOTI_MODEL), prompts, 20, config, seed=7)
    on_host = generate(tiny_runtime(AOTI_MODEL), prompts, 20, config, seed=7, on_device_sampler=False)
    greedy = generate(tiny_runtime(AOTI_MODEL), prompts, 20)
    assert on_device == on_host
    assert on_device != greedy
    # a prompt's tokens do not depend on its batch neighbours
    assert generate(tiny_runtime(AOTI_MODEL), prompts[:1], 20, config, seed=7)[0] == on_device[0]


def test_invalid_sampling_refused():
    with pytest.raises(Exception, match="top-p"):
        SamplingConfig(temperature=1.0, top_p=0.0).validate()
    with pytest.raises(Exception, match="top-k"):
        SamplingConfig(temperature=1.0, top_k=-1).validate()
