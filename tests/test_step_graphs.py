"""The static methods replayed over fixed buffers (runtime/step_graphs.py).

No test needs a GPU: on the CPU a graph is `CallCapture`, the same fixed
buffers and pool views run without a capture, so everything but the capture
itself is checked here."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import MODEL_BACKENDS, prompt_of
from kvexport.runtime import generate
from kvexport.runtime.step_graphs import MIN_CELLS, CallCapture, StepGraphs, graph_cells


def test_graph_cells_round_up_to_a_power_of_two_within_the_pool():
    assert graph_cells(1, 4096) == MIN_CELLS
    assert graph_cells(MIN_CELLS, 4096) == MIN_CELLS
    assert graph_cells(MIN_CELLS + 1, 4096) == 2 * MIN_CELLS
    assert graph_cells(1000, 4096) == 1024
    assert graph_cells(1000, 700) == 700


class CountingCapture:
    """CallCapture that records what was captured and how often it replays."""

    def __init__(self):
        self.captured: list[tuple[int, ...]] = []
        self.replays = 0

    def __call__(self, fn, out):
        self.captured.append(tuple(out.shape))
        inner = CallCapture(fn, out)
        counter = self

        class Counted:
            def replay(self):
                counter.replays += 1
                inner.replay()

        return Counted()


@pytest.mark.parametrize("model, backend", MODEL_BACKENDS + [("tiny-mistral", "portable")], indirect=["backend"])
def test_fixed_buffers_give_the_plain_tokens_alone_and_batched(model, backend, tiny_runtime):
    # prompts longer than the widest static method: slices through forward_others (never graphed)
    prompts = [prompt_of(30, seed=1), prompt_of(5, seed=2), prompt_of(11, seed=3)]
    plain = generate(tiny_runtime(model), prompts, 12)
    graphed = tiny_runtime(model, cuda_graphs=True)
    counting = CountingCapture()
    graphed.graphs.capture = counting
    assert generate(graphed, prompts, 12) == plain
    alone = tiny_runtime(model, cuda_graphs=True)
    assert [generate(alone, [p], 12)[0] for p in prompts] == plain
    # every decode step replayed a graph; each (method, cells) was captured once
    assert counting.replays >= 11 and len(counting.captured) == len(graphed.graphs.graphs)
    assert all(cells == graph_cells(cells, graphed.cache.max_cells) for _, cells in graphed.graphs.graphs)


def test_cpu_packages_run_plainly_unless_asked(tiny_runtime):
    assert tiny_runtime("tiny-llama").graphs is None
    assert tiny_runtime("tiny-llama", cuda_graphs=False).graphs is None


def zeros(shape, dtype):
    return torch.zeros(shape, dtype=dtype)


def _inputs(width: int, cells: int, masks: int = 1):
    from kvexport.contract.offgraph_kv import ForwardInputs

    pools = [torch.zeros(cells, 1, 2)]
    return pools, ForwardInputs(torch.ones(1, width, dtype=torch.int64), torch.zeros(width, dtype=torch.int64),
                                torch.arange(width), pools, torch.zeros(width, dtype=torch.int64),
                                [torch.ones(width, cells, dtype=torch.bool)] * masks)


def test_graphs_are_dropped_when_the_pools_move():
    calls = []

    def run(method, tokens, pos, keep, pool, cells, mask):
        calls.append(pool.data_ptr())
        return torch.full((tokens.shape[1], 5), float(tokens.sum()))

    graphs = StepGraphs(run, 5, torch.device("cpu"), zeros, 1024, 0)
    pools, inputs = _inputs(2, 64)
    assert graphs("forward_2", inputs).tolist() == [[2.0] * 5] * 2
    assert list(graphs.graphs) == [("forward_2", 64)]
    graphs("forward_2", inputs)
    assert len(graphs.graphs) == 1
    moved, inputs = _inputs(2, 64)  # a grown pool: new storage
    graphs("forward_2", inputs)
    assert calls[-1] == moved[0].data_ptr() and len(graphs.graphs) == 1
    assert graphs.takes("forward_2") and not graphs.takes("forward_others") and not graphs.takes("sample")


def test_a_failed_capture_falls_back_to_the_plain_call(caplog):
    def refuse(fn, out):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = StepGraphs(lambda *a: None, 5, torch.device("cpu"), zeros, 1024, 0, capture=refuse)
    pools, inputs = _inputs(1, 64)
    with caplog.at_level(logging.WARNING):
        assert graphs("forward_1", inputs) is None
    assert "not captured" in caplog.text and not graphs.takes("forward_1")
