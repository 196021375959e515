"""CUDA graphs of the static `forward_<N>` methods.

A decode step on a GPU spends more time launching kernels from the host than
running them. A graph captured once per static method replays the whole
forward with one launch. A graph fixes every input's address and shape, so
each captured method owns fixed buffers (tokens, positions, rows, cells, the
masks) and reads a fixed view of the cell pools: the first `cells` cells,
where `cells` is the read length rounded up to a power of two (a step over
100 cells replays the 128-cell graph; the extra cells are masked out, as they
belong to none of the step's sessions). A graph is captured the first time
its (method, cells) pair is needed, after a warm-up that writes only the
scratch cell, and dropped when the pools grow (their address changes).

On the CPU there is no graph: `CallCapture` runs the method again on the same
fixed buffers, which is how the tests check everything but the capture itself.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch

from kvexport.contract.offgraph_kv import ForwardInputs

log = logging.getLogger(__name__)

MIN_CELLS = 64  # the smallest pool view a graph reads


class Replay(Protocol):
    def replay(self) -> None: ...


Capture = Callable[[Callable[[], torch.Tensor], torch.Tensor], Replay]


class CallCapture:
    """Runs `fn` again on every replay and copies its result into the fixed
    output: a graph's behaviour, without the graph (CPU packages, tests)."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor):
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def cuda_capture() -> Capture:
    """Captures on the current CUDA device. Every graph of the runtime shares
    one memory pool: graphs replay one at a time, so their intermediates can
    share addresses."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor], out: torch.Tensor) -> Replay:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, workspaces
            for _ in range(2):
                out.copy_(fn())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out.copy_(fn())
        return graph

    return capture


def graph_cells(n_cells: int, max_cells: int) -> int:
    """The pool view a step over `n_cells` cells replays: the next power of
    two (at least MIN_CELLS), never more than the pool may hold."""
    return min(max_cells, max(MIN_CELLS, 1 << (n_cells - 1).bit_length()))


Buffer = Callable[[tuple, torch.dtype], torch.Tensor]  # (shape, dtype) -> a zeroed tensor on the device


class _Graph:
    """A static method captured over a `cells`-cell view of the pools."""

    def __init__(self, run: Callable[..., torch.Tensor], width: int, vocab: int, pools: list[torch.Tensor],
                 n_masks: int, buffer: Buffer, capture: Capture, scratch_cell: int):
        cells = pools[0].shape[0]
        self.inputs = ForwardInputs(
            tokens=buffer((1, width), torch.int64),
            input_pos=buffer((width,), torch.int64),
            logits_to_keep=buffer((width,), torch.int64),
            pools=pools,
            cells=buffer((width,), torch.int64),
            masks=[buffer((width, cells), torch.bool) for _ in range(n_masks)],
        )
        # the warm-up reads every row and writes the scratch cell only
        self.inputs.logits_to_keep.copy_(torch.arange(width))
        self.inputs.cells.fill_(scratch_cell)
        for mask in self.inputs.masks:
            mask[:, scratch_cell] = True
        self.out = buffer((width, vocab), torch.float32)
        packed = self.inputs.pack()
        self.replayer = capture(lambda: run(*packed), self.out)

    def __call__(self, inputs: ForwardInputs) -> torch.Tensor:
        """Copies `inputs` (on the host or the device) into the fixed buffers
        and replays."""
        fixed = self.inputs
        pairs = [(fixed.tokens, inputs.tokens), (fixed.input_pos, inputs.input_pos),
                 (fixed.logits_to_keep, inputs.logits_to_keep), (fixed.cells, inputs.cells),
                 *zip(fixed.masks, inputs.masks)]
        for buffer, value in pairs:
            buffer.copy_(value, non_blocking=True)
        self.replayer.replay()
        return self.out.clone()  # the next replay overwrites out


class StepGraphs:
    """The graphs of one runtime's static methods, keyed by (method, cells).
    Their fixed buffers come from `buffer` (the runtime's allocator)."""

    def __init__(self, run: Callable[..., torch.Tensor], vocab: int, device: torch.device, buffer: Buffer,
                 max_cells: int, scratch_cell: int, capture: Capture | None = None):
        self.run, self.vocab, self.buffer = run, vocab, buffer
        self.max_cells, self.scratch_cell = max_cells, scratch_cell
        self.capture = capture or (cuda_capture() if device.type == "cuda" else CallCapture)
        self.graphs: dict[tuple[str, int], _Graph] = {}
        self.pools_at: int | None = None  # the address the graphs read the pools at
        self.failed: set[str] = set()  # methods whose capture failed: run plainly

    def cells(self, n_cells: int) -> int:
        return graph_cells(n_cells, self.max_cells)

    def takes(self, method: str) -> bool:
        return method.startswith("forward_") and method != "forward_others" and method not in self.failed

    def __call__(self, method: str, inputs: ForwardInputs) -> torch.Tensor | None:
        """The method's logits through its graph for `inputs`, whose pools
        are views of `self.cells(...)` cells; None where it cannot be
        captured."""
        pools = list(inputs.pools)
        address = pools[0].untyped_storage().data_ptr()
        if address != self.pools_at:  # the pools grew: every graph reads freed memory
            self.graphs.clear()
            self.pools_at = address
        key = (method, pools[0].shape[0])
        if key not in self.graphs:
            try:
                self.graphs[key] = _Graph(lambda *a: self.run(method, *a), inputs.tokens.shape[1], self.vocab, pools,
                                          len(inputs.masks), self.buffer, self.capture, self.scratch_cell)
            except Exception as e:  # noqa: BLE001 (any capture failure: the plain call still works)
                log.warning("%s: not captured as a CUDA graph (%s: %s); it runs without one", method, type(e).__name__,
                            str(e)[:200])
                self.failed.add(method)
                return None
            log.debug("captured %s over %d cells", method, key[1])
        return self.graphs[key](inputs)
