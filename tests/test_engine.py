"""The serving engine without HTTP: continuous batching equals each request
alone, the prefix cache shares and evicts cells, stop strings and the text
stream, cancellation and admission."""

from __future__ import annotations

import threading

import pytest

from helpers import prompt_of
from kvexport.runtime import generate, load
from kvexport.runtime.offgraph import StepEntry
from kvexport.runtime.server.engine import Delta, Done, Engine, Failed, Finished, GenerationRequest, QueueFull, RequestError
from kvexport.runtime.server.prefix_cache import BLOCK_TOKENS, PrefixCache
from kvexport.runtime.text import StopMatcher, Text, TextStream
from test_models import save_tokenizer


@pytest.fixture(scope="module")
def package(tiny_package):
    return load(tiny_package("tiny-llama")).package


def runtime_of(package, **options):
    from kvexport.runtime import OffgraphKVManager

    return OffgraphKVManager(package, **options)


class Collect:
    """A sink: the events of one request, and an event set when it ends."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, (Done, Failed)):
            self.done.set()

    def tokens(self, choice: int = 0) -> list[int]:
        return [t for e in self.events if isinstance(e, Delta) and e.choice == choice for t in e.tokens]

    def reason(self, choice: int = 0) -> str:
        return next(e.reason for e in self.events if isinstance(e, Finished) and e.choice == choice)


# ------------------------------------------------------------- text side
def test_stop_strings_are_found_across_pieces_and_held_back_until_decided():
    m = StopMatcher(("END", "xyz"))
    assert m.feed("hello E") == ("hello ", False)  # "E" may start END
    assert m.feed("N") == ("", False)
    assert m.feed("D and more") == ("", True)
    m = StopMatcher(("END",))
    assert m.feed("E") == ("", False) and m.feed("x") == ("Ex", False)
    assert m.feed("EN") == ("", False) and m.flush() == "EN"
    assert StopMatcher().feed("anything END") == ("anything END", False)


def test_the_text_stream_spells_what_decoding_all_ids_spells(tmp_path):
    text = Text(save_tokenizer(tmp_path))
    ids = [3, 4, 5, 6, 2, 7, 8, 100, 4]
    stream = TextStream(text)
    assert "".join(stream.push(t) for t in ids) == text.decode(ids)


# ---------------------------------------------------------- prefix cache
def test_the_prefix_cache_shares_cells_and_evicts_least_recently_used(package):
    manager = runtime_of(package)
    cache = PrefixCache(manager)
    prompt = prompt_of(3 * BLOCK_TOKENS + 5, seed=1)
    session = manager.new_session()
    manager.step([StepEntry(session, prompt, False)])
    holder = cache.hold(session, list(prompt))
    assert cache.lookup(prompt) == (holder, len(prompt) - 1)  # never all of it: one token is left to prefill
    longer = prompt + [7, 8, 9]
    assert cache.lookup(longer)[1] == len(prompt)
    assert cache.lookup(prompt[:10] + [1] * 30) == (None, 0)  # no whole block in common
    other = prompt_of(2 * BLOCK_TOKENS + 1, seed=2)
    s2 = manager.new_session()
    manager.step([StepEntry(s2, other, False)])
    h2 = cache.hold(s2, list(other))
    cache.retire(holder)
    cache.retire(h2)
    assert cache.cached_count == 2
    cache.lookup(prompt)  # touches the first: the second is now the least recently used
    used = manager.cache.max_cells - 1 - manager.cache.free_cells
    assert cache.evict_one() and not s2.live and session.live
    assert manager.cache.max_cells - 1 - manager.cache.free_cells == used - len(other)
    clone = manager.clone(session, 20)
    assert cache.evict_one() and not session.live
    assert manager.cache.max_cells - 1 - manager.cache.free_cells == 20  # the clone keeps what it shares
    manager.release(clone)
    assert not cache.evict_one() and manager.cache.free_cells == manager.cache.max_cells - 1


def test_a_session_that_extends_a_cached_one_replaces_it(package):
    manager = runtime_of(package)
    cache = PrefixCache(manager, max_cells=None)
    prompt = prompt_of(2 * BLOCK_TOKENS, seed=3)
    first = manager.new_session()
    manager.step([StepEntry(first, prompt, False)])
    cache.retire(cache.hold(first, list(prompt)))
    holder, matched = cache.lookup(prompt + [5] * 4)
    second = manager.clone(holder.session, matched)
    manager.step([StepEntry(second, [5] * 4, False)])
    cache.retire(cache.hold(second, prompt + [5] * 4))
    assert not first.live and second.live and cache.cached_count == 1
    limited = PrefixCache(manager, max_cells=8)  # past 8 cached-only cells: evicted at once
    third = manager.new_session()
    manager.step([StepEntry(third, prompt, False)])
    limited.retire(limited.hold(third, list(prompt)))
    assert not third.live and limited.cached_count == 0


# ---------------------------------------------------------------- engine
def run_all(engine: Engine, requests: list[GenerationRequest]) -> list[Collect]:
    sinks = [Collect() for _ in requests]
    for request, sink in zip(requests, sinks):
        engine.submit(request, sink)
    for sink in sinks:
        assert sink.done.wait(60), sink.events
    return sinks


def test_continuous_batching_equals_each_request_alone(package):
    """Requests of mixed lengths submitted together and while others decode,
    with prompts longer than a step (chunked prefill) and shared prefixes."""
    manager = runtime_of(package)
    engine = Engine(manager, None, max_sessions=6, max_step_tokens=12)
    shared = prompt_of(2 * BLOCK_TOKENS + 3, seed=9)
    prompts = [(shared if i % 2 else []) + prompt_of(2 + 5 * i, seed=i) for i in range(10)]
    budgets = [3 + (7 * i) % 19 for i in range(10)]
    requests = [GenerationRequest(p, n) for p, n in zip(prompts, budgets)]
    try:
        first = run_all(engine, requests[:5])
        later = run_all(engine, requests[5:])
        alone = [generate(runtime_of(package), [p], n)[0] for p, n in zip(prompts, budgets)]
        assert [s.tokens() for s in first + later] == alone
        assert engine.prefix.hits > 0
        assert all(s.events[-1].prompt_tokens == len(p) for s, p in zip(first + later, prompts))
    finally:
        engine.shutdown()
    cached = {h.session.seq for h in engine.prefix.holders.values() if h.cached}
    assert set(manager.cache.next_pos) == cached  # every finished request's session was kept or released


def test_requests_that_cannot_run_are_refused_by_name(package):
    engine = Engine(runtime_of(package), None, max_sessions=2, max_queue=1)
    context = engine.context
    try:
        for request, needle in [
            (GenerationRequest([], 4), "empty"),
            (GenerationRequest([1, 2, 99999], 4), "outside the vocabulary"),
            (GenerationRequest([1] * 10, context), f"context of {context}"),
            (GenerationRequest([1], 4, n=3), "n must be in 1..2"),
            (GenerationRequest([1] * 300, 300), "cells"),
        ]:
            with pytest.raises(RequestError, match=needle):
                engine.submit(request, Collect())
    finally:
        engine.shutdown()


def test_cancelled_and_shut_down_requests_free_their_cells(package):
    manager = runtime_of(package)
    engine = Engine(manager, None, max_sessions=1, max_queue=1, prefix_cache_cells=0)
    try:
        running, waiting = Collect(), Collect()
        a = engine.submit(GenerationRequest([5, 6, 7], 400, ignore_eos=True), running)
        while not running.tokens():
            running.done.wait(0.01)
        engine.submit(GenerationRequest([8, 9], 400, ignore_eos=True), waiting)
        with pytest.raises(QueueFull):
            engine.submit(GenerationRequest([1], 4), Collect())
        engine.cancel(a)
        while not waiting.tokens():  # the waiting request starts once the first is gone
            waiting.done.wait(0.01)
        assert engine.cancelled == 1 and not running.done.is_set()
    finally:
        engine.shutdown()
    assert isinstance(waiting.events[-1], Failed) and "shutting down" in waiting.events[-1].message
    assert manager.cache.free_cells == manager.cache.max_cells - 1 and not manager.cache.next_pos


def test_n_choices_clone_the_prompt_and_sample_with_their_own_seeds(package):
    from kvexport.contract.sampler import SamplingConfig

    manager = runtime_of(package)
    engine = Engine(manager, None, max_sessions=4)
    try:
        request = GenerationRequest(prompt_of(9, seed=4), 6, SamplingConfig(temperature=1.0), seed=11, n=3)
        [sink] = run_all(engine, [request])
        [again] = run_all(engine, [request])
        outputs = [sink.tokens(i) for i in range(3)]
        assert outputs == [again.tokens(i) for i in range(3)] and len({tuple(o) for o in outputs}) > 1
        assert sink.events[-1].completion_tokens == sum(map(len, outputs))
    finally:
        engine.shutdown()


def test_cached_sessions_survive_a_restart_through_the_state_dir(package, tmp_path, caplog):
    """--state-dir: the kept sessions are saved at shutdown and restored at
    start; a follow-up prompt then reuses them and answers as alone. Files
    saved for another package are not restored, and the log says so."""
    prompt = prompt_of(2 * BLOCK_TOKENS + 4, seed=21)
    first = Engine(runtime_of(package), None, state_dir=tmp_path, package_digest="a" * 64)
    try:
        [done] = run_all(first, [GenerationRequest(prompt, 6)])
    finally:
        first.shutdown()
    [saved] = tmp_path.glob("*/session-*.safetensors")
    manager = runtime_of(package)
    again = Engine(manager, None, state_dir=tmp_path, package_digest="a" * 64)
    try:
        assert again.prefix.cached_count == 1
        follow = prompt + done.tokens()[:-1] + [9, 10]
        [answer] = run_all(again, [GenerationRequest(follow, 5)])
        assert answer.events[-1].cached_tokens == len(prompt) + 5 and again.prefix.hits == 1
        assert answer.tokens() == generate(runtime_of(package), [follow], 5)[0]
    finally:
        again.shutdown()
    other = Engine(runtime_of(package), None, state_dir=tmp_path, package_digest="b" * 64)
    other.shutdown()
    assert other.prefix.cached_count == 0 and saved.exists()  # another package's sessions are left alone
    moved = tmp_path / ("b" * 16) / saved.name
    moved.parent.mkdir(exist_ok=True)
    saved.rename(moved)  # a file copied into this package's folder: its tag still says whose it is
    caplog.set_level("WARNING")
    third = Engine(runtime_of(package), None, state_dir=tmp_path, package_digest="b" * 64)
    third.shutdown()
    assert third.prefix.cached_count == 0 and "saved for package aaaa" in caplog.text
