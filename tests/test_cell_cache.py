"""The cell cache's bookkeeping, without a model: make_room moves cells so a
step reads its own, and no sequence can tell (runtime/cell_cache.py)."""

from __future__ import annotations

import random

import pytest
import torch

from kvexport.contract.errors import CapacityError
from kvexport.contract.manifest import CacheGeometry
from kvexport.runtime.cell_cache import SCRATCH_CELL, CellCache


def contents(cache: CellCache) -> dict[int, list[tuple[int, float]]]:
    """Each live sequence's (position, K value) pairs in position order."""
    out = {}
    for seq in cache.next_pos:
        owned = torch.nonzero((cache.owners & (1 << seq)) != 0).squeeze(1)
        pairs = [(int(cache.positions[c]), float(cache.pools[0][c, 0, 0])) for c in owned]
        out[seq] = sorted(pairs)
    return out


def test_make_room_keeps_every_sequence_and_packs_the_steps_cells_low():
    """Random steps, clones, releases and rewinds: moves are invisible, a
    step reads its own cells, and place gives the lowest free ones."""
    rng = random.Random(0)
    cache = CellCache(CacheGeometry((1, 1), (2, 2), (0, 0)), max_cells=400, dtype=torch.float32,
                      max_context_len=300, initial_cells=8)
    stamp = 1.0
    moved_total = 0
    for _ in range(300):
        live = list(cache.next_pos)
        action = rng.random()
        if action < 0.15 or not live:
            if len(live) < 10:
                cache.new_sequence()
            continue
        if action < 0.32:
            seq = rng.choice(live)
            if action < 0.25 and rng.random() < 0.5:
                cache.release(seq)
            elif action < 0.25 and len(live) < 10:
                cache.clone(seq, rng.randint(0, cache.next_pos[seq]))
            elif action >= 0.25:
                cache.rewind(seq, rng.randint(0, cache.next_pos[seq]))
            assert not bool(cache.owners[cache.high:].any())  # bookkeeping reads only below high
            continue
        step = rng.sample(live, rng.randint(1, min(3, len(live))))
        counts = {seq: rng.randint(1, 12) for seq in step}
        if any(cache.next_pos[s] + n > 300 for s, n in counts.items()) or sum(counts.values()) > cache.free_cells:
            continue
        cache.check_step(counts)
        before = contents(cache)
        moved_total += cache.make_room(set(counts), sum(counts.values()))
        assert contents(cache) == before  # moving is invisible to every sequence
        seqs = [s for s, n in counts.items() for _ in range(n)]
        free = cache.owners == 0
        free[SCRATCH_CELL] = False
        lowest = torch.nonzero(free).squeeze(1)[: len(seqs)]
        cells, _ = cache.place(seqs)
        assert torch.equal(cells, lowest)  # the lowest free cells, above high too
        assert not bool(cache.owners[cache.high:].any())
        pools = cache.views(cache.read_len(set(counts)))
        for cell in cells.tolist():
            pools[0][cell, 0, 0] = stamp
            stamp += 1
        assert int(cache.owners[SCRATCH_CELL]) == 0
        own = int(((cache.owners & sum(1 << s for s in counts)) != 0).sum())
        assert cache.read_len(set(counts)) <= 1 + own + 16 + own // 16  # read: scratch, own cells, slack
    assert moved_total > 0


def test_a_session_decoding_beside_an_idle_one_moves_cells_once_every_slack_steps():
    """An idle session holds the lowest cells; one decoding a token a step
    beside it moves cells now and then, into room it can grow into, not on
    every step, and still reads no more than its own cells and the slack."""
    cache = CellCache(CacheGeometry((1, 1), (2, 2), (0, 0)), max_cells=1024, dtype=torch.float32,
                      max_context_len=512, initial_cells=8)
    idle, busy = cache.new_sequence(), cache.new_sequence()
    for seq, n in ((idle, 64), (busy, 32)):
        cache.check_step({seq: n})
        cache.make_room({seq}, n)
        cache.place([seq] * n)
    moves = 0
    for _ in range(96):
        cache.check_step({busy: 1})
        before = contents(cache)
        moves += cache.make_room({busy}, 1) > 0
        assert contents(cache) == before
        cache.place([busy])
        own = cache.next_pos[busy]
        assert cache.read_len({busy}) <= 1 + own + 16 + own // 16
    assert 1 <= moves <= 96 // 16


def test_a_pool_larger_than_the_memory_is_refused_before_it_is_allocated():
    """A package may declare 1024 layers of 1024 heads of 4096 values, each
    within its bound: 256 cells of that are 8 TiB. The pool is refused by
    its size, naming the fix, instead of killing the process as it zeroes."""
    huge = CacheGeometry((1024,) * 1024, (4096,) * 1024, (0,) * 1024)
    with pytest.raises(CapacityError, match=r"256 cells needs 8192.0 GiB .*--max-cells"):
        CellCache(huge, max_cells=1 << 20, dtype=torch.float32, max_context_len=4096)
    # where the memory is there, a pool that would double past it grows to what is needed
    cache = CellCache(CacheGeometry((1,), (64,), (0,)), max_cells=1 << 20, dtype=torch.float32, max_context_len=4096,
                      initial_cells=4)
    assert cache.capacity == 4
    cache.views(6)
    assert cache.capacity == 8
