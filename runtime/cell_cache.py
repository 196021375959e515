"""The runtime-owned cell cache of the offgraph_kv contract (docs/contracts/offgraph_kv-v1.md).

A cell holds one token's K/V in every layer, its position, and the set of
sequences that own it, kept as a 64-bit mask (so at most 64 sequences live at
once). Cell 0 is the scratch cell that padding tokens write; it is never
owned, so no real token attends it. Cells are placed lowest-free first, and
before a step `make_room` moves the step's sequences' cells to the bottom of
the pools when other cells (another session's, or ones a prefix cache keeps)
would lie between them: a call sees only the first `read_len(seqs)` cells, so
its attention cost follows the step's own cells, not everything the pool holds.
Moving a cell moves its K/V, position and owners; no sequence can tell.

The pools grow on demand (doubling, up to max_cells), so memory follows the
cells in use; every method always receives views of the same storage.
Bookkeeping reads only the cells below `high`, past which no cell is owned:
max_cells is often 65536, and scanning all of it cost a decode step about
0.2 ms (bench/step_parts.py's host time). The per-step bookkeeping (check,
place, make_room, read_len, masks) works on numpy views of the owner and
position tensors: on a few hundred cells each of torch's operations costs
several times numpy's, and a decode step takes dozens.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from kvexport.contract.confined_io import available_memory
from kvexport.contract.errors import CapacityError, RuntimeRefusal
from kvexport.contract.manifest import CacheGeometry

MAX_SEQUENCES = 64
SCRATCH_CELL = 0

Allocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _position(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuntimeRefusal(f"{what}: a position is an int, got {value!r}")
    return value


def zeros_allocator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)  # allocate() zeroes what any allocator returns


def available_bytes(device: torch.device) -> float:
    """Memory a new pool may take: the kernel's MemAvailable for the CPU
    (a pool is zeroed as it is made, so an over-committed one would be
    killed, not refused); unbounded elsewhere (CUDA raises its own error)."""
    free = available_memory() if device.type == "cpu" else None
    return float("inf") if free is None else free


def allocate(allocator: Allocator, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor from the user's allocator. Pools start zeroed (the
    scratch cell is read on every call: uninitialised memory there, NaN
    from `torch.empty` or a pinned buffer, turns every row to NaN), and an
    allocator that returns the wrong thing is refused by name."""
    device = torch.device(device)
    tensor = allocator(tuple(shape), dtype, device)
    if not isinstance(tensor, torch.Tensor):
        raise RuntimeRefusal(f"the allocator returned {type(tensor).__name__}, not a tensor, for {tuple(shape)} {dtype}")
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype or tensor.device.type != device.type:
        raise RuntimeRefusal(
            f"the allocator returned {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} "
            f"for a request of {tuple(shape)} {dtype} on {device}"
        )
    return tensor.zero_()


def io_buffer(allocator: Allocator, values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An input buffer from the allocator, on the device, holding `values`.
    With the default allocator, a tensor the runtime built on the device, laid
    out from the start of its own storage, is its own buffer (no method
    writes its inputs): zeroing and copying each input took a tenth of a
    decode step's host work."""
    if allocator is zeros_allocator and values.device == device and values.is_contiguous() and not values.storage_offset():
        return values
    buffer = allocate(allocator, tuple(values.shape), values.dtype, device)
    buffer.copy_(values)
    return buffer


def sequence_bit(seq: int) -> int:
    """The int64 value with only bit `seq` set (bit 63 is the sign bit)."""
    return (1 << seq) if seq < 63 else -(1 << 63)


def sequence_mask(seqs: Iterable[int]) -> int:
    """The int64 value with the bits of all of seqs set (0 for none)."""
    bits = 0
    for seq in seqs:
        bits |= sequence_bit(seq)
    return bits


def _slack(needed: int) -> int:
    """Cells a step may read past its own before make_room moves cells:
    moving one costs about what reading one costs on a single step."""
    return 16 + needed // 16


class CellCache:
    def __init__(
        self,
        geometry: CacheGeometry,
        max_cells: int,
        dtype: torch.dtype,
        max_context_len: int,
        device: torch.device | str = "cpu",
        allocator: Allocator = zeros_allocator,
        initial_cells: int = 256,
    ):
        self.geometry = geometry
        self.max_cells = max_cells
        self.max_context_len = max_context_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.allocator = allocator
        self.owners = torch.zeros(max_cells, dtype=torch.int64)  # bit s set: sequence s owns the cell
        self.positions = torch.zeros(max_cells, dtype=torch.int64)
        self._owners, self._positions = self.owners.numpy(), self.positions.numpy()  # the same memory
        self.next_pos: dict[int, int] = {}  # live sequence -> its length
        self.high = SCRATCH_CELL + 1  # no cell at or above it is owned
        self.capacity = 0
        self.pools: list[torch.Tensor] = []  # k0, v0, k1, v1, ... each [capacity, heads, head_dim]
        self._grow(min(max_cells, initial_cells))

    # ---------------------------------------------------------------- pools
    def _grow(self, needed: int) -> None:
        new_capacity = min(self.max_cells, max(needed, 2 * self.capacity))
        free = available_bytes(self.device)
        if self.pool_bytes(new_capacity) > free:
            new_capacity = needed  # no doubling where the memory is not there
            if self.pool_bytes(needed) > free:
                g = self.geometry
                raise CapacityError(
                    f"a KV cell pool of {needed} cells needs {self.pool_bytes(needed) / 2**30:.1f} GiB "
                    f"({g.n_layers} layers of {max(g.kv_heads)} heads x {max(g.head_dims)} values, {self.dtype}), "
                    f"more than the {free / 2**30:.1f} GiB available: fewer cells (--max-cells) or a smaller package"
                )
        new_pools = []
        for layer in range(self.geometry.n_layers):
            shape = (new_capacity, self.geometry.kv_heads[layer], self.geometry.head_dims[layer])
            for kind in (0, 1):
                pool = allocate(self.allocator, shape, self.dtype, self.device)
                if self.pools:
                    pool[: self.capacity].copy_(self.pools[2 * layer + kind])
                new_pools.append(pool)
        self.pools, self.capacity = new_pools, new_capacity

    def pool_bytes(self, cells: int) -> int:
        """Bytes of every pool at `cells` cells."""
        return cells * self.geometry.cell_values * self.dtype.itemsize

    def views(self, n_cells: int) -> list[torch.Tensor]:
        """Views of the first n_cells cells of every pool, in input order."""
        if n_cells > self.capacity:
            self._grow(n_cells)
        return [pool[:n_cells] for pool in self.pools]

    # ------------------------------------------------------------ sequences
    def _check_live(self, seq: int) -> None:
        if seq not in self.next_pos:
            raise RuntimeRefusal(f"sequence {seq} is not live (released, or never created)")

    def new_sequence(self) -> int:
        for seq in range(MAX_SEQUENCES):
            if seq not in self.next_pos:
                self.next_pos[seq] = 0
                return seq
        raise CapacityError(f"all {MAX_SEQUENCES} sequences are live; release one first")

    def clone(self, src: int, upto: int | None = None) -> int:
        """A new sequence owning src's cells below position `upto` (default:
        all of them); no K/V is copied."""
        self._check_live(src)
        upto = self.next_pos[src] if upto is None else _position(upto, "clone upto")
        if not 0 <= upto <= self.next_pos[src]:
            raise RuntimeRefusal(f"clone upto={upto} is outside sequence {src}'s 0..{self.next_pos[src]}")
        seq = self.new_sequence()
        owners = self.owners[: self.high]
        shared = ((owners & sequence_bit(src)) != 0) & (self.positions[: self.high] < upto)
        owners[shared] |= sequence_bit(seq)
        self.next_pos[seq] = upto
        return seq

    def release(self, seq: int) -> None:
        """Frees the cells whose last owner seq was."""
        self._check_live(seq)
        self.owners[: self.high] &= ~sequence_bit(seq)
        del self.next_pos[seq]

    def rewind(self, seq: int, pos: int) -> None:
        """Keeps only positions below pos."""
        self._check_live(seq)
        pos = _position(pos, "rewind")
        if not 0 <= pos <= self.next_pos[seq]:
            raise RuntimeRefusal(f"rewind to {pos} is outside sequence {seq}'s 0..{self.next_pos[seq]}")
        owners = self.owners[: self.high]
        dropped = ((owners & sequence_bit(seq)) != 0) & (self.positions[: self.high] >= pos)
        owners[dropped] &= ~sequence_bit(seq)
        self.next_pos[seq] = pos

    def read_sequence(self, seq: int) -> list[torch.Tensor]:
        """A copy of seq's K/V in position order: one [length, heads, head_dim]
        tensor per pool (k0, v0, k1, ...), the layout write_sequence takes back."""
        self._check_live(seq)
        owned = torch.nonzero((self.owners[: self.high] & sequence_bit(seq)) != 0).squeeze(1)
        cells = owned[torch.argsort(self.positions[owned])]
        return [pool[cells].clone() for pool in self.pools]

    def write_sequence(self, seq: int, pools: list[torch.Tensor]) -> None:
        """Appends K/V read by read_sequence (of a sequence of this geometry and
        dtype) to the empty sequence seq; refused, changing nothing, when it does
        not fit the pool or its layout differs."""
        self._check_live(seq)
        if self.next_pos[seq] != 0:
            raise RuntimeRefusal(f"sequence {seq} is not empty: restore into a new session")
        expected = [(kv, self.geometry.kv_heads[layer], self.geometry.head_dims[layer])
                    for layer in range(self.geometry.n_layers) for kv in (0, 1)]
        if len(pools) != len(expected) or not pools:
            raise RuntimeRefusal(f"saved cells hold {len(pools)} pools; this cache has {len(expected)}")
        length = pools[0].shape[0]
        for tensor, (_, heads, dim) in zip(pools, expected):
            if tuple(tensor.shape) != (length, heads, dim) or tensor.dtype != self.dtype:
                raise RuntimeRefusal(f"saved cells of {tuple(tensor.shape)} {tensor.dtype} do not fit this cache's "
                                     f"({length}, {heads}, {dim}) {self.dtype}")
        self.check_step({seq: length})
        with self.placed([seq] * length) as (cells, _):
            targets = self.views(self.read_len())
            for target, tensor in zip(targets, pools):
                target[cells] = tensor.to(self.device)

    # ---------------------------------------------------------------- steps
    @property
    def free_cells(self) -> int:
        return self.max_cells - 1 - int(np.count_nonzero(self._owners[: self.high]))

    def check_step(self, counts: dict[int, int]) -> None:
        """Refuses, changing nothing, a step that adds counts[seq] tokens to
        each seq."""
        for seq, n in counts.items():
            self._check_live(seq)
            if self.next_pos[seq] + n > self.max_context_len:
                raise CapacityError(
                    f"sequence {seq} would reach {self.next_pos[seq] + n} tokens, past the context of "
                    f"{self.max_context_len}"
                )
        total = sum(counts.values())
        if total > self.free_cells:
            raise CapacityError(
                f"the step needs {total} cells but {self.free_cells} of {self.max_cells} are free "
                f"(one is the scratch cell); release sessions or export with a larger --max-cells"
            )

    def place(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Declares a step (one sequence id per token, in order): gives each
        token the lowest free cell and the next position of its sequence.
        Returns (cells, positions), int64 [T]. Call check_step first."""
        free = self._owners[: self.high] == 0
        free[SCRATCH_CELL] = False
        cells = np.flatnonzero(free)[: len(seqs)].astype(np.int64, copy=False)
        if len(cells) < len(seqs):  # the rest from the cells above high, all free
            cells = np.concatenate([cells, np.arange(self.high, self.high + len(seqs) - len(cells), dtype=np.int64)])
        top = int(cells[-1]) + 1 if len(cells) else 0
        if top > self.max_cells:
            raise AssertionError("place() without check_step()")
        self.high = max(self.high, top)
        positions = np.empty(len(seqs), dtype=np.int64)
        for i, seq in enumerate(seqs):
            positions[i] = self.next_pos[seq]
            self.next_pos[seq] += 1
        self._owners[cells] = [sequence_bit(s) for s in seqs]
        self._positions[cells] = positions
        return torch.from_numpy(cells), torch.from_numpy(positions)

    @contextlib.contextmanager
    def placed(self, seqs: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """place() as a transaction: if the block raises, the cells are free
        again and every sequence has the length it had before."""
        saved = dict(self.next_pos)
        cells, positions = self.place(seqs)
        try:
            yield cells, positions
        except BaseException:
            self.owners[cells] = 0
            self.next_pos.clear()
            self.next_pos.update(saved)
            raise

    def make_room(self, seqs: set[int], extra: int) -> int:
        """Before a step that adds `extra` tokens to `seqs`: when other cells
        sit among the cells those tokens would see, so much that reading past
        them costs more than moving them, moves cells so that seqs' cells,
        `extra` free ones and as many free again as the slack allows are the
        lowest above the scratch cell: the steps that follow grow into that
        headroom, and a session decoding beside an idle one moves cells once
        every slack steps, not every step (a move costs a call per pool,
        about 0.5 ms a step with SmolLM2's 60 pools). Returns the number of
        cells moved. Call check_step first."""
        bits = sequence_mask(seqs)
        # the room, the step's own cells, and as many free cells again as
        # could be evicted or placed all lie below this span
        span = min(self.max_cells, 2 * self.high + 3 * extra)
        owners = self._owners[:span]
        mine = (owners & bits) != 0
        free = owners == 0
        free[SCRATCH_CELL] = False
        mine_idx = np.flatnonzero(mine)
        needed = len(mine_idx) + extra  # the step's cells once it is placed
        naive = max(int(mine_idx[-1]) if len(mine_idx) else 0, int(np.flatnonzero(free)[extra - 1]) if extra else 0)
        if naive - needed <= _slack(needed):
            return 0
        # the evicted cells need homes above the room: at most as many free cells as the span holds beyond the step's
        headroom = max(0, min(_slack(needed), int(np.count_nonzero(free)) - extra))
        low = np.zeros_like(mine)
        low[SCRATCH_CELL + 1 : needed + headroom + 1] = True
        evict = np.flatnonzero(low & ~mine & ~free)  # others' cells in the room
        bring = np.flatnonzero(~low & mine)  # the step's cells above it
        into = np.flatnonzero(low & ~mine)[: len(bring)]  # evicted or free cells in the room
        away = np.concatenate([bring, np.flatnonzero(~low & free)])[: len(evict)]
        src, dst = np.concatenate([evict, bring]), np.concatenate([away, into])
        if len(src):
            self._move(*(torch.from_numpy(cells.astype(np.int64, copy=False)) for cells in (src, dst)))
        return len(src)

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Moves cells src[i] to dst[i] (every dst free or itself in src);
        sources nobody moves into are freed."""
        top = int(torch.cat([src, dst]).max()) + 1
        self.high = max(self.high, top)
        pools = self.views(top)
        for pool in pools:
            pool[dst] = pool[src].clone()
        owners, positions = self.owners[src].clone(), self.positions[src].clone()
        self.owners[src] = 0
        self.owners[dst] = owners
        self.positions[dst] = positions

    def read_len(self, seqs: set[int] | None = None) -> int:
        """One past the highest cell that one of `seqs` owns (any sequence when
        None); the scratch cell counts, so at least 1."""
        owners = self._owners[: self.high]
        owned = owners if seqs is None else owners & sequence_mask(seqs)
        occupied = np.flatnonzero(owned)
        return int(occupied[-1]) + 1 if len(occupied) else SCRATCH_CELL + 1

    def masks(self, seq_bits: torch.Tensor | np.ndarray, positions: torch.Tensor | np.ndarray,
              n_cells: int) -> list[torch.Tensor]:
        """One bool [T, n_cells] mask per distinct window: token i sees cell j
        iff j shares a sequence with i, and j's position is <= i's (and >
        i's - w on a window w). Padding rows (seq_bits 0) see only the scratch
        cell, so no row is fully masked. seq_bits and positions: int64 [T],
        host tensors or arrays."""
        seq_bits, positions = np.asarray(seq_bits), np.asarray(positions)
        owners = self._owners[:n_cells]  # [C]
        cell_pos = self._positions[:n_cells]
        pos = positions[:, None]  # [T, 1]
        base = ((owners & seq_bits[:, None]) != 0) & (cell_pos <= pos)
        padding = np.flatnonzero(seq_bits == 0)
        masks = []
        for window in self.geometry.distinct_windows:
            mask = base if window == 0 else base & (cell_pos > pos - window)
            if len(padding):
                mask = mask.copy()
                mask[padding, SCRATCH_CELL] = True
            masks.append(torch.from_numpy(mask))
        return masks
