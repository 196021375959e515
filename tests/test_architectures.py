"""Every supported decoder family against Hugging Face, on the tiny random
configs of exporter/sources/architectures.py; sliding windows; refusals."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers import export_tiny, hf_greedy, prompt_of
from kvexport.cli.main import main
from kvexport.exporter.sources.architectures import ARCHITECTURES
from kvexport.exporter.sources.models import load_model
from kvexport.runtime.verify import verify
from kvexport.runtime import generate, load
from kvexport.contract.errors import CapacityError, ModelError

FAMILIES = sorted(ARCHITECTURES)
WINDOWS = {
    "MistralForCausalLM": [8, 8],
    "Gemma2ForCausalLM": [8, 0],
    "Gemma3ForCausalLM": [8, 8, 0],
    "Starcoder2ForCausalLM": [8, 8],
}


@pytest.fixture(scope="module")
def family(tiny_package, hf_model):
    def get(name: str):
        builtin = f"tiny-{ARCHITECTURES[name].key}"
        return tiny_package(builtin), hf_model(builtin)

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_hf(name, family):
    path, hf = family(name)
    report = verify(load(path), hf, [prompt_of(20, seed=1), prompt_of(5, seed=2), prompt_of(30, seed=3)], 32)
    assert set(report["max_abs_logits_diff"]) == {"forward_1", "forward_4", "forward_others"}
    assert max(report["max_abs_logits_diff"].values()) <= 1e-4, report["max_abs_logits_diff"]
    assert report["greedy_equal_alone"] and report["greedy_equal_batched"]


@pytest.mark.parametrize("name", FAMILIES)
def test_geometry_in_the_manifest(name, family):
    path, hf = family(name)
    md = json.loads((path / "manifest.json").read_text())["metadata"]
    config = hf.config
    assert md["architecture"] == name
    assert md["get_n_caches"] == config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert md["get_head_dims"] == [head_dim] * config.num_hidden_layers
    assert md["get_kv_heads"] == [config.num_key_value_heads] * config.num_hidden_layers
    assert md["get_windows"] == WINDOWS.get(name, [0] * config.num_hidden_layers)
    masks = [i for i in json.loads((path / "manifest.json").read_text())["methods"]["forward_1"]["inputs"] if i["role"] == "kv_mask"]
    assert [m["window"] for m in masks] == sorted(set(md["get_windows"]))


def test_the_shapes_cover_the_cases():
    """GQA ratios 1, 2, 3 and multi-query; head_dim != hidden / heads; tied and untied."""
    configs = [load_model(f"tiny-{a.key}").model.config for a in ARCHITECTURES.values()]
    ratios = {c.num_attention_heads // c.num_key_value_heads for c in configs}
    assert {1, 2, 3} <= ratios and any(c.num_key_value_heads == 1 for c in configs)
    assert any(getattr(c, "head_dim", None) not in (None, c.hidden_size // c.num_attention_heads) for c in configs)
    assert {bool(c.tie_word_embeddings) for c in configs} == {True, False}


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_far_past_the_window(name, family):
    path, hf = family(name)
    prompt = prompt_of(12, seed=9)  # window 8: prompt and 60 new tokens span it 9 times
    assert generate(load(path), [prompt], 60) == [hf_greedy(hf, prompt, 60)]


@pytest.mark.parametrize("name", ["Gemma2ForCausalLM", "LlamaForCausalLM"])
def test_filling_the_context_to_its_limit(name, tmp_path):
    builtin = f"tiny-{ARCHITECTURES[name].key}"
    path = export_tiny(builtin, tmp_path / "pkg", max_context_len=48).path
    runtime = load(path)
    prompt = prompt_of(16, seed=5)
    got = generate(runtime, [prompt], 32, stop_at_eos=False)[0]
    hf = load_model(builtin).model
    ids = __import__("torch").tensor([prompt])
    want = hf.generate(ids, attention_mask=ids * 0 + 1, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 16:].tolist()
    assert got == want
    with pytest.raises(CapacityError, match="context of 48"):
        generate(runtime, [prompt], 33)


def save_config(tmp_path, config_class: str, arch: str, **kw):
    import transformers

    getattr(transformers, config_class)(architectures=[arch], **kw).save_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    return tmp_path


@pytest.mark.parametrize(
    "config_class,arch,reason",
    [
        ("MixtralConfig", "MixtralForCausalLM", "mixture-of-experts routing"),
        ("MambaConfig", "MambaForCausalLM", "recurrent state-space layers"),
        ("GPT2Config", "GPT2LMHeadModel", None),
    ],
)
def test_unservable_architectures_fail_before_any_work(tmp_path, config_class, arch, reason):
    path = save_config(tmp_path, config_class, arch)
    with pytest.raises(ModelError) as error:
        load_model(str(path))
    message = str(error.value)
    assert arch in message and "supported: " in message and "Starcoder2ForCausalLM" in message
    if reason:
        assert reason in message


def test_list_architectures():
    result = CliRunner().invoke(main, ["export", "--list-architectures"])
    assert result.exit_code == 0
    assert all(name in result.stdout for name in ARCHITECTURES)
    assert "tiny-gemma3" in result.stdout


@pytest.mark.parametrize("group", [1, 3])
def test_attention_as_products_equals_sdpa(group):
    """The products over the pools (CUDA's attention, and Gemma 2's with its
    soft-cap) attend as sdpa does over a masked pool."""
    import torch

    from kvexport.exporter.forwards import _attend_products

    generator = torch.Generator().manual_seed(group)
    kv_heads, tokens, cells, dim = 2, 5, 13, 16
    query = torch.randn(1, kv_heads * group, tokens, dim, generator=generator)
    k_pool, v_pool = (torch.randn(cells, kv_heads, dim, generator=generator) for _ in "kv")
    mask = torch.rand(tokens, cells, generator=generator) > 0.4
    mask[:, 3] = True
    ours = _attend_products(query, k_pool, v_pool, mask, None, None)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        query, k_pool.permute(1, 0, 2)[None], v_pool.permute(1, 0, 2)[None], attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-gemma"])
def test_the_products_path_matches_hf(arch, tmp_path, monkeypatch, hf_model):
    """CUDA's attention (products over the pools, no sdpa), traced at every
    width and run here on the CPU: a kv head for 2 query heads, for 1, and
    for all 4 (multi-query)."""
    from kvexport.exporter import forwards

    monkeypatch.setattr(forwards, "_sdpa_attends", lambda query, softcap: False)
    path = export_tiny(arch, tmp_path / "pkg").path
    report = verify(load(path), hf_model(arch), [prompt_of(20, seed=1), prompt_of(5, seed=2)], 16)
    assert max(report["max_abs_logits_diff"].values()) <= 1e-4, report["max_abs_logits_diff"]
    assert report["greedy_equal_alone"] and report["greedy_equal_batched"]
