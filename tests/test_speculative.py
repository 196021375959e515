"""Speculative decoding (runtime/speculative.py): greedy tokens identical to
plain decoding with prompt lookup and with a draft package, alone and
batched; rejected drafts leave the cell pool as plain decoding would; the
accept/reject rule keeps the target's distribution."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from helpers import drafts_cost_nothing, prompt_of
from kvexport.cli.main import main
from kvexport.contract.errors import KvexportError
from kvexport.contract.sampler import SamplingConfig, draw, probabilities
from kvexport.runtime import StepEntry, generate, load
from kvexport.runtime.speculative import Drafting, NgramIndex, Speculation, accept


@pytest.fixture(autouse=True)
def costless(monkeypatch):
    """The exactness tests check drafts whatever the tiny models' step times
    say (tests/test_step_costs.py tests how costs decide them)."""
    drafts_cost_nothing(monkeypatch)


def runtime_of(tiny_package, model, **recipe):
    return load(tiny_package(model, **recipe))


def repetitive(length: int, seed: int) -> list[int]:
    """A prompt that repeats itself, so prompt lookup has something to find."""
    part = prompt_of(length // 3 + 1, seed=seed)
    return (part * 3)[:length]


PROMPTS = [repetitive(30, 1), prompt_of(5, seed=2), repetitive(13, 3)]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])  # mistral: a window of 8 cells
def test_lookup_gives_greedy_tokens_alone_and_batched(tiny_package, model):
    runtime = runtime_of(tiny_package, model)
    want = [generate(runtime, [p], 40)[0] for p in PROMPTS]
    speculation = Speculation("lookup")
    assert generate(runtime, PROMPTS, 40, speculation=speculation) == want
    assert [generate(runtime, [p], 40, speculation=Speculation("lookup"))[0] for p in PROMPTS] == want
    assert speculation.stats.drafted > 0  # drafts were really checked (random weights rarely repeat, so few are kept)
    assert runtime.cache.next_pos == {} and runtime.cache.free_cells == runtime.cache.max_cells - 1


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-mistral"])
def test_drafts_that_agree_are_kept_and_save_steps(tiny_package, model, monkeypatch):
    """An oracle proposes the greedy continuation, spoiling one draft in
    three rounds: the kept prefixes and the target's own tokens still make
    exactly the greedy tokens, in fewer steps than tokens."""
    import kvexport.runtime.speculative as spec

    runtime = runtime_of(tiny_package, model)
    prompt = prompt_of(11, seed=8)  # mistral's window is 8 cells: the drafts cross it
    want = generate(runtime, [prompt], 30)[0]
    calls = []

    def oracle(self, k):
        done = len(self.tokens) - len(prompt)
        calls.append(k)
        drafts = want[done : done + k]
        if len(calls) % 3 == 0 and drafts:
            drafts[-1] = (drafts[-1] + 1) % runtime.vocab_size
        return drafts

    monkeypatch.setattr(spec.NgramIndex, "propose", oracle)
    steps = []
    original = runtime.step
    monkeypatch.setattr(runtime, "step", lambda entries: steps.append(len(entries)) or original(entries))
    speculation = Speculation("lookup")
    assert generate(runtime, [prompt], 30, speculation=speculation) == [want]
    assert speculation.stats.accepted >= speculation.stats.drafted // 2 > 0
    assert len(steps) < 20  # one step per token without drafts: 30


def test_a_draft_catches_up_on_each_prompt_in_a_step_of_its_own(tiny_package):
    """A draft's feed of a prompt runs alone (in one step, each prompt's
    rows would be scored against every prompt's cells)."""
    target = runtime_of(tiny_package, "tiny-llama")
    draft = runtime_of(tiny_package, "tiny-llama", qlinear="8w", qembedding="8w")
    steps = []
    original = draft.step
    draft.step = lambda entries: steps.append(sorted(len(e.tokens) for e in entries)) or original(entries)
    prompts = [prompt_of(20, seed=s) for s in (1, 2, 3)]
    want = [generate(target, [p], 6)[0] for p in prompts]
    assert generate(target, prompts, 6, speculation=Speculation("draft", draft=draft)) == want
    catching_up = [widths for widths in steps if max(widths) > 8]
    assert len(catching_up) >= 2 and all(len(widths) == 1 for widths in catching_up), steps


def test_a_draft_package_gives_greedy_tokens(tiny_package):
    target = runtime_of(tiny_package, "tiny-llama")
    draft = runtime_of(tiny_package, "tiny-llama", qlinear="8w", qembedding="8w")  # the same model, quantized
    want = [generate(target, [p], 32)[0] for p in PROMPTS]
    speculation = Speculation("draft", draft=draft)
    assert generate(target, PROMPTS, 32, speculation=speculation) == want
    assert [generate(target, [p], 32, speculation=Speculation("draft", draft=draft))[0] for p in PROMPTS] == want
    assert speculation.stats.acceptance > 0.5
    assert draft.cache.next_pos == {}  # the draft's sessions went with the target's


def test_the_same_package_as_its_own_draft_keeps_every_draft(tiny_package):
    target, draft = runtime_of(tiny_package, "tiny-qwen2"), runtime_of(tiny_package, "tiny-qwen2")
    prompt = prompt_of(9, seed=4)
    speculation = Speculation("draft", draft=draft)
    assert generate(target, [prompt], 30, speculation=speculation) == generate(target, [prompt], 30)
    assert speculation.stats.drafted > 0 and speculation.stats.accepted == speculation.stats.drafted


def test_refused_drafts_leave_the_cells_as_plain_decoding_does(tiny_package, monkeypatch):
    """Every draft refused: each round rewinds its cells, and at the end
    the pool holds what plain decoding leaves (same cells in use, same
    positions per session), the tokens unchanged."""
    import kvexport.runtime.speculative as spec

    runtime = runtime_of(tiny_package, "tiny-llama")
    prompt = prompt_of(7, seed=5)
    want = generate(runtime, [prompt], 12)[0]
    vocab = runtime.vocab_size
    monkeypatch.setattr(spec.NgramIndex, "propose", lambda self, k: [(self.tokens[-1] + 1 + i) % vocab for i in range(k)])
    states = []
    original = runtime.rewind

    def rewind(session, pos):
        original(session, pos)
        owned = (runtime.cache.owners & (1 << session.seq)) != 0
        states.append((session.length, sorted(runtime.cache.positions[owned].tolist()), int(owned.sum())))

    monkeypatch.setattr(runtime, "rewind", rewind)
    speculation = Speculation("lookup")
    assert generate(runtime, [prompt], 12, speculation=speculation) == [want]
    assert speculation.stats.drafted > 0
    for length, positions, cells in states:  # after every round: the prompt and the tokens fed, nothing else
        assert positions == list(range(length)) and cells == length
    assert runtime.cache.next_pos == {}


def test_rows_of_a_step_entry(tiny_package):
    """A step entry may ask for the logits of its last several tokens; they
    equal the logits of those positions fed one at a time."""
    runtime = runtime_of(tiny_package, "tiny-llama")
    tokens = prompt_of(6, seed=6)
    s = runtime.new_session()
    rows = runtime.step([StepEntry(s, tokens, True, rows=3)])[0]
    assert rows.shape == (3, runtime.vocab_size)
    runtime.release(s)
    one = runtime.new_session()
    singles = [runtime.step([StepEntry(one, tokens[:4])])[0]] + [runtime.step([StepEntry(one, [t])])[0] for t in tokens[4:]]
    assert torch.allclose(rows, torch.stack(singles), atol=1e-5)
    runtime.release(one)
    with pytest.raises(KvexportError, match="rows"):
        runtime.step([StepEntry(runtime.new_session(), tokens, True, rows=7)])


def test_lookup_drafts_grow_into_the_padding_of_the_steps_method():
    """allot: widths first (the surest drafter first, within the step's
    spare width and each room); with the static sizes, the drafts then fill
    the narrowest method that holds the step, never past `width` or a room."""
    from kvexport.runtime.speculative import allot

    def states(*widths):
        return [Drafting(NgramIndex([], 3), torch.Generator(), width=w) for w in widths]

    assert allot(states(1), [100], 8) == [1]
    assert allot(states(1), [100], 8, sizes=[1, 8]) == [7], "a lone session on forward_8 checks 7 drafts"
    assert allot(states(1), [100], 8, sizes=[1, 2, 4, 8]) == [1], "a step of 2 tokens already fills forward_2"
    assert allot(states(2), [100], 8, sizes=[1, 2, 4, 8]) == [3], "3 tokens run on forward_4: one more draft"
    assert allot(states(2, 1), [1, 100], 8, sizes=[1, 8]) == [1, 5], "rooms cap it; the rest goes to the others"
    assert allot(states(4, 4, 4), [100] * 3, 8, sizes=[1, 8]) == [4, 1, 0], "over the width: no padding"
    assert allot(states(1), [100], 6, sizes=[1, 8]) == [1], "forward_8 is past the width drafts may fill"


def test_ngram_index_proposes_what_followed_the_latest_occurrence():
    index = NgramIndex([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2], ngram=3)
    assert index.propose(3) == [3, 7, 5]  # "1 2" last began at 4, followed by 3 7 5
    index.extend([3])
    assert index.propose(2) == [7, 5]  # "1 2 3" at 4
    assert NgramIndex([4, 5, 6], ngram=3).propose(4) == []  # nothing recurs


@pytest.mark.parametrize("with_q", [False, True])
def test_accept_reject_keeps_the_target_distribution(with_q):
    """Over many draws from fixed distributions, the first emitted token is
    distributed as p, whatever the draft proposed."""
    torch.manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(2, vocab), dim=-1)
    q = torch.softmax(torch.randn(1, vocab), dim=-1) if with_q else None
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    draws = 20000
    for _ in range(draws):
        d = draw(q[0], float(torch.rand((), generator=generator))) if with_q else 2
        counts[accept(p, [d], q, generator)[0]] += 1
    assert float((counts / draws - p[0]).abs().sum()) / 2 < 0.015  # total variation


def test_probabilities_are_what_the_sampler_draws_from():
    torch.manual_seed(3)
    logits = torch.randn(1, 50)
    for config in (SamplingConfig(0.7), SamplingConfig(1.0, top_k=5), SamplingConfig(0.9, top_p=0.6)):
        p = probabilities(logits, config)[0]
        assert abs(float(p.sum()) - 1) < 1e-5
        kept = set(torch.nonzero(p).squeeze(1).tolist())
        if config.top_k:
            assert len(kept) == config.top_k
        for coin in torch.linspace(0, 0.999, 37).tolist():
            params = torch.tensor([[config.temperature, config.top_p, float(config.top_k), coin]])
            from kvexport.contract.sampler import sample

            assert draw(p, coin) == int(sample(logits, params)[0])


def test_sampling_with_lookup_runs_and_repeats_with_its_seed(tiny_package):
    runtime = runtime_of(tiny_package, "tiny-llama")
    config = SamplingConfig(temperature=0.8, top_k=20)
    a = generate(runtime, PROMPTS, 20, config, seed=3, speculation=Speculation("lookup"))
    b = generate(runtime, PROMPTS, 20, config, seed=3, speculation=Speculation("lookup"))
    assert a == b and all(len(x) == 20 or x[-1] in runtime.eos_ids for x in a)


def test_cli_speculative_lookup_and_draft(tiny_package):
    target, draft = tiny_package("tiny-llama"), tiny_package("tiny-llama", qlinear="8w", qembedding="8w")
    args = ["generate", str(target), "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "16", "--json"]
    plain = json.loads(CliRunner().invoke(main, args).stdout)["outputs"]
    for extra in (["--speculative", "lookup"], ["--draft", str(draft)]):
        result = CliRunner().invoke(main, args + extra)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["outputs"][0]["generated_ids"] == plain[0]["generated_ids"]


def test_cli_refuses_a_draft_it_cannot_use(tiny_package):
    target = tiny_package("tiny-llama")
    args = ["generate", str(target), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]
    result = CliRunner().invoke(main, args + ["--speculative", "draft"])
    assert result.exit_code == 1 and "--draft" in result.output
    single = tiny_package("tiny-llama", contract="ingraph_kv", use_offgraph_kv_cache=False, max_step_tokens=16, max_context_len=128)
    result = CliRunner().invoke(main, ["generate", str(single), "--prompt-ids", "1,2,3", "--speculative", "lookup"])
    assert result.exit_code == 1 and "offgraph_kv" in result.output
    result = CliRunner().invoke(main, args + ["--draft", str(single)])
    assert result.exit_code == 1 and "offgraph_kv" in result.output


def test_a_draft_must_speak_the_targets_tokens(tiny_package):
    from types import SimpleNamespace

    from kvexport.runtime.speculative import check_draft

    target = runtime_of(tiny_package, "tiny-llama")

    def stub(vocab, tokenizer_sha=None):
        files = {"tokenizer/tokenizer.json": {"sha256": tokenizer_sha}} if tokenizer_sha else {}
        return SimpleNamespace(batches_sessions=True, vocab_size=vocab, package=SimpleNamespace(manifest={"files": files}))

    check_draft(target, stub(target.vocab_size))
    with pytest.raises(KvexportError, match="vocabulary has 7 tokens"):
        check_draft(target, stub(7))
    with pytest.raises(KvexportError, match=r"tokenizer differs from the target's \(tokenizer/tokenizer.json\)"):
        check_draft(target, stub(target.vocab_size, "ab" * 32))


# ------------------------------------------------------------------ serve's engine
def test_the_engine_speculates_and_answers_as_without(tiny_package, monkeypatch):
    """Requests batched in the serving engine with drafts (an oracle's, so
    most are kept, one in three spoilt) give the tokens of each alone; the
    prefix cache still holds exactly its sessions' cells."""
    import kvexport.runtime.speculative as spec
    from kvexport.runtime import OffgraphKVManager
    from kvexport.runtime.server.engine import Engine, GenerationRequest
    from test_engine import run_all

    package = load(tiny_package("tiny-llama")).package
    prompts = [prompt_of(4 + 7 * i, seed=20 + i) for i in range(5)]
    budgets = [6 + 5 * i for i in range(5)]
    want = {tuple(p): generate(OffgraphKVManager(package), [p], n)[0] for p, n in zip(prompts, budgets)}
    calls = []

    def oracle(self, k):
        prompt = next(p for p in want if list(p) == self.tokens[: len(p)])
        done = len(self.tokens) - len(prompt)
        drafts = want[prompt][done : done + k]
        calls.append(1)
        if len(calls) % 3 == 0 and drafts:
            drafts[0] = (drafts[0] + 1) % 1031
        return drafts

    monkeypatch.setattr(spec.NgramIndex, "propose", oracle)
    manager = OffgraphKVManager(package)
    speculation = Speculation("lookup")
    engine = Engine(manager, None, max_sessions=4, max_step_tokens=16, speculation=speculation)
    try:
        sinks = run_all(engine, [GenerationRequest(p, n) for p, n in zip(prompts, budgets)])
        assert [s.tokens() for s in sinks] == [want[tuple(p)] for p in prompts]
        assert speculation.stats.accepted > 0 and speculation.stats.drafted > speculation.stats.accepted
    finally:
        engine.shutdown()
    cached = {h.session.seq for h in engine.prefix.holders.values() if h.cached}
    assert set(manager.cache.next_pos) == cached
    for holder in engine.prefix.holders.values():  # what a holder says its session holds, its cells hold
        assert holder.session.length == len(holder.tokens)


def test_the_engine_with_a_draft_package(tiny_package):
    from kvexport.runtime import OffgraphKVManager
    from kvexport.runtime.server.engine import Engine, GenerationRequest
    from test_engine import run_all

    package = load(tiny_package("tiny-llama")).package
    draft = load(tiny_package("tiny-llama", qlinear="8w", qembedding="8w"))
    prompts = [prompt_of(5 + 9 * i, seed=30 + i) for i in range(3)]
    want = [generate(OffgraphKVManager(package), [p], 20)[0] for p in prompts]
    speculation = Speculation("draft", draft=draft, step_tokens=12)  # drafts while decoders fill at most half a step
    engine = Engine(OffgraphKVManager(package), None, max_sessions=3, speculation=speculation)
    try:
        sinks = run_all(engine, [GenerationRequest(p, 20) for p in prompts])
        assert [s.tokens() for s in sinks] == want
        assert speculation.stats.accepted > 0
        # sampled: a seed repeats its tokens when the drafting repeats (here, alone); under other load the
        # drafts differ, and so do the coins they take, though each token keeps the target's distribution
        request = GenerationRequest(prompts[0], 12, SamplingConfig(0.9, top_k=8), seed=5)
        once, again = run_all(engine, [request]), run_all(engine, [request])
        assert once[0].tokens() == again[0].tokens() and len(once[0].tokens()) == 12
    finally:
        engine.shutdown()
    # every draft session went with its request, or is kept in the draft's prefix cache
    assert set(draft.cache.next_pos) == {h.session.seq for h in engine.draft_prefix.holders.values() if h.cached}


def test_draft_sessions_share_prompt_prefixes(tiny_package):
    """A second request sharing a long prefix with a finished one clones the
    draft's cells of that prefix instead of prefilling it again; the tokens
    are still plain greedy decoding's, and every draft holder's cells hold
    its tokens."""
    from kvexport.runtime import OffgraphKVManager
    from kvexport.runtime.server.engine import Engine, GenerationRequest
    from kvexport.runtime.server.prefix_cache import BLOCK_TOKENS
    from test_engine import run_all

    package = load(tiny_package("tiny-llama")).package
    draft = load(tiny_package("tiny-llama", qlinear="8w", qembedding="8w"))
    shared = prompt_of(3 * BLOCK_TOKENS + 5, seed=41)
    prompts = [shared + prompt_of(4, seed=42), shared + prompt_of(7, seed=43)]
    want = [generate(OffgraphKVManager(package), [p], 16)[0] for p in prompts]
    engine = Engine(OffgraphKVManager(package), None, max_sessions=2, speculation=Speculation("draft", draft=draft))
    fed = []
    step = draft.step
    draft.step = lambda entries: fed.append(sum(len(e.tokens) for e in entries)) or step(entries)
    try:
        first = run_all(engine, [GenerationRequest(prompts[0], 16)])
        fed_first, fed[:] = sum(fed), []
        second = run_all(engine, [GenerationRequest(prompts[1], 16)])
        assert [first[0].tokens(), second[0].tokens()] == want
        assert engine.draft_prefix.hit_tokens >= 3 * BLOCK_TOKENS
        assert sum(fed) <= fed_first - 3 * BLOCK_TOKENS + 3  # the shared prefix was not fed to the draft again
        for holder in engine.draft_prefix.holders.values():
            assert holder.session.length <= len(holder.tokens)
            if holder.cached:
                assert holder.session.length == len(holder.tokens)
    finally:
        engine.shutdown()


def test_serve_refuses_speculation_it_cannot_do(tiny_package):
    args = ["serve", str(tiny_package("tiny-llama")), "--port", "0"]
    result = CliRunner().invoke(main, args + ["--speculative", "draft"])
    assert result.exit_code == 1 and "--draft" in result.output
    result = CliRunner().invoke(main, args + ["--max-draft", "0", "--speculative", "lookup"])
    assert result.exit_code == 1 and "--max-draft" in result.output
