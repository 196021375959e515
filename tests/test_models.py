"""Model sources: Hugging Face directories (sharded, with and without a
tokenizer), unsupported architectures, pickled weights."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from helpers import export_tiny, hf_greedy
from kvexport.cli.main import main
from kvexport.exporter.sources.models import load_model
from kvexport.runtime import generate, load
from kvexport.contract.errors import ModelError

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "the", "moon", "is", "red", "user", ":"]


def save_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), 1031)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}<s> user : {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(str(directory))
    return tok


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    model = load_model("tiny-llama").model
    plain = root / "plain"
    model.save_pretrained(str(plain), max_shard_size="200KB")  # sharded
    with_tok = root / "with_tokenizer"
    model.save_pretrained(str(with_tok))
    save_tokenizer(with_tok)
    return plain, with_tok


def test_sharded_directory_without_tokenizer(model_dirs, tmp_path):
    plain, _ = model_dirs
    assert len(list(plain.glob("*.safetensors"))) > 1
    path = export_tiny(str(plain), tmp_path / "pkg").path
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["tokenizer"] is None
    files = manifest["provenance"]["source"]["files"]
    assert "config.json" in files and any(name.endswith(".safetensors") for name in files)
    prompt = [5, 9, 200, 31]
    assert generate(load(path), [prompt], 16) == [hf_greedy(load_model("tiny-llama").model, prompt, 16)]


def test_directory_with_tokenizer_and_chat_template(model_dirs, tmp_path):
    _, with_tok = model_dirs
    path = export_tiny(str(with_tok), tmp_path / "pkg").path
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["tokenizer"] == {"dir": "tokenizer", "chat_template": True}
    text = load(path).package.tokenizer()
    assert text.encode("the moon is red") == [1, 9, 10, 5, 6, 7, 8]  # through the chat template
    assert text.encode("the moon", chat=False) == [5, 6]
    result = CliRunner().invoke(main, ["generate", str(path), "--prompt", "hello world", "--max-new-tokens", "5", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)["outputs"][0]
    assert out["prompt_ids"] == [1, 9, 10, 3, 4]
    assert isinstance(out["text"], str) and len(out["generated_ids"]) >= 1


def test_unsupported_architecture_fails_before_loading(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ModelError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        load_model(str(tmp_path))


def test_pickled_weights_are_refused(tmp_path):
    load_model("tiny-llama").model.config.save_pretrained(str(tmp_path))
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pytorch_model.bin.*safetensors"):
        load_model(str(tmp_path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path))


def test_model_ids_resolve_through_the_local_hf_cache(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    load_model("tiny-llama").model.save_pretrained(repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("acme/tiny-chat")
    source = loaded.provenance["source"]
    assert source["hf_repo"] == "acme/tiny-chat" and source["revision"] == "0123abcd" and "config.json" in source["files"]
    with pytest.raises(ModelError, match=r"acme/missing: not a local directory, and not in the Hugging Face cache at .*hub"):
        load_model("acme/missing")
