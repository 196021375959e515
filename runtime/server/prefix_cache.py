"""Automatic prefix caching over the cell pool.

Every live session the server knows is a *holder* of the tokens its cells
hold: a running request's session while it prefills and decodes, and, once
the request is done, the session itself, kept as a *cached* holder instead
of being released. A new prompt is matched against the holders' tokens by
hashes of block-aligned prefixes (a chain: block k's hash covers blocks
0..k), then token by token past the last whole block; a hit clones the
holder's cells up to the match (the cell cache shares them, nothing is
copied) and the request prefills only the rest.

Cached holders are evicted least recently used when cells or sequence ids
run short, or past `max_cells` cells held by the cache alone. A running
holder is never evicted, and a clone owns its shared cells itself, so
evicting the holder it came from changes nothing for it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvexport.runtime.cell_cache import sequence_mask
from kvexport.runtime.offgraph import OffgraphKVManager, Session

BLOCK_TOKENS = 16


@dataclass
class Holder:
    session: Session
    tokens: list[int]  # the session's tokens: its cells hold the first session.length of them
    cached: bool = False  # True: kept for reuse only, evictable
    hashes: list[int] = field(default_factory=list)  # hashes of its whole blocks, in order


def block_hashes(tokens: list[int], start: list[int], upto: int) -> list[int]:
    """The chain `start` extended over the whole blocks of tokens[:upto]."""
    chain = list(start)
    for k in range(len(chain), upto // BLOCK_TOKENS):
        previous = chain[-1] if chain else 0
        chain.append(hash((previous, tuple(tokens[k * BLOCK_TOKENS : (k + 1) * BLOCK_TOKENS]))))
    return chain


class PrefixCache:
    def __init__(self, manager: OffgraphKVManager, max_cells: int | None = None):
        self.manager = manager
        self.max_cells = max_cells  # cells held by cached holders alone; None: whatever the pool spares
        self.enabled = max_cells is None or max_cells > 0
        self.holders: OrderedDict[int, Holder] = OrderedDict()  # by sequence id; cached ones least recently used first
        self.index: dict[int, set[int]] = {}  # block-prefix hash -> sequence ids of the holders that have it
        self.queries = self.hits = self.hit_tokens = 0

    # ------------------------------------------------------------ holders
    def hold(self, session: Session, tokens: list[int]) -> Holder:
        """Registers a running session whose cells hold `tokens` so far."""
        holder = Holder(session, tokens)
        self.holders[session.seq] = holder
        self.update(holder)
        return holder

    def update(self, holder: Holder) -> None:
        """Indexes the whole blocks the holder's session has computed since."""
        if not self.enabled:
            return
        chain = block_hashes(holder.tokens, holder.hashes, holder.session.length)
        for h in chain[len(holder.hashes) :]:
            self.index.setdefault(h, set()).add(holder.session.seq)
        holder.hashes = chain

    def forget(self, holder: Holder) -> None:
        """Drops the holder (its session is the caller's to release)."""
        for h in holder.hashes:
            owners = self.index.get(h)
            if owners is not None:
                owners.discard(holder.session.seq)
                if not owners:
                    del self.index[h]
        self.holders.pop(holder.session.seq, None)

    def retire(self, holder: Holder) -> None:
        """A finished request's session: kept as a cached holder, or released
        when another cached holder already covers its tokens. A cached holder
        whose tokens it extends is released instead."""
        manager = self.manager
        del holder.tokens[holder.session.length :]  # a last sampled token was never stepped
        if not self.enabled or holder.session.length == 0:
            self.forget(holder)
            manager.release(holder.session)
            return
        tokens = holder.tokens
        for other in [h for h in self.holders.values() if h.cached and h is not holder]:
            if len(other.tokens) >= len(tokens) and other.tokens[: len(tokens)] == tokens:
                self.forget(holder)
                manager.release(holder.session)
                self.touch(other)
                return
            if other.tokens == tokens[: len(other.tokens)]:
                self.forget(other)
                manager.release(other.session)
        holder.cached = True
        self.touch(holder)
        self.trim()

    def touch(self, holder: Holder) -> None:
        self.holders.move_to_end(holder.session.seq)

    # ------------------------------------------------------------- lookup
    def lookup(self, prompt: list[int]) -> tuple[Holder | None, int]:
        """The holder sharing the longest prefix with `prompt`, and that
        prefix's length; at most len(prompt) - 1, so the request still
        prefills one token and gets its logits."""
        if not self.enabled:
            return None, 0
        self.queries += 1
        limit = len(prompt) - 1
        best: set[int] = set()
        chain: list[int] = []
        while (len(chain) + 1) * BLOCK_TOKENS <= limit:
            chain = block_hashes(prompt, chain, (len(chain) + 1) * BLOCK_TOKENS)
            owners = self.index.get(chain[-1])
            if not owners:
                break
            best = owners
        found, matched = None, 0
        for seq in reversed(self.holders):  # most recently used first
            if seq not in best:
                continue
            holder = self.holders[seq]
            n = _common_prefix(holder.tokens, prompt, min(limit, holder.session.length))
            if n > matched:
                found, matched = holder, n
        if found is not None:
            self.hits += 1
            self.hit_tokens += matched
            if found.cached:
                self.touch(found)
        return found, matched

    # ----------------------------------------------------------- eviction
    def evict_one(self) -> bool:
        """Releases the least recently used cached holder; False when none is left."""
        for holder in self.holders.values():
            if holder.cached:
                self.forget(holder)
                self.manager.release(holder.session)
                return True
        return False

    def cached_only_cells(self) -> int:
        """Cells that only cached holders own."""
        bits = sequence_mask(h.session.seq for h in self.holders.values() if h.cached)
        if bits == 0:
            return 0
        cache = self.manager.cache
        owners = cache.owners[: cache.high]  # no cell above is owned; the engine asks after every step
        return int((((owners & bits) != 0) & ((owners & ~bits) == 0)).sum())

    def trim(self) -> None:
        if self.max_cells is not None:
            while self.cached_only_cells() > self.max_cells and self.evict_one():
                pass

    @property
    def cached_count(self) -> int:
        return sum(1 for h in self.holders.values() if h.cached)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most limit."""
    n = min(limit, len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
