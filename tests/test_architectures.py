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
