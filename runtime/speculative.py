"""Speculative decoding through the off-graph contract's static methods.

A step over several of a session's tokens costs about what a step over one
costs while reading the weights dominates it. So each decoding session
drafts a few tokens cheaply and one step checks them all: the session's
entry is its sampled token followed by the drafts, with a selected row at
every position. The session keeps the drafts the target agrees with and the
target's own next token, and rewinds the cells of the rest.

Drafts come from
- prompt lookup: the longest n-gram (up to `ngram` tokens) that ends the
  session's text is looked up earlier in that text, and what followed its
  latest occurrence is proposed;
- a draft package: a cheaper package with the same tokenizer (a smaller
  model, or the same one quantized), whose sessions advance and rewind with
  the target's.

At temperature 0 a session emits exactly the tokens greedy decoding gives.
With sampling, a drafted token d at a position where the target draws from p
(after temperature, top-k and top-p, as the package's sampler does) and the
draft drew from q is kept with probability min(1, p(d) / q(d)); the first one
refused is replaced by a draw from max(p - q, 0) renormalised, and when all
are kept one more token is drawn from p (Leviathan et al., 2023), so every
token is distributed as the target's. Prompt lookup's q is all on d.

Under a grammar (runtime/grammar.py) the drafts it refuses are cut before
the step when the cut is exact: greedy rows, and drafts that were certain
(lookup); a draft package's sampled drafts stay whole, and the rule refuses
them itself (the masked p gives them 0). Every checked row is masked by the
grammar's state after the drafts before it.

How far a session drafts adapts to how many of its drafts were kept: two
more after a round that kept them all, one fewer after one that refused any,
between 1 and `max_draft`. How wide a step grows for drafts adapts to what
its methods cost on this machine now (`plan_drafts`): each static method's
calls are timed as they run, and a step takes the width, up to
`step_tokens` (default: the package's widest static method), that is
expected to decode the most tokens a second: the sessions' own and the
drafts each is expected to keep (from its recent acceptance), over the
method's time and the draft package's steps. While a step is bound by
reading the weights, a wider one costs little more and drafts pay; when the
decoding sessions fill a step, the wider methods cost what their rows do, and
the sessions decode plainly, so speculation costs a busy batch nothing.
Prompt lookup's drafts cost nothing to make, so they also fill what a
method would pad (a lone session that drafts on forward_8 checks up to 7
drafts a step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvexport.contract.errors import CapacityError, KvexportError
from kvexport.contract.package import TOKENIZER_DIR
from kvexport.contract.sampler import SamplingConfig, draw, params_row, probabilities
from kvexport.runtime.grammar import Constraint, Grammar, apply_draft_masks, apply_masks, valid_drafts
from kvexport.runtime.offgraph import OTHERS_PER_TOKEN, OffgraphKVManager, Session, StepEntry

MODES = ("lookup", "draft")
CATCH_UP_ALONE = 8  # a draft's feed longer than this (it catches up on a prompt) runs in a step of its own
# how much a sequence's earlier rounds weigh against its last in its estimate of acceptance: lookup's drafts
# come in bursts (a span it copies, then text of its own), a draft package's are steadier
RECENT = {"lookup": 0.5, "draft": 0.9}
# the keep rate assumed before any round: a draft package is one chosen for agreeing with the target (the 4w
# SmolLM2 keeps 0.85-0.9 of its drafts for the fp32 one); lookup's guesses are right less often
PRIOR = {"lookup": 0.5, "draft": 0.8}


@dataclass
class SpeculationStats:
    rounds: int = 0  # session-rounds that drafted at least one token
    drafted: int = 0
    accepted: int = 0
    refusals: int = 0  # rounds whose drafts the target refused one of
    # per draft position j (from 0): rounds that checked a j-th draft after keeping every one before it, and
    # those that kept it too
    reached: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)
    prior: float = 0.5  # the keep rate assumed before any round

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def count(self, drafted: int, kept: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += kept
        self.refusals += kept < drafted
        while len(self.reached) < drafted:
            self.reached.append(0)
            self.passed.append(0)
        for j in range(min(kept + 1, drafted)):
            self.reached[j] += 1
            self.passed[j] += j < kept

    def expected_kept(self, k: int) -> float:
        """How many of k drafts are kept, from how often each position was
        kept once reached, over every sequence so far (where a position has
        few rounds, the overall keep rate stands in): a draft package's
        drafts are kept alike whatever the text, more surely the further a
        round's run of agreement goes than one rate would say."""
        prior, expected, survive = self.keep_rate, 0.0, 1.0
        for j in range(k):
            reached, passed = (self.reached[j], self.passed[j]) if j < len(self.reached) else (0, 0)
            survive *= (passed + 2 * prior) / (reached + 2)
            expected += survive
        return expected

    @property
    def keep_rate(self) -> float:
        """How often a draft is kept when every one before it was, over
        every sequence so far: a new sequence's first estimate (`prior`
        before any)."""
        return keep_rate(self.accepted, self.refusals, self.prior)


def keep_rate(kept: float, refused: float, prior: float) -> float:
    """How often a draft is kept when every one before it was: `kept`
    drafts kept and `refused` rounds ended by a refusal, with two rounds at
    the `prior` rate added (so it is below 1, and `prior` before any)."""
    return (kept + 2 * prior) / (kept + refused + 2)


@dataclass
class Speculation:
    """How `generate` drafts. `draft` is the draft package's runtime (mode
    "draft"); `stats` counts what the drafts did."""

    mode: str = "lookup"
    draft: OffgraphKVManager | None = None
    max_draft: int = 8
    ngram: int = 3
    step_tokens: int | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)

    def __post_init__(self) -> None:
        if self.mode in PRIOR:
            self.stats.prior = PRIOR[self.mode]

    def check(self, target: OffgraphKVManager) -> None:
        if self.mode not in MODES:
            raise KvexportError(f"--speculative must be one of lookup, draft, off; got {self.mode!r}")
        if self.max_draft < 1:
            raise KvexportError(f"the draft length must be at least 1, got {self.max_draft}")
        if self.ngram < 1:
            raise KvexportError(f"the lookup n-gram must be at least 1 token, got {self.ngram}")
        if not getattr(target, "batches_sessions", False):
            raise KvexportError("speculative decoding needs an offgraph_kv package (it checks drafts in one batched step)")
        if self.mode == "draft":
            check_draft(target, self.draft)
        elif self.draft is not None:
            raise KvexportError("a draft package drafts only with --speculative draft")
        for manager in (target, self.draft):  # plan_drafts weighs widths by their calls' times
            if manager is not None:
                manager.time_calls()

    def drafting(self, prompt: Sequence[int], generator: torch.Generator) -> Drafting:
        """A new sequence's drafting state."""
        return Drafting(NgramIndex(prompt, self.ngram), generator, width=min(4, self.max_draft),
                        prior=self.stats.keep_rate, recent=RECENT[self.mode],
                        shared=self.stats if self.mode == "draft" else None)

    def step_width(self, target: OffgraphKVManager) -> int:
        """The widest step drafts may fill: `step_tokens`, else the target's
        widest static method."""
        return self.step_tokens or max(target.static_sizes, default=target.widest)


def resolve_mode(speculative: str | None, draft_given: bool, max_draft: int) -> str:
    """The mode the CLI's --speculative, --draft and --max-draft ask for:
    draft with a draft package, else off, unless --speculative says."""
    mode = speculative or ("draft" if draft_given else "off")
    if mode == "draft" and not draft_given:
        raise KvexportError("--speculative draft needs a draft package: add --draft PKG")
    if mode != "draft" and draft_given:
        raise KvexportError(f"--draft drafts only with --speculative draft (not {mode})")
    if max_draft < 1:
        raise KvexportError(f"--max-draft must be at least 1, got {max_draft}")
    return mode


def check_draft(target: OffgraphKVManager, draft: OffgraphKVManager | None) -> None:
    """A draft package must batch sessions and speak the target's tokens."""
    if draft is None:
        raise KvexportError("--speculative draft needs a draft package (--draft PKG)")
    if not getattr(draft, "batches_sessions", False):
        raise KvexportError("the draft package must be an offgraph_kv package (export it with --use-offgraph-kv-cache)")
    if draft.vocab_size != target.vocab_size:
        raise KvexportError(
            f"the draft package's vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}: "
            "a draft must share the target's tokenizer"
        )
    ours, theirs = _tokenizer_digests(target), _tokenizer_digests(draft)
    if ours != theirs:
        differ = sorted(name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name))
        raise KvexportError(f"the draft package's tokenizer differs from the target's ({', '.join(differ)}): "
                            "a draft must share it")


def _tokenizer_digests(manager: OffgraphKVManager) -> dict[str, str]:
    """The digest of each of the package's tokenizer files but the chat
    template (which changes no token's id); none without a tokenizer."""
    files = manager.package.manifest.get("files", {})
    return {name: entry.get("sha256") for name, entry in files.items()
            if name.startswith(f"{TOKENIZER_DIR}/") and not name.endswith(".jinja")}


class NgramIndex:
    """A session's tokens and, for every n-gram (n <= ngram) that something
    followed, where it last began: prompt lookup in constant time a token."""

    def __init__(self, tokens: Sequence[int], ngram: int):
        self.ngram = ngram
        self.tokens: list[int] = []
        self.starts: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # every gram that ends here now has a follower: `token`
            for n in range(1, min(self.ngram, end) + 1):
                self.starts[tuple(self.tokens[end - n : end])] = end - n
            self.tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest n-gram ending the text
        at its latest earlier occurrence; none when no n-gram recurs."""
        tokens = self.tokens
        for n in range(min(self.ngram, len(tokens)), 0, -1):
            start = self.starts.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


@dataclass
class Drafting:
    """One sequence's drafting state, kept beside its session."""

    context: NgramIndex  # the prompt and every token emitted (the pending one last)
    generator: torch.Generator
    width: int = 4  # drafts it asks for next round
    draft_session: Session | None = None
    draft_fed: int = 0  # context tokens the draft session's cells hold
    # drafts kept and rounds ended by a refused draft, recent rounds weighing most, and the keep rate
    # assumed before them (SpeculationStats.keep_rate when the sequence began)
    kept: float = 0.0
    refused: float = 0.0
    prior: float = 0.5
    guess: int | None = None  # lookup's proposal for the next token in a step without drafts
    recent: float = RECENT["draft"]
    shared: SpeculationStats | None = None  # a draft package's: every sequence's rounds estimate each one's

    @property
    def pending(self) -> int:
        return self.context.tokens[-1]

    def expected_kept(self, k: int) -> float:
        """How many of k drafts the target is expected to keep: each is kept
        with the rate of this sequence's recent drafts (the prior before
        any), and only while every one before it was; with `shared`, as
        every sequence's rounds say."""
        if self.shared is not None:
            return self.shared.expected_kept(k)
        rate = keep_rate(self.kept, self.refused, self.prior)
        return rate * (1 - rate**k) / (1 - rate)

    def record(self, drafted: int, kept: int) -> None:
        self.kept = self.recent * self.kept + kept
        self.refused = self.recent * self.refused + (kept < drafted)

    def extend(self, token: int) -> None:
        """A token the sequence emitted joins its text; a step without drafts
        still tells how lookup's guess would have fared (its drafts cost
        nothing to make, so a sequence copying its input again resumes them)."""
        if self.guess is not None:
            self.record(1, int(self.guess == token))
            self.guess = None
        self.context.extend([token])


def allot(states: Sequence[Drafting], room: Sequence[int], width: int, sizes: Sequence[int] = ()) -> list[int]:
    """Drafts each sequence may make this step: what it asks for, within
    its room (tokens it may still emit, less the target's own) and the
    step's spare width (`width` less one token per sequence), the surest
    drafters first. With `sizes`, the static methods' widths (for drafts
    that cost nothing to make: prompt lookup's), the drafts then grow into
    the positions the step's method would pad anyway, up to the narrowest
    size that holds the step (no wider than `width`)."""
    spare = width - len(states)
    allowed = [0] * len(states)
    order = sorted(range(len(states)), key=lambda i: -states[i].width)
    for i in order:
        allowed[i] = max(min(states[i].width, spare, room[i]), 0)
        spare -= allowed[i]
    total = len(states) + sum(allowed)
    padded = min((n for n in sizes if total <= n <= width), default=total)
    for i in order:
        more = max(min(padded - total, room[i] - allowed[i]), 0)
        allowed[i] += more
        total += more
    return allowed


def plan_drafts(states: Sequence[Drafting], left: Sequence[int], max_draft: int, others: int,
                target: OffgraphKVManager, draft: OffgraphKVManager | None, width: int) -> list[int]:
    """Drafts each sequence makes in a step of decoding sessions alone (the
    drafting ones, each with `left` tokens it may still emit, and
    `others`): the allotment (a step's width up to `width` tokens, and the
    most drafts a sequence makes, up to `max_draft`) whose step is expected
    to decode the most tokens a second.

    A step costs its static method's measured time (the target's
    MethodCosts; a method not measured lately costs what the nearest
    narrower one measured, so it gets tried; before any is measured, every
    width costs the same) and, with a draft package, a draft step per round
    of drafts, and the draft's prefill of what a sequence's draft cells
    lack (after a prompt, or steps without drafts), shared among the steps
    left to that sequence; a draft package drafts only once a step's cost
    is measured. Its tokens are the sessions' own and the drafts
    each is expected to keep. While a step is bound by reading the weights
    a wider one costs little more and drafts pay; when the sessions fill
    the step, wider methods cost what their rows do and the step decodes
    plainly. Prompt lookup's drafts cost nothing to make: they also fill
    what the method would pad."""
    sessions = len(states) + others
    plain = _narrowest(target, sessions)
    if not states or plain is None or plain > width:
        return [0] * len(states)
    room = [max(min(n - 1, max_draft), 0) for n in left]
    if draft is None:  # what lookup can propose
        room = [min(r, len(s.context.propose(r))) for s, r in zip(states, room)]
    if draft is not None and not _measured(target):
        return [0] * len(states)  # a draft package's steps cost time: not before a plain step has a measured cost
    cost = _costs(target, 1.0)
    draft_cost = _costs(draft, 0.0) if draft is not None else {}
    best, best_rate = [0] * len(states), sessions / cost[plain]
    expected = [[0.0] * (r + 1) for r in room]  # expected[i][k]: of k drafts, how many sequence i keeps
    for state, table in zip(states, expected):
        for k in range(1, len(table)):
            table[k] = state.expected_kept(k)
    most_kept = sum(table[-1] for table in expected)
    # the draft's prefill per token, or, before it has measured one, the target's (a draft reads fewer bytes, but
    # a prompt's products are bound by arithmetic: a 4w SmolLM2 prefills at about the fp32 one's rate)
    per_token = 0.0
    if draft is not None:
        per_token = draft.costs.of(OTHERS_PER_TOKEN) or target.costs.of(OTHERS_PER_TOKEN) or 0.0
    catch_up = [per_token * max(len(s.context.tokens) - s.draft_fed - 1, 0) / max(n, 1) for s, n in zip(states, left)]
    least_draft = min(draft_cost.values(), default=0.0)  # a draft step's least cost
    for n in (n for n in target.static_sizes if sessions < n <= width):
        if (sessions + most_kept) / max(cost[n] + least_draft, 1e-9) <= best_rate:
            continue  # no drafts pay for this width (a wider method costs at least a narrower one's time)
        for most in range(1, max(room, default=0) + 1) if draft is not None else [max(room, default=0)]:
            allowed = allot(states, [min(r, most) for r in room], n - others, [n - others] if draft is None else ())
            kept = [table[k] for table, k in zip(expected, allowed)]
            seconds = cost[_narrowest(target, sessions + sum(allowed))]
            if draft is not None:
                seconds += _draft_seconds(draft, draft_cost, allowed)
                seconds += sum(c * (1 + e) for c, e, k in zip(catch_up, kept, allowed) if k)
            rate = (sessions + sum(kept)) / max(seconds, 1e-9)
            if rate > best_rate:
                best, best_rate = allowed, rate
    for state, k, r in zip(states, best, room):
        state.guess = state.context.propose(1)[0] if draft is None and r and not k else None
    return best


def _narrowest(manager: OffgraphKVManager, tokens: int) -> int | None:
    return next((n for n in manager.static_sizes if n >= tokens), None)


def _measured(manager: OffgraphKVManager) -> bool:
    return any(manager.costs.of(f"forward_{m}") is not None for m in manager.static_sizes)


def _costs(manager: OffgraphKVManager, unmeasured: float) -> dict[int, float]:
    """Each static method's measured time; for one not measured, the
    nearest narrower method's, else the cheapest measured (optimistic, so it
    gets tried); `unmeasured` when the manager has measured none yet."""
    known = {m: manager.costs.of(f"forward_{m}") for m in manager.static_sizes}
    known = {m: seconds for m, seconds in known.items() if seconds is not None}
    if not known:
        return {m: unmeasured for m in manager.static_sizes}
    out, last = {}, min(known.values())
    for m in manager.static_sizes:
        last = out[m] = known.get(m, last)
    return out


def _draft_seconds(draft: OffgraphKVManager, cost: dict[int, float], allowed: Sequence[int]) -> float:
    """The draft package's steps for these drafts: one a round, over the
    sequences still drafting (the first round's catch-up on what its cells
    lack counted apart)."""
    seconds = 0.0
    for round_ in range(1, max(allowed) + 1):
        n = _narrowest(draft, sum(k >= round_ for k in allowed))
        seconds += cost[n] if n is not None else 0.0
    return seconds


def propose(states: Sequence[Drafting], allowed: Sequence[int], draft: OffgraphKVManager | None,
            samplings: Sequence[SamplingConfig]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
    """Each sequence's drafts and, from a draft package that samples, the
    distributions they were drawn from. A draft package that refuses the
    step (its pool is full) drafts nothing this time."""
    if draft is None:
        return [s.context.propose(k) if k else [] for s, k in zip(states, allowed)], [None] * len(states)
    try:
        return _draft_tokens(draft, states, allowed, samplings)
    except KvexportError:
        for s in states:  # its cells may hold a partial round: start over from what it fed before
            if s.draft_session is not None and s.draft_session.live:
                draft.rewind(s.draft_session, min(s.draft_session.length, s.draft_fed))
        return [[] for _ in states], [None] * len(states)


def _draft_tokens(draft: OffgraphKVManager, states: Sequence[Drafting], allowed: Sequence[int],
                  samplings: Sequence[SamplingConfig]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
    """Runs the draft package up to k steps (batched over the sequences):
    the first feeds what its cells lack of each sequence's text, each next
    one the last draft."""
    drafts: list[list[int]] = [[] for _ in states]
    dists: list[list[torch.Tensor]] = [[] for _ in states]
    feed = {i: s.context.tokens[s.draft_fed :] for i, (s, k) in enumerate(zip(states, allowed)) if k}
    while feed:
        # a sequence catching up on a long text (a prompt) is fed alone: in one step with others, each one's rows
        # are scored against every cell of theirs through the mask (portable packages, and aoti ones compiled
        # before their attention shim took such steps apart by session): 2.8 x slower for 16 prompts of 220
        # tokens; alone, it costs an aoti package with that shim 4% more than together
        alone = [[i] for i in feed if len(feed[i]) > CATCH_UP_ALONE]
        together = [i for i in feed if len(feed[i]) <= CATCH_UP_ALONE]
        for order in alone + ([together] if together else []):
            logits = draft.step([StepEntry(states[i].draft_session, feed[i], True) for i in order])
            _take_drafts(order, logits, states, samplings, drafts, dists)
        feed = {i: [drafts[i][-1]] for i in feed if len(drafts[i]) < allowed[i]}
    return drafts, [torch.stack(d) if d else None for d in dists]


def _take_drafts(order: Sequence[int], logits: Sequence[torch.Tensor], states: Sequence[Drafting],
                 samplings: Sequence[SamplingConfig], drafts: list[list[int]], dists: list[list[torch.Tensor]]) -> None:
    """Each sequence's next draft from the draft package's logits for it."""
    for i, row in zip(order, logits):
        state = states[i]
        if not drafts[i]:
            state.draft_fed = len(state.context.tokens)
        if samplings[i].greedy:
            token = int(torch.argmax(row))
        else:
            q = probabilities(row.unsqueeze(0), samplings[i])[0]
            token = draw(q, float(torch.rand((), generator=state.generator)))
            dists[i].append(q)
        drafts[i].append(token)


def verify(manager: OffgraphKVManager, states: Sequence[Drafting], drafts: Sequence[list[int]],
           qs: Sequence[torch.Tensor | None], rows: Sequence[torch.Tensor], samplings: Sequence[SamplingConfig],
           on_device_sampler: bool = True) -> list[list[int]]:
    """Per sequence: the drafts the target keeps and then its own token.
    rows[i] is [1 + len(drafts[i]), V]: the logits after the pending token
    and after each draft. Greedy rows and undrafted sampled rows go through
    the package's sampler together, as plain decoding draws them."""
    out: list[list[int] | None] = [None] * len(states)
    plain = [i for i in range(len(states)) if samplings[i].greedy or not drafts[i]]
    if plain:
        logits = torch.cat([rows[i] for i in plain])
        params = torch.tensor([params_row(samplings[i], states[i].generator)
                               for i in plain for _ in range(rows[i].shape[0])], dtype=torch.float32)
        chosen = manager.sample(logits, params, on_device=on_device_sampler).tolist()
        at = 0
        for i in plain:
            want = chosen[at : at + rows[i].shape[0]]
            at += rows[i].shape[0]
            n = 0
            while n < len(drafts[i]) and drafts[i][n] == want[n]:
                n += 1
            out[i] = drafts[i][:n] + [want[n]]
    for i in range(len(states)):
        if out[i] is None:
            out[i] = accept(probabilities(rows[i], samplings[i]), drafts[i], qs[i], states[i].generator)
    return out  # type: ignore[return-value]


def cut_to_grammar(constraints: Sequence[Constraint | None], drafts: Sequence[list[int]],
                   qs: Sequence[torch.Tensor | None]) -> list[list[int]]:
    """The drafts a grammar refuses cut (see the module's docstring): only
    where the drafts were certain (no q), since the accept/reject rule must
    refuse a sampled draft itself to keep the target's distribution."""
    return valid_drafts([c if q is None else None for c, q in zip(constraints, qs)], drafts)


def settle(manager: OffgraphKVManager, session: Session, draft: OffgraphKVManager | None, state: Drafting,
           drafted: int, kept: int, max_draft: int, stats: SpeculationStats) -> None:
    """After a checked step: the width adapts, the target's cells keep the
    pending token and the kept drafts, the draft's cells what agrees with
    them. Call before the new tokens join the context."""
    if drafted:
        stats.count(drafted, kept)
        state.record(drafted, kept)
        state.width = min(state.width + 2, max_draft) if kept == drafted else max(state.width - 1, 1)
    manager.rewind(session, session.length - (drafted - kept))
    if draft is not None and state.draft_session is not None:
        state.draft_fed = min(state.draft_session.length, len(state.context.tokens) + kept)
        draft.rewind(state.draft_session, state.draft_fed)


@dataclass
class _Track:
    """One prompt's decoding state in `generate`."""

    index: int
    session: Session
    drafting: Drafting
    limit: int  # tokens it may emit in all
    constraint: Constraint | None = None
    emitted: list[int] = field(default_factory=list)


def generate_speculative(
    manager: OffgraphKVManager,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    on_token: Callable[[int, int], None] | None,
    on_device_sampler: bool,
    stop_at_eos: bool,
    speculation: Speculation,
    grammar: Grammar | None = None,
) -> list[list[int]]:
    """`generate` with drafts (see the module's docstring); called by
    `generate`, which has checked the speculation, the prompts and the admission."""
    draft = speculation.draft if speculation.mode == "draft" else None
    if draft is not None:
        _check_draft_room(draft, prompts, max_new_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return outputs
    width = speculation.step_width(manager)
    tracks: list[_Track] = []
    try:
        for i, prompt in enumerate(prompts):
            drafting = speculation.drafting(prompt, torch.Generator().manual_seed(seed + i))
            constraint = grammar.constraint() if grammar is not None else None
            tracks.append(_Track(i, manager.new_session(), drafting, max_new_tokens, constraint))
            if draft is not None:
                drafting.draft_session = draft.new_session()
        # the prompts go in as one step, as plain decoding does, and their first tokens are drawn the same way
        logits = manager.step([StepEntry(t.session, list(prompt), True) for t, prompt in zip(tracks, prompts)])
        logits = apply_masks([t.constraint for t in tracks], logits)
        params = torch.tensor([params_row(sampling, t.drafting.generator) for t in tracks], dtype=torch.float32)
        first = manager.sample(logits, params, on_device=on_device_sampler).tolist()
        active = [t for t, token in zip(tracks, first) if not _emit(t, [token], manager, stop_at_eos, on_token, outputs)]
        while active:
            states = [t.drafting for t in active]
            samplings = [sampling] * len(active)
            left = [t.limit - len(t.emitted) for t in active]
            allowed = plan_drafts(states, left, speculation.max_draft, 0, manager, draft, width)
            drafts, qs = propose(states, allowed, draft, samplings)
            constraints = [t.constraint for t in active]
            drafts = cut_to_grammar(constraints, drafts, qs)
            entries = [StepEntry(t.session, [t.drafting.pending, *d], True, rows=1 + len(d)) for t, d in zip(active, drafts)]
            rows = [r if r.dim() == 2 else r.unsqueeze(0) for r in manager.step(entries)]
            rows = apply_draft_masks(constraints, drafts, rows)
            kept = verify(manager, states, drafts, qs, rows, samplings, on_device_sampler)
            still = []
            for track, d, tokens in zip(active, drafts, kept):
                settle(manager, track.session, draft, track.drafting, len(d), len(tokens) - 1, speculation.max_draft,
                       speculation.stats)
                if not _emit(track, tokens, manager, stop_at_eos, on_token, outputs):
                    still.append(track)
            active = still
    finally:
        for track in tracks:
            for owner, session in ((manager, track.session), (draft, track.drafting.draft_session)):
                if session is not None and session.live:
                    owner.release(session)
    return outputs


def _emit(track: _Track, tokens: list[int], manager: OffgraphKVManager, stop_at_eos: bool,
          on_token: Callable[[int, int], None] | None, outputs: list[list[int]]) -> bool:
    """Emits tokens in order until an EOS or the limit; True when the track is done."""
    for token in tokens:
        if track.constraint is not None:
            track.constraint.advance(token)
        track.emitted.append(token)
        track.drafting.extend(token)
        outputs[track.index].append(token)
        if on_token is not None:
            on_token(track.index, token)
        if (stop_at_eos and token in manager.eos_ids) or len(track.emitted) >= track.limit:
            return True
    return False


def accept(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """The accept/reject rule: p [k + 1, V] the target's distributions at the
    k drafted positions and after them, q [k, V] the draft's (None: each
    draft was certain). Returns the kept drafts and one drawn token."""
    for j, token in enumerate(drafts):
        p_j = p[j]
        q_j = q[j] if q is not None else None
        q_d = float(q_j[token]) if q_j is not None else 1.0
        if float(torch.rand((), generator=generator)) * q_d < float(p_j[token]):
            continue
        if q_j is None:
            residual = p_j.clone()
            residual[token] = 0
        else:
            residual = torch.clamp(p_j - q_j, min=0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p_j
        return drafts[:j] + [draw(residual, float(torch.rand((), generator=generator)))]
    return drafts + [draw(p[len(drafts)], float(torch.rand((), generator=generator)))]


def _check_draft_room(draft: OffgraphKVManager, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """The draft package holds what the target holds, less the last token."""
    cache = draft.cache
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > cache.max_context_len:
        raise CapacityError(
            f"the draft package's context is {cache.max_context_len} tokens; these prompts need {longest}: "
            "export the draft with a larger --max-context-len"
        )
    needed = sum(len(p) + max(max_new_tokens - 1, 0) for p in prompts)
    if needed > cache.free_cells:
        raise CapacityError(
            f"the draft package needs up to {needed} cells but {cache.free_cells} are free: export the draft with a "
            "larger --max-cells, or run fewer prompts"
        )
