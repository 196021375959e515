"""Batched equals alone; clones; refusals; freed cells (docs/contracts/offgraph_kv-v1.md)."""

from __future__ import annotations

import pytest
import torch

from helpers import AOTI_MODEL, MODEL_BACKENDS, prompt_of
from kvexport.runtime import RuntimeRefusal, StepEntry, generate
from kvexport.contract.errors import CapacityError


def greedy_loop(runtime, sessions_and_tokens, steps: int) -> list[list[int]]:
    """Decodes the given (session, first tokens) pairs together, greedily,
    one step per token; returns each session's new tokens."""
    pending = [list(tokens) for _, tokens in sessions_and_tokens]
    out: list[list[int]] = [[] for _ in sessions_and_tokens]
    for _ in range(steps):
        logits = runtime.step([StepEntry(s, p) for (s, _), p in zip(sessions_and_tokens, pending)])
        for i, row in enumerate(logits):
            token = int(row.argmax())
            out[i].append(token)
            pending[i] = [token]
    return out


def solo(runtime_factory, model, prompt, steps):
    runtime = runtime_factory(model)
    return greedy_loop(runtime, [(runtime.new_session(), prompt)], steps)[0]


class MethodLog:
    """Wraps a runtime's package so every program call is recorded."""

    def __init__(self, runtime):
        self.calls: list[tuple[str, int]] = []
        original = runtime.package.method

        def method(name):
            program = original(name)

            def call(*args):
                self.calls.append((name, int(args[0].shape[-1])))
                return program(*args)

            return call

        runtime.package = _Proxy(runtime.package, method)


class _Proxy:
    def __init__(self, inner, method):
        self._inner, self.method = inner, method

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def run(self, name, *args):  # the runtime calls methods through run()
        return self.method(name)(*args)


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
def test_four_sessions_batched_equal_alone(model, tiny_runtime):
    prompts = [prompt_of(n, seed=n) for n in (3, 9, 1, 30)]
    alone = [solo(tiny_runtime, model, p, 20) for p in prompts]
    runtime = tiny_runtime(model)
    log = MethodLog(runtime)
    together = greedy_loop(runtime, [(runtime.new_session(), p) for p in prompts], 20)
    assert together == alone
    # 43 prompt tokens over max_step 24 -> forward_others + static; decode of 4 -> forward_4
    assert {"forward_others", "forward_4"} <= {name for name, _ in log.calls}


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
def test_decode_and_wide_prompt_in_one_batch(model, tiny_runtime):
    a_prompt, b_prompt = prompt_of(6, seed=10), prompt_of(57, seed=11)  # 57 > max_step_tokens 24
    a_alone = solo(tiny_runtime, model, a_prompt, 12)
    b_alone = solo(tiny_runtime, model, b_prompt, 12)
    runtime = tiny_runtime(model)
    a, b = runtime.new_session(), runtime.new_session()
    [first] = runtime.step([StepEntry(a, a_prompt)])
    a_tokens = [int(first.argmax())]
    # a decodes while b's whole prompt arrives, in one batch of 58 tokens
    la, lb = runtime.step([StepEntry(a, a_tokens[-1:]), StepEntry(b, b_prompt)])
    a_tokens.append(int(la.argmax()))
    rest = greedy_loop(runtime, [(a, [a_tokens[-1]]), (b, [int(lb.argmax())])], 11)
    assert a_tokens + rest[0][:-1] == a_alone
    assert [int(lb.argmax())] + rest[1] == b_alone


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
def test_every_forward_size_with_padding(model, tiny_runtime):
    """Packed widths 1..24 and 31: each of the package's static sizes runs,
    padded where the width is not a size, and forward_others takes the wide
    ones."""
    runtime = tiny_runtime(model)
    log = MethodLog(runtime)
    for width in (1, 2, 3, 4, 5, 7, 8, 9, 24, 31):
        prompt = prompt_of(width, seed=width)
        alone = solo(tiny_runtime, model, prompt, 3)
        session = runtime.new_session()
        assert greedy_loop(runtime, [(session, prompt)], 3) == [alone]
        runtime.release(session)
    static = [f"forward_{n}" for n in runtime.static_sizes]
    used = {name for name, _ in log.calls}
    assert used == {*static, "forward_others"}
    padded = {name for name, width in log.calls if name != "forward_others" and width != int(name.split("_")[1])}
    assert not padded  # the recorded width is the method's own (padding happened inside it)
    widths_fed = {(name, width) for name, width in log.calls}
    assert all((name, int(name.split("_")[1])) in widths_fed for name in static)


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
@pytest.mark.parametrize("prompt_len", [5, 50])  # 50 spans several forwards
def test_clone_continues_as_source(model, prompt_len, tiny_runtime):
    prompt = prompt_of(prompt_len, seed=prompt_len + 100)
    runtime = tiny_runtime(model)
    source = runtime.new_session()
    [logits] = runtime.step([StepEntry(source, prompt)])
    first = int(logits.argmax())
    clone = runtime.clone(source)
    assert clone.length == source.length == prompt_len
    out = greedy_loop(runtime, [(source, [first]), (clone, [first])], 15)
    assert out[0] == out[1] == solo(tiny_runtime, model, prompt, 16)[1:]


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
def test_clone_upto_rewinds(model, tiny_runtime):
    prompt = prompt_of(12, seed=5)
    runtime = tiny_runtime(model)
    source = runtime.new_session()
    runtime.step([StepEntry(source, prompt)])
    partial = runtime.clone(source, upto=7)
    [logits] = runtime.step([StepEntry(partial, prompt[7:])])
    assert greedy_loop(runtime, [(partial, [int(logits.argmax())])], 5)[0] == solo(tiny_runtime, model, prompt, 6)[1:]


def cache_state(runtime):
    c = runtime.cache
    return c.owners.clone(), c.positions.clone(), dict(c.next_pos), [p.clone() for p in c.pools]


def assert_same_state(before, after):
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert before[2] == after[2]
    assert all(torch.equal(x, y) for x, y in zip(before[3], after[3]))


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
def test_refused_batch_changes_nothing(model, tiny_runtime):
    prompt = prompt_of(9, seed=7)
    want = solo(tiny_runtime, model, prompt, 10)
    runtime = tiny_runtime(model, max_cells=40)
    s = runtime.new_session()
    other = runtime.new_session()
    [logits] = runtime.step([StepEntry(s, prompt)])
    tokens = [int(logits.argmax())]
    before = cache_state(runtime)
    refusals = [
        ([StepEntry(s, tokens), StepEntry(other, prompt_of(35, seed=8))], CapacityError),  # 36 cells, 30 free
        ([StepEntry(s, tokens), StepEntry(other, [5, 10**6])], RuntimeRefusal),  # id outside vocab
        ([StepEntry(s, tokens), StepEntry(s, tokens)], RuntimeRefusal),  # same session twice
        ([StepEntry(s, tokens), StepEntry(other, [])], RuntimeRefusal),
        ([], RuntimeRefusal),
    ]
    for batch, error in refusals:
        with pytest.raises(error):
            runtime.step(batch)
        assert_same_state(before, cache_state(runtime))
    released = runtime.new_session()
    runtime.release(released)
    with pytest.raises(RuntimeRefusal, match="not a live session"):
        runtime.step([StepEntry(s, tokens), StepEntry(released, [4])])
    assert_same_state(before, cache_state(runtime))
    assert tokens + greedy_loop(runtime, [(s, tokens)], 9)[0] == want


def test_context_limit_refused(tiny_runtime):
    runtime = tiny_runtime(AOTI_MODEL)
    context = runtime.cache.max_context_len
    s = runtime.new_session()
    with pytest.raises(CapacityError, match="context"):
        runtime.step([StepEntry(s, [5] * (context + 1))])
    assert s.length == 0


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
def test_released_cells_never_leak(model, tiny_runtime):
    runtime = tiny_runtime(model)
    old = runtime.new_session()
    runtime.step([StepEntry(old, prompt_of(40, seed=20))])
    old_cells = set(torch.nonzero(runtime.cache.owners).squeeze(1).tolist())
    runtime.release(old)
    prompt = prompt_of(10, seed=21)
    new = runtime.new_session()
    out = greedy_loop(runtime, [(new, prompt)], 8)[0]
    reused = set(torch.nonzero(runtime.cache.owners).squeeze(1).tolist())
    assert reused <= old_cells  # the new session sits on the released cells
    assert out == solo(tiny_runtime, model, prompt, 8)


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
def test_step_logits_are_steps_rows_in_entry_order(model, tiny_runtime):
    """step_logits (generate's step) gives the rows step() gives, as one
    [B, V] tensor in entry order: over several calls (a prompt step wider
    than the widest method) and over one (a decode step, entries not in
    session order); entries that want no logits, or more than one row, are
    refused before anything changes."""
    by_step, by_logits = tiny_runtime(model), tiny_runtime(model)
    prompts = [prompt_of(n, seed=60 + n) for n in (3, 9, 30)]
    pairs = [[r.new_session() for _ in prompts] for r in (by_step, by_logits)]
    steps = [prompts, [[5], [6], [7]], [[8], [9], [10]]]
    for tokens in steps:
        order = [2, 0, 1] if len(tokens[0]) == 1 else [0, 1, 2]
        rows = by_step.step([StepEntry(pairs[0][i], tokens[i]) for i in order])
        logits = by_logits.step_logits([StepEntry(pairs[1][i], tokens[i]) for i in order])
        assert logits.shape == (3, by_step.vocab_size) and torch.equal(logits, torch.stack(rows))
    session = pairs[1][0]
    for entry in (StepEntry(session, [1], wants_logits=False), StepEntry(session, [1, 2], rows=2)):
        with pytest.raises(RuntimeRefusal, match="one row of logits"):
            by_logits.step_logits([entry])
        assert session.length == 3 + 2


def test_generate_batched_equals_alone(tiny_runtime):
    prompts = [prompt_of(n, seed=n + 50) for n in (2, 15, 33, 4, 8)]
    together = generate(tiny_runtime(AOTI_MODEL), prompts, 16)
    alone = [generate(tiny_runtime(AOTI_MODEL), [p], 16)[0] for p in prompts]
    assert together == alone


def test_generate_refuses_what_cannot_fit(tiny_runtime):
    runtime = tiny_runtime(AOTI_MODEL, max_cells=64)
    with pytest.raises(CapacityError, match="cells"):
        generate(runtime, [prompt_of(40, seed=1), prompt_of(30, seed=2)], 4)
    assert runtime.cache.next_pos == {}


def test_generate_releases_every_session_when_interrupted(tiny_runtime):
    runtime = tiny_runtime(AOTI_MODEL)
    calls = []

    def interrupt(i, token):
        calls.append(i)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(runtime, [prompt_of(4, seed=1), prompt_of(6, seed=2)], 10, on_token=interrupt)
    assert runtime.cache.next_pos == {}


def test_positions_must_be_ints(tiny_runtime):
    runtime = tiny_runtime(AOTI_MODEL)
    s = runtime.new_session()
    runtime.step([StepEntry(s, [5, 6, 7, 8])])
    for bad in (2.0, True, "2"):
        with pytest.raises(RuntimeRefusal, match="a position is an int"):
            runtime.rewind(s, bad)
        with pytest.raises(RuntimeRefusal, match="a position is an int"):
            runtime.clone(s, upto=bad)
    assert s.length == 4


def test_token_ids_of_other_integer_types(tiny_runtime):
    import numpy as np

    runtime = tiny_runtime(AOTI_MODEL)
    s = runtime.new_session()
    [a] = runtime.step([StepEntry(s, [np.int64(5), torch.tensor(6)])])
    runtime.release(s)  # the next session gets the same cells: the same sums, bit for bit
    other = runtime.new_session()
    [b] = runtime.step([StepEntry(other, [5, 6])])
    assert torch.equal(a, b)
    with pytest.raises(RuntimeRefusal, match="must be integers"):
        runtime.step([StepEntry(other, [5.0])])


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS, indirect=["backend"])
def test_a_step_reads_its_own_cells_not_those_others_keep(model, tiny_runtime):
    """A session kept alive below a decoding one (as a prefix cache keeps
    sessions) is moved out of the way: the decoding session's calls read
    about its own cells, and both still continue as they would alone."""
    kept_prompt, prompt = prompt_of(100, seed=30), prompt_of(10, seed=31)
    runtime = tiny_runtime(model)
    kept = runtime.new_session()
    [kept_logits] = runtime.step([StepEntry(kept, kept_prompt)])
    session = runtime.new_session()
    widths = []
    original = runtime.package.run

    def run(name, *args):
        widths.append(int(args[-1].shape[-1]))  # a mask is [T, C]: C cells read
        return original(name, *args)

    runtime.package = _Proxy(runtime.package, lambda name: lambda *args: run(name, *args))
    out = greedy_loop(runtime, [(session, prompt)], 8)[0]
    assert out == solo(tiny_runtime, model, prompt, 8)
    assert max(widths) <= 1 + 17 + 16 + 1, widths  # scratch + its 17 cells + slack, never the kept 100
    runtime.package = runtime.package._inner
    first = int(kept_logits.argmax())
    assert [first] + greedy_loop(runtime, [(kept, [first])], 5)[0] == solo(tiny_runtime, model, kept_prompt, 6)


def test_build_methods_builds_every_method_up_front(tiny_package):
    # serve builds them while loading: no request waits for one, and none is rebuilt on the engine's thread
    from kvexport.runtime import load

    package = load(tiny_package("tiny-llama")).package
    assert not package._methods
    package.build_methods()
    assert set(package._methods) == set(package.manifest["methods"])
