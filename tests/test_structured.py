"""Structured output (runtime/grammar.py): outputs that follow a JSON schema
or a regex, through generate, the CLI and the serving engine; a schema the
grammar engine refuses is a clear error."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from click.testing import CliRunner

from helpers import drafts_cost_nothing, export_tiny
from kvexport.cli.main import main
from kvexport.contract.errors import KvexportError
from kvexport.contract.sampler import SamplingConfig
from kvexport.exporter.sources.models import load_model
from kvexport.runtime import generate, load
from kvexport.runtime.grammar import Grammar, GrammarError

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
     "maximum": 150}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["colour", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0,
     "maximum": 1}, "y": {"enum": [1, 2]}}, "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
]


@pytest.fixture(autouse=True)
def costless(monkeypatch):
    """The exactness tests check drafts whatever the tiny models' step times
    say (tests/test_step_costs.py tests how costs decide them)."""
    drafts_cost_nothing(monkeypatch)


def byte_tokenizer(directory, vocab_size: int = 1031):
    """A byte-level BPE tokenizer with the tiny models' vocabulary size:
    it spells any text, so JSON, one byte a token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    i = 0
    while len(vocab) < vocab_size:  # words no merge makes: they only decode
        vocab[f"w{i}"] = len(vocab)
        i += 1
    core = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(str(directory))
    return tok


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    source = root / "model"
    load_model("tiny-llama").model.save_pretrained(str(source))
    byte_tokenizer(source)
    return export_tiny(str(source), root / "pkg").path


def test_every_output_validates_against_its_schema(package):
    runtime = load(package)
    text = runtime.package.tokenizer()
    prompts = [text.encode(p, chat=False) for p in ("a person", "a colour", "numbers")]
    for schema in SCHEMAS:
        grammar = Grammar.json_schema(text, schema, runtime.vocab_size, runtime.eos_ids)
        for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, top_k=50)):
            outputs = generate(runtime, prompts, 120, sampling, seed=3, grammar=grammar)
            for out in outputs:
                assert out[-1] in runtime.eos_ids, "the grammar ends each output with an EOS"
                jsonschema.validate(json.loads(text.decode(out)), schema)


def test_a_regex_is_matched_in_full(package):
    runtime = load(package)
    text = runtime.package.tokenizer()
    pattern = r"(yes|no), [0-9]{2,3}!"
    grammar = Grammar.regex(text, pattern, runtime.vocab_size, runtime.eos_ids)
    for out in generate(runtime, [text.encode("x", chat=False)] * 3, 40, SamplingConfig(0.8), seed=1, grammar=grammar):
        assert re.fullmatch(pattern, text.decode(out))


def test_refused_grammars_say_why(package):
    runtime = load(package)
    text = runtime.package.tokenizer()
    with pytest.raises(GrammarError, match="Invalid type"):
        Grammar.json_schema(text, {"type": "strin"}, runtime.vocab_size, runtime.eos_ids)
    with pytest.raises(GrammarError, match="not JSON"):
        Grammar.json_schema(text, "{not json", runtime.vocab_size, runtime.eos_ids)
    with pytest.raises(GrammarError, match="regex"):
        Grammar.regex(text, "a(b", runtime.vocab_size, runtime.eos_ids)
    with pytest.raises(GrammarError, match="no tokenizer"):
        Grammar.json_object(None, runtime.vocab_size, runtime.eos_ids)


def test_batched_masks_are_each_matchers_own(package):
    """The masks of several sessions at once (llguidance's bitmask, unpacked
    here) equal each matcher's own byte-per-token answer, at every state of
    a walk through the grammar; unconstrained rows keep their logits."""
    from kvexport.runtime.grammar import allowed_tokens, apply_masks

    runtime = load(package)
    grammar = Grammar.json_schema(runtime.package.tokenizer(), SCHEMAS[0], runtime.vocab_size, runtime.eos_ids)
    constraints = [grammar.constraint() for _ in range(3)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(12):
        masks = allowed_tokens(constraints)
        for constraint, mask in zip(constraints, masks):
            own = torch.frombuffer(bytearray(constraint.matcher.compute_logit_bias()), dtype=torch.uint8)
            assert torch.equal(mask, own[: runtime.vocab_size] != 0)
        logits = torch.randn(4, runtime.vocab_size, generator=generator)
        masked = apply_masks([constraints[0], None, constraints[1], constraints[2]], logits)
        assert torch.equal(masked[1], logits[1]) and torch.equal(masked[0] > -torch.inf, masks[0])
        for constraint, row in zip(constraints, masked[[0, 2, 3]]):
            if not constraint.matcher.is_stopped():
                constraint.advance(int(torch.argmax(row)))


def test_cli_json_schema_and_regex(package, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS[1]))
    args = ["generate", str(package), "--prompt", "a colour", "--raw", "--max-new-tokens", "60", "--json"]
    result = CliRunner().invoke(main, args + ["--json-schema", str(schema)])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(json.loads(result.stdout)["outputs"][0]["text"]), SCHEMAS[1])
    result = CliRunner().invoke(main, args + ["--regex", "[a-c]{3}"])
    assert result.exit_code == 0 and re.fullmatch("[a-c]{3}", json.loads(result.stdout)["outputs"][0]["text"])
    schema.write_text('{"type": "object", "properties": {"a": {"type": "nope"}}}')
    result = CliRunner().invoke(main, args + ["--json-schema", str(schema)])
    assert result.exit_code == 1 and "JSON schema" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, args + ["--regex", "[a-c]{3}", "--speculative", "lookup"])
    assert result.exit_code == 0 and re.fullmatch("[a-c]{3}", json.loads(result.stdout)["outputs"][0]["text"])


def test_the_engine_follows_each_requests_schema(package):
    """Constrained and free requests batched together: each constrained
    choice validates, and a free one is what it would be alone."""
    from kvexport.runtime import OffgraphKVManager
    from kvexport.runtime.server.engine import Engine, GenerationRequest
    from test_engine import run_all

    runtime = load(package)
    text = runtime.package.tokenizer()
    prompt = text.encode("describe", chat=False)
    grammars = [Grammar.json_schema(text, s, runtime.vocab_size, runtime.eos_ids) for s in SCHEMAS]
    free = generate(OffgraphKVManager(runtime.package), [prompt], 20)[0]
    engine = Engine(OffgraphKVManager(runtime.package), text, max_sessions=8)
    try:
        requests = [GenerationRequest(prompt, 120, SamplingConfig(0.9), seed=i, n=2, grammar=g) for i, g in enumerate(grammars)]
        sinks = run_all(engine, requests + [GenerationRequest(prompt, 20)])
        for sink, schema in zip(sinks, SCHEMAS):
            for choice in (0, 1):
                jsonschema.validate(json.loads(text.decode(sink.tokens(choice))), schema)
        assert sinks[-1].tokens() == free
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ with speculative decoding
def test_masks_after_drafts_are_each_states_own(package):
    """The masks llguidance computes after each draft in one call equal
    consuming the drafts one by one; the rows past a refused draft allow
    everything; the matcher ends where it began; the cut keeps the drafts up
    to the first refused one."""
    from kvexport.runtime.grammar import allowed_after_drafts, allowed_tokens, valid_drafts

    runtime = load(package)
    text = runtime.package.tokenizer()
    grammar = Grammar.json_schema(text, SCHEMAS[1], runtime.vocab_size, runtime.eos_ids)
    good = text.encode('{"colour":"red"', chat=False)
    bad = good[:3] + [text.encode("z", chat=False)[0]] + good[3:5]
    walker, other = grammar.constraint(), grammar.constraint()
    other.advance(good[0])
    masks = allowed_after_drafts([walker, other], [good, bad[1:]])
    assert [m.shape[0] for m in masks] == [len(good) + 1, len(bad)]
    for j, token in enumerate(good):
        assert torch.equal(masks[0][j], allowed_tokens([walker])[0])
        walker.advance(token)
    assert torch.equal(masks[0][-1], allowed_tokens([walker])[0])
    assert torch.equal(masks[1][0], allowed_tokens([other])[0])
    assert masks[1][3:].all(), "past the refused draft (position 2 of other's) nothing is masked"
    assert not masks[1][2].all()
    fresh = grammar.constraint()
    assert valid_drafts([fresh, None], [bad, bad]) == [bad[:3], bad]
    assert allowed_after_drafts([fresh], [bad[:3]])[0].shape[0] == 4 and torch.equal(
        allowed_tokens([fresh])[0], allowed_tokens([grammar.constraint()])[0]), "the matcher ends where it began"


def constrained_oracle(monkeypatch, want: dict, grammar: Grammar, free: tuple = ()):
    """NgramIndex.propose replaced by an oracle: the constrained greedy
    continuation, with a wrong token the grammar allows in one round of
    three, one it refuses in one of five, and a token past the end every
    fourth (for the `free` prompts, any other token); `calls` holds the
    length of every proposal."""
    import kvexport.runtime.speculative as spec
    from kvexport.runtime.grammar import allowed_tokens

    calls = []

    def oracle(self, k):
        prompt = next(p for p in want if list(p) == self.tokens[: len(p)])
        done = len(self.tokens) - len(prompt)
        drafts = list(want[prompt][done : done + k])
        if len(calls) % 3 == 2 and len(drafts) > 1 and prompt in free:
            drafts[1] = (drafts[1] + 7) % grammar.vocab_size
        elif len(calls) % 3 == 2 and len(drafts) > 1:
            walker = grammar.constraint()
            for token in want[prompt][: done + 1]:
                walker.advance(token)
            drafts[1] = next((t for t in allowed_tokens([walker])[0].nonzero().flatten().tolist() if t != drafts[1]),
                             drafts[1])
        if len(calls) % 5 == 4 and drafts:
            drafts[0] = (drafts[0] + 1) % grammar.vocab_size
        if len(calls) % 4 == 3:
            drafts.append(5)
        calls.append(len(drafts[:k]))
        return drafts[:k]

    monkeypatch.setattr(spec.NgramIndex, "propose", oracle)
    return calls


def test_speculation_under_a_grammar_gives_its_greedy_tokens(package, monkeypatch):
    """Greedy constrained decoding with drafts (an oracle's with wrong
    tokens, and the same package as its own draft) gives exactly the tokens
    of constrained decoding one token a step, alone and batched; sampled
    outputs with drafts validate."""
    from kvexport.runtime.speculative import Speculation

    runtime = load(package)
    text = runtime.package.tokenizer()
    prompts = [text.encode(p, chat=False) for p in ("a person", "someone else", "x")]
    grammar = Grammar.json_schema(text, SCHEMAS[0], runtime.vocab_size, runtime.eos_ids)
    plain = [generate(runtime, [p], 60, grammar=grammar)[0] for p in prompts]
    speculation = Speculation("draft", draft=load(package))
    assert generate(runtime, prompts, 60, grammar=grammar, speculation=speculation) == plain
    assert speculation.stats.accepted > 0
    calls = constrained_oracle(monkeypatch, {tuple(p): w for p, w in zip(prompts, plain)}, grammar)
    lookup = Speculation("lookup")
    assert generate(runtime, prompts, 60, grammar=grammar, speculation=lookup) == plain
    assert lookup.stats.accepted > 0 and lookup.stats.drafted > lookup.stats.accepted, "the target refused some"
    assert sum(calls) > lookup.stats.drafted, "the grammar cut some drafts before the step"
    assert [generate(runtime, [p], 60, grammar=grammar, speculation=Speculation("lookup"))[0] for p in prompts] == plain
    monkeypatch.undo()
    for out in generate(runtime, prompts, 80, SamplingConfig(1.0, top_k=40), seed=4, grammar=grammar,
                        speculation=Speculation("draft", draft=load(package))):
        jsonschema.validate(json.loads(text.decode(out)), SCHEMAS[0])


def test_the_engine_speculates_under_a_grammar_and_with_logprobs(package, monkeypatch):
    """In the serving engine with drafts: a constrained request gives its
    greedy constrained tokens, and a request for logprobs the tokens and
    log-probabilities it gets without speculation."""
    from kvexport.runtime import OffgraphKVManager
    from kvexport.runtime.server.engine import Engine, GenerationRequest
    from kvexport.runtime.speculative import Speculation
    from test_engine import run_all

    runtime = load(package)
    text = runtime.package.tokenizer()
    prompts = [text.encode(p, chat=False) for p in ("a person", "someone else")]
    grammar = Grammar.json_schema(text, SCHEMAS[0], runtime.vocab_size, runtime.eos_ids)
    requests = [GenerationRequest(prompts[0], 60, grammar=grammar), GenerationRequest(prompts[1], 24, logprobs=3)]

    def serve(speculation):
        engine = Engine(OffgraphKVManager(runtime.package), text, max_sessions=4, speculation=speculation)
        try:
            return run_all(engine, requests)
        finally:
            engine.shutdown()

    plain = serve(None)
    want = {tuple(r.prompt): s.tokens() for r, s in zip(requests, plain)}
    constrained_oracle(monkeypatch, want, grammar, free=(tuple(prompts[1]),))
    speculation = Speculation("lookup")
    drafted = serve(speculation)
    assert [s.tokens() for s in drafted] == [s.tokens() for s in plain]
    assert speculation.stats.accepted > 0
    jsonschema.validate(json.loads(text.decode(drafted[0].tokens())), SCHEMAS[0])

    def logprobs(sink):
        return [lp for e in sink.events if getattr(e, "logprobs", None) for lp in e.logprobs]

    got, expected = logprobs(drafted[1]), logprobs(plain[1])
    assert len(got) == len(expected) == 24
    for a, b in zip(got, expected):
        assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_openai_response_format_is_parsed_or_refused():
    from kvexport.runtime.server import openai_api as api

    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert api.parse_chat(body).response_format == ("text", None)
    assert api.parse_chat({**body, "response_format": {"type": "json_object"}}).response_format == ("json_object", None)
    schema = SCHEMAS[0]
    parsed = api.parse_chat({**body, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
    assert parsed.response_format == ("json_schema", schema)
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": "nope"}):
        with pytest.raises(api.ApiError, match="response_format"):
            api.parse_chat({**body, "response_format": bad})


def test_serve_answers_a_json_schema_and_refuses_a_bad_one(package):
    """Over HTTP (completions with response_format, as vLLM and llama.cpp's
    servers take it): the text validates; a schema the engine refuses is a
    400 that names response_format."""
    from test_serve import KEY, Server

    server = Server(package, "--api-key", KEY, "--speculative", "lookup")
    try:
        schema = SCHEMAS[0]
        body = {"prompt": "someone", "max_tokens": 80, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
        status, _, raw = server.post("/v1/completions", body)
        reply = json.loads(raw)
        assert status == 200, reply
        jsonschema.validate(json.loads(reply["choices"][0]["text"]), schema)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}}
        status, _, raw = server.post("/v1/completions", body)
        reply = json.loads(raw)
        assert status == 400 and reply["error"]["param"] == "response_format" and "schema" in reply["error"]["message"]
    finally:
        assert server.stop() == 0, "".join(server.log)


def test_a_draft_with_another_tokenizer_is_refused(package):
    """The draft check reads the manifest's own entries for the tokenizer
    folder: the same package passes, one whose tokenizer.json digest differs
    is refused by name, and its chat template alone may differ."""
    import copy
    from types import SimpleNamespace

    from kvexport.runtime.speculative import check_draft

    target = load(package)
    check_draft(target, target)

    def edited(suffix):
        manifest = copy.deepcopy(target.package.manifest)
        name = next(n for n in manifest["files"] if n.endswith(suffix))
        manifest["files"][name]["sha256"] = "0" * 64
        return SimpleNamespace(batches_sessions=True, vocab_size=target.vocab_size,
                               package=SimpleNamespace(manifest=manifest))

    with pytest.raises(KvexportError, match="tokenizer differs.*tokenizer/tokenizer.json"):
        check_draft(target, edited("tokenizer.json"))
