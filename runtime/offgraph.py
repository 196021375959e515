"""The `offgraph_kv` v1 I/O manager (docs/contracts/offgraph_kv-v1.md): sessions
over a cell cache, and one `step` that packs a batch onto one token axis,
cuts it into slices, runs each through the narrowest method, and hands back
each session's selected logits."""

from __future__ import annotations

import bisect
import dataclasses
import operator
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kvexport.contract import manifest as mf
from kvexport.contract.offgraph_kv import ForwardInputs
from kvexport.runtime.cell_cache import SCRATCH_CELL, Allocator, CellCache, allocate, io_buffer, sequence_bit, zeros_allocator
from kvexport.contract.errors import PackageError, RuntimeRefusal
from kvexport.runtime.loader import IOManager, LoadedPackage, check_output, register_io_manager
from kvexport.runtime.step_graphs import StepGraphs
from kvexport.contract.sampler import check_sampled, sample, sample_argmax

PAD_TOKEN = 0
OTHERS_PER_TOKEN = "forward_others per token"  # MethodCosts' figure for the dynamic method: its time over its tokens


class Session:
    """One sequence in the cell cache. Obtain from new_session / clone."""

    def __init__(self, manager: "OffgraphKVManager", seq: int):
        self.manager = manager
        self.seq = seq
        self.live = True

    @property
    def length(self) -> int:
        """Tokens the session holds (its next position)."""
        return self.manager.cache.next_pos[self.seq]

    def __repr__(self) -> str:
        return f"Session(seq={self.seq}, length={self.length if self.live else 'released'})"


@dataclass
class StepEntry:
    """A session's tokens in one step. With wants_logits the step returns the
    logits of its last token ([V]), or of its last `rows` tokens ([rows, V])
    when rows > 1: speculative decoding checks its drafts so."""

    session: Session
    tokens: Sequence[int]
    wants_logits: bool = True
    rows: int = 1


class MethodCosts:
    """How long a call of each method takes on this machine now (seconds,
    smoothed over its recent calls): what speculative decoding weighs a wider
    step against (runtime/speculative.py). A method's first call (its
    warm-up) is not counted, and a figure that no call renewed within the
    last STALE calls is forgotten, so a method measured once in a slow
    moment gets tried again. A manager times its calls only once asked
    (OffgraphKVManager.time_calls), a CUDA call to its end: the manager then
    waits for it, as the sampler reading its logits would."""

    WEIGHT = 0.25  # of the newest call
    STALE = 256  # calls: at 16 sessions a step, a method measured dear is tried again every 10 s or so

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._last: dict[str, int] = {}  # the call count at each method's latest figure
        self._calls = 0

    def observe(self, method: str, seconds: float) -> None:
        self._calls += 1
        if method not in self._last:  # the warm-up
            self._last[method] = -self.STALE
            return
        old = self._seconds.get(method) if self._calls - self._last[method] <= self.STALE else None
        self._seconds[method] = seconds if old is None else old + self.WEIGHT * (seconds - old)
        self._last[method] = self._calls

    def of(self, method: str) -> float | None:
        fresh = self._calls - self._last.get(method, -self.STALE - 1) <= self.STALE
        return self._seconds.get(method) if fresh else None


@dataclass(frozen=True)
class _Slice:
    method: str
    start: int
    end: int
    width: int  # the method's token count (>= end - start; the rest is padding)
    rows: int  # the method's selected-row count


@register_io_manager(mf.OFFGRAPH_KV, mf.OFFGRAPH_KV_VERSION)
class OffgraphKVManager(IOManager):
    batches_sessions = True

    def __init__(
        self,
        package: LoadedPackage,
        max_cells: int | None = None,
        allocator: Allocator = zeros_allocator,
        cuda_graphs: bool | None = None,
        **options: Any,
    ):
        """cuda_graphs: replay each static method as a CUDA graph (None: on
        for a CUDA package). True on a CPU package runs the same fixed buffers
        without a graph (runtime/step_graphs.py)."""
        super().__init__(package)
        md = package.metadata
        self.vocab_size: int = md["get_vocab_size"]
        self.eos_ids: frozenset[int] = frozenset(md["eos_ids"])
        self.static_sizes = sorted(md["forward_sizes"])
        self.widest: int = md["get_max_seq_len"]
        self.min_rows_others: int = md.get("get_min_prefill_chunk", 1)
        others = package.manifest["methods"].get("forward_others")
        self.others_min_tokens = others["inputs"][0]["shape"][1]["min"] if others else None
        package_cells = md["get_offgraph_kv_max_cells"]
        # A smaller pool than the package allows is fine: a step that does not
        # fit is refused by the capacity check, like any other.
        if max_cells is not None and not 1 < max_cells <= package_cells:
            raise RuntimeRefusal(
                f"max_cells={max_cells}: must be at least 2 (one is the scratch cell) and at most the "
                f"package's get_offgraph_kv_max_cells ({package_cells})"
            )
        geometry = mf.CacheGeometry(tuple(md["get_kv_heads"]), tuple(md["get_head_dims"]), tuple(md["get_windows"]))
        dtype = getattr(torch, mf.TORCH_DTYPE_NAMES[md["dtype"]])
        self.device = torch.device(package.device)
        self.allocator = allocator
        self.cells_read = 0  # the C of the last step's calls: the cells they attended over
        self.costs: MethodCosts | None = None  # each call timed once time_calls() asks (speculative decoding)
        self.cache = CellCache(
            geometry, max_cells or package_cells, dtype, md["get_max_context_len"], device=self.device, allocator=allocator
        )
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        self.graphs = None
        if cuda_graphs:
            buffer = lambda shape, dtype: allocate(allocator, shape, dtype, self.device)  # noqa: E731
            self.graphs = StepGraphs(package.run, self.vocab_size, self.device, buffer, self.cache.max_cells, SCRATCH_CELL)

    # ------------------------------------------------------------ sessions
    def new_session(self) -> Session:
        return Session(self, self.cache.new_sequence())

    def clone(self, session: Session, upto: int | None = None) -> Session:
        self._own(session)
        return Session(self, self.cache.clone(session.seq, upto))

    def release(self, session: Session) -> None:
        self._own(session)
        self.cache.release(session.seq)
        session.live = False

    def rewind(self, session: Session, pos: int) -> None:
        self._own(session)
        self.cache.rewind(session.seq, pos)

    def _own(self, session: Session) -> None:
        if session.manager is not self or not session.live:
            raise RuntimeRefusal(f"{session!r} is not a live session of this runtime")

    # ---------------------------------------------------------------- step
    def plan(self, total: int) -> list[_Slice]:
        """Cuts a packed axis of `total` tokens into consecutive slices no
        wider than the widest method, each run by the narrowest that holds it."""
        slices = []
        for start in range(0, total, self.widest):
            end = min(total, start + self.widest)
            width = end - start
            i = bisect.bisect_left(self.static_sizes, width)
            if i < len(self.static_sizes):
                n = self.static_sizes[i]
                slices.append(_Slice(f"forward_{n}", start, end, n, n))
            elif self.others_min_tokens is not None and width >= self.others_min_tokens:
                slices.append(_Slice("forward_others", start, end, width, 0))
            else:  # validation refuses such packages; a hand-made one may still get here
                raise PackageError(f"no method takes a step of {width} tokens")
        return slices

    def _validate(self, entries: Sequence[StepEntry]) -> dict[int, int]:
        if not entries:
            raise RuntimeRefusal("a step needs at least one entry")
        counts: dict[int, int] = {}
        for entry in entries:
            self._own(entry.session)
            if entry.session.seq in counts:
                raise RuntimeRefusal(f"{entry.session!r} appears twice in one step")
            check_token_ids(entry.tokens, self.vocab_size, repr(entry.session))
            if len(entry.tokens) == 0:
                raise RuntimeRefusal(f"{entry.session!r}: a step entry needs at least one token")
            if isinstance(entry.rows, bool) or not isinstance(entry.rows, int) or not 1 <= entry.rows <= len(entry.tokens):
                raise RuntimeRefusal(f"{entry.session!r}: rows must be 1..{len(entry.tokens)} (its tokens), got {entry.rows!r}")
            counts[entry.session.seq] = len(entry.tokens)
        self.cache.check_step(counts)
        return counts

    @torch.inference_mode()
    def step(self, entries: Sequence[StepEntry]) -> list[torch.Tensor | None]:
        """Runs one batch. Returns, per entry, the logits (float32) of its
        last token ([V]) or last `rows` tokens ([rows, V]) if it wants them,
        else None. A refused batch raises before any state changes."""
        pieces, selected = self._step(entries)
        rows = _rows_by_token(pieces)
        return [None if s is None else rows[s[0]] if len(s) == 1 else torch.stack([rows[i] for i in s]) for s in selected]

    @torch.inference_mode()
    def step_logits(self, entries: Sequence[StepEntry]) -> torch.Tensor:
        """step() for entries that each want their last token's logits
        alone (a decode step): those logits as one [B, V] tensor, in entry
        order. Where one call selected every row in that order (as a decode
        step's does) this is that call's output, not a copy."""
        for entry in entries:
            if not entry.wants_logits or entry.rows != 1:
                raise RuntimeRefusal(f"{entry.session!r}: step_logits takes entries that want one row of logits")
        pieces, selected = self._step(entries)
        order = [s[0] for s in selected]
        if len(pieces) == 1 and pieces[0][0] == order:
            return pieces[0][1][: len(order)]
        rows = _rows_by_token(pieces)
        return torch.stack([rows[i] for i in order])

    def _step(self, entries: Sequence[StepEntry]) -> tuple[list[tuple[list[int], torch.Tensor]], list[range | None]]:
        """Validates, places and runs a step: (_run's pieces, each entry's
        selected token indices or None)."""
        counts = self._validate(entries)
        self.cache.make_room(set(counts), sum(counts.values()))
        seqs, token_ids, selected = [], [], []
        for entry in entries:
            seqs += [entry.session.seq] * len(entry.tokens)
            token_ids += [operator.index(t) for t in entry.tokens]
            selected.append(range(len(token_ids) - entry.rows, len(token_ids)) if entry.wants_logits else None)
        with self.cache.placed(seqs) as (cells, positions):
            pieces = self._run(torch.tensor(token_ids), positions, cells, seqs,
                               [i for s in selected if s is not None for i in s])
        return pieces, selected

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cells: torch.Tensor,
        seqs: list[int],
        selected: list[int],
    ) -> list[tuple[list[int], torch.Tensor]]:
        """Runs the placed step slice by slice. Returns per call (the token
        indices it selected, its logits): row i of the logits is token
        indices[i]'s."""
        bits = np.array([sequence_bit(s) for s in seqs], dtype=np.int64)
        n_cells = self.cells_read = self.cache.read_len(set(seqs))
        out: list[tuple[list[int], torch.Tensor]] = []
        for piece in self.plan(len(seqs)):
            graphed = self.graphs is not None and self.graphs.takes(piece.method)
            cells_seen = self.graphs.cells(n_cells) if graphed else n_cells  # a graph reads a fixed view of the pools
            real = piece.end - piece.start
            pad = piece.width - real
            rows = [s - piece.start for s in selected if piece.start <= s < piece.end]
            want = max(piece.rows, self.min_rows_others if piece.method == "forward_others" else 0, len(rows))
            keep = rows + [rows[-1] if rows else 0] * (want - len(rows))
            sl = slice(piece.start, piece.end)
            step_tokens = _pad(tokens[sl], pad, PAD_TOKEN)
            step_pos = _pad(positions[sl], pad, 0)
            step_cells = _pad(cells[sl], pad, SCRATCH_CELL)
            step_bits = np.concatenate([bits[sl], np.zeros(pad, dtype=np.int64)]) if pad else bits[sl]
            masks = self.cache.masks(step_bits, step_pos, cells_seen)
            inputs = ForwardInputs(
                tokens=step_tokens.unsqueeze(0),
                input_pos=step_pos,
                logits_to_keep=torch.tensor(keep, dtype=torch.int64),
                pools=self.cache.views(cells_seen),
                cells=step_cells,
                masks=masks,
            )
            # a graph copies the host's values into its own buffers; a plain call takes them on the device
            began = time.perf_counter()
            logits = self.graphs(piece.method, inputs) if graphed else None
            if logits is None:
                logits = self.package.run(piece.method, *self._on_device(inputs).pack())
            if self.costs is not None:
                self._observe(piece, began)
            check_output(piece.method, logits, (want, self.vocab_size), torch.float32)
            out.append(([piece.start + row for row in rows], logits))
        return out

    def time_calls(self) -> MethodCosts:
        """Times every call from now on (self.costs); returns the figures."""
        if self.costs is None:
            self.costs = MethodCosts()
        return self.costs

    def _observe(self, piece: _Slice, began: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # timed to its end: the sampler reads the logits next anyway
        seconds = time.perf_counter() - began
        if piece.method == "forward_others":
            self.costs.observe(OTHERS_PER_TOKEN, seconds / piece.width)
        else:
            self.costs.observe(piece.method, seconds)

    def _on_device(self, inputs: ForwardInputs) -> ForwardInputs:
        """`inputs` in I/O buffers on the device (the pools already are)."""
        return dataclasses.replace(
            inputs, tokens=self._io(inputs.tokens), input_pos=self._io(inputs.input_pos),
            logits_to_keep=self._io(inputs.logits_to_keep), cells=self._io(inputs.cells),
            masks=[self._io(mask) for mask in inputs.masks],
        )

    def _io(self, values: torch.Tensor) -> torch.Tensor:
        return io_buffer(self.allocator, values, self.device)

    # ------------------------------------------------------------- sampling
    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: torch.Tensor, on_device: bool = True) -> torch.Tensor:
        """Draws one token per row with the package's sampler (on_device)
        or the host's; both give the same tokens for the same params."""
        greedy = bool((params[:, 0] <= 0).all())
        params = params.to(logits.device)
        rows = (logits.shape[0],)
        if on_device and greedy and self.package.has_method("sample_argmax"):
            tokens = check_output("sample_argmax", self.package.run("sample_argmax", self._io(logits)), rows, torch.int64)
            return check_sampled("sample_argmax", tokens, self.vocab_size)
        if on_device and self.package.has_method("sample"):
            tokens = check_output("sample", self.package.run("sample", self._io(logits), self._io(params)), rows, torch.int64)
            return check_sampled("sample", tokens, self.vocab_size)
        return sample_argmax(logits) if greedy else sample(logits, params)


def check_token_ids(tokens: Sequence[Any], vocab_size: int, who: str) -> None:
    """Token ids are a sequence of integers (Python, numpy or 0-d tensors) in
    the vocabulary. A bool is refused although Python counts it an int:
    True as a token id is a caller's bug, not token 1."""
    if tokens is None or isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise RuntimeRefusal(f"{who}: token ids must be a sequence of integers, got {type(tokens).__name__}")
    bad_type = []
    for t in tokens:
        try:
            if isinstance(t, bool) or (isinstance(t, torch.Tensor) and t.dtype == torch.bool):
                raise TypeError
            operator.index(t)
        except TypeError:
            bad_type.append(t)
    if bad_type:
        raise RuntimeRefusal(f"{who}: token ids must be integers, got {bad_type[:3]!r}")
    bad = [int(t) for t in tokens if not 0 <= operator.index(t) < vocab_size]
    if bad:
        raise RuntimeRefusal(f"{who}: token ids {bad[:5]} are outside the vocabulary 0..{vocab_size - 1}")


def _rows_by_token(pieces: list[tuple[list[int], torch.Tensor]]) -> dict[int, torch.Tensor]:
    """_run's pieces as token index -> that token's logits row."""
    return {token: logits[i] for tokens, logits in pieces for i, token in enumerate(tokens)}


def _pad(values: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    if n == 0:
        return values
    return torch.cat([values, torch.full((n,), fill, dtype=values.dtype)])
