"""The serving engine: one thread owns the runtime and its cell pool and
steps every running request together (continuous batching).

Each step packs every decoding choice's next token and slices of waiting
prompts (chunked prefill under a per-step token budget), runs them as one
`OffgraphKVManager.step`, samples every row that is due in one call, and
hands each request its new text through a sink. Requests join between steps,
and a finished or cancelled one frees its cells at once (or leaves them to
the prefix cache). The HTTP side talks to the engine only through
`submit` and `cancel`, which never wait for a step; the engine never waits
for a client (a sink only queues).

Admission reserves the worst case: a request starts only when the free
cells, less what running requests may still claim, hold its prompt and its
`max_tokens` on every choice. So a step is never refused for cells, and a
step that fails for another reason fails only the requests in it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvexport.contract.errors import KvexportError
from kvexport.contract.sampler import SamplingConfig, params_row
from kvexport.runtime.cell_cache import MAX_SEQUENCES
from kvexport.runtime.offgraph import OffgraphKVManager, Session, StepEntry, check_token_ids
from kvexport.runtime.server.prefix_cache import Holder, PrefixCache
from kvexport.runtime.server.state import restore_sessions, save_sessions
from kvexport.runtime.grammar import Constraint, Grammar, apply_draft_masks, apply_masks
from kvexport.runtime.speculative import (
    Drafting, Speculation, cut_to_grammar, plan_drafts, propose, settle, verify,
)
from kvexport.runtime.text import StopMatcher, Text, TextStream

log = logging.getLogger(__name__)


class RequestError(KvexportError):
    """A request this server can never run as asked (a client's error: HTTP 400)."""


class QueueFull(KvexportError):
    """More requests wait than the queue holds (HTTP 429)."""


class ShuttingDown(KvexportError):
    """The engine takes no more requests (HTTP 503)."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0  # choice i samples with seed + i
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely ones'
    ignore_eos: bool = False
    grammar: Grammar | None = None  # response_format: every choice follows it


# ------------------------------------------------------------------ events
@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their log-probabilities


@dataclass
class Delta:
    """New text of one choice (text may be empty while a stop string could
    still begin; `logprobs` holds one entry per token generated since)."""

    choice: int
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Finished:
    choice: int
    reason: str  # "stop" (EOS or a stop string) or "length"


@dataclass
class Done:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Failed:
    message: str


Event = Delta | Finished | Done | Failed
Sink = Callable[[Event], None]


# ------------------------------------------------------------------ state
@dataclass
class _Choice:
    index: int
    holder: Holder
    generator: torch.Generator
    stream: TextStream | None
    matcher: StopMatcher
    output: list[int] = field(default_factory=list)
    pending: int | None = None  # the sampled token the next step feeds
    finished: bool = False
    last_token_time: float = 0.0
    drafting: Drafting | None = None  # with speculative decoding
    draft_holder: Holder | None = None  # with a draft package: its session, in the draft's prefix cache
    constraint: Constraint | None = None  # with a grammar

    @property
    def session(self) -> Session:
        return self.holder.session


@dataclass(eq=False)
class _Job:
    id: int
    request: GenerationRequest
    sink: Sink
    arrival: float
    choices: list[_Choice] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache (cloned or computed)
    cached_tokens: int = 0
    started: bool = False

    @property
    def prefilling(self) -> bool:
        return self.started and self.prefilled < len(self.request.prompt)

    def remaining_cells(self) -> int:
        """The most cells this job may still claim: the rest of its prompt and
        every choice's tokens still to be stepped (a last token is never stepped)."""
        rest = len(self.request.prompt) - self.prefilled
        per_choice = self.request.max_tokens - 1
        if not self.choices or self.prefilling:
            return rest + self.request.n * per_choice
        return sum(per_choice - max(len(c.output) - 1, 0) for c in self.choices if not c.finished)


class Handle:
    """What submit returns: cancel it when the client goes away."""

    def __init__(self, job: _Job):
        self._job = job


@dataclass
class StepStats:
    """Timings of one engine iteration, for the metrics."""

    tokens: int
    decodes: int
    model_seconds: float  # the step and sampling
    own_seconds: float  # scheduling, detokenizing, stop strings, events
    cells_read: int  # cells each call of the step attended over (its C)


class Engine:
    def __init__(
        self,
        manager: OffgraphKVManager,
        text: Text | None,
        max_sessions: int = 32,
        max_queue: int = 256,
        max_step_tokens: int = 256,
        prefix_cache_cells: int | None = None,
        on_step: Callable[[StepStats], None] | None = None,
        on_token_times: Callable[[float | None, float | None], None] | None = None,
        state_dir: Path | None = None,
        package_digest: str = "",
        speculation: Speculation | None = None,
    ):
        self.check_options(max_sessions, max_queue, max_step_tokens, prefix_cache_cells)
        if speculation is not None:
            speculation.check(manager)
        self.speculation = speculation
        self.draft = speculation.draft if speculation is not None and speculation.mode == "draft" else None
        # drafts fill a step up to the widest static method, never past it
        self.draft_width = speculation.step_width(manager) if speculation is not None else 0
        self.manager = manager
        self.text = text
        self.max_sessions = max_sessions
        self.max_queue = max_queue
        self.max_step_tokens = max_step_tokens
        self.prefix = PrefixCache(manager, prefix_cache_cells)
        # the draft package's sessions share prompt prefixes the same way: a
        # draft otherwise prefills every prompt whole before its first draft
        self.draft_prefix = PrefixCache(self.draft, prefix_cache_cells) if self.draft is not None else None
        self.on_step = on_step
        self.on_token_times = on_token_times  # (time to first token, inter-token gap), seconds
        self.context = manager.cache.max_context_len
        self._ids = itertools.count(1)
        self.cancelled = 0  # requests cancelled before they finished (their clients left)
        self._lock = threading.Condition()
        self._inbox: list[_Job] = []
        self._cancels: list[_Job] = []
        self._stopping = False
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: list[_Job] = []
        self._active = 0  # sessions the running jobs hold or will fork (written by the engine thread only)
        self.state_dir, self.package_digest = state_dir, package_digest
        if state_dir is not None and state_dir.is_dir():
            restored = restore_sessions(self.prefix, state_dir, package_digest)
            log.info("restored %d cached sessions from %s", restored, state_dir)
        self._note_cache()
        self._thread = threading.Thread(target=self._loop, name="kvexport-engine", daemon=True)
        self._thread.start()

    @staticmethod
    def check_options(max_sessions: int, max_queue: int, max_step_tokens: int, prefix_cache_cells: int | None) -> None:
        if not 1 <= max_sessions < MAX_SEQUENCES:
            raise KvexportError(f"--max-sessions must be in 1..{MAX_SEQUENCES - 1} (the cell cache holds {MAX_SEQUENCES} "
                                f"sequences), got {max_sessions}")
        if max_queue < 1:
            raise KvexportError(f"--max-queue must be at least 1, got {max_queue}")
        if max_step_tokens < 1:
            raise KvexportError(f"--max-step-tokens must be at least 1, got {max_step_tokens}")
        if prefix_cache_cells is not None and prefix_cache_cells < 0:
            raise KvexportError(f"--prefix-cache-cells must be >= 0 (0 turns the prefix cache off), got {prefix_cache_cells}")

    # ------------------------------------------------------- any thread
    def check(self, request: GenerationRequest) -> None:
        """Refuses a request that could never run, naming the limit."""
        prompt = request.prompt
        if not prompt:
            raise RequestError("the prompt is empty")
        try:
            check_token_ids(prompt, self.manager.vocab_size, "the prompt")
        except KvexportError as e:
            raise RequestError(str(e)) from None
        if request.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if len(prompt) + request.max_tokens > self.context:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; with max_tokens {request.max_tokens} it needs "
                f"{len(prompt) + request.max_tokens} positions, past this model's context of {self.context} tokens"
            )
        if not 1 <= request.n <= self.max_sessions:
            raise RequestError(f"n must be in 1..{self.max_sessions} (this server's --max-sessions), got {request.n}")
        cells = len(prompt) + request.n * (request.max_tokens - 1)
        pool = self.manager.cache.max_cells - 1
        if cells > pool:
            raise RequestError(f"the request needs up to {cells} cells, more than this server's pool of {pool}: lower max_tokens or n")

    def submit(self, request: GenerationRequest, sink: Sink) -> Handle:
        self.check(request)
        with self._lock:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            # requests the free sessions will take at the next step are not waiting
            waiting = len(self._inbox) + len(self._waiting) - max(self.max_sessions - self._active, 0)
            if waiting >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting (this server's --max-queue); retry shortly")
            job = _Job(next(self._ids), request, sink, time.perf_counter())
            self._inbox.append(job)
            self._lock.notify()
        return Handle(job)

    def cancel(self, handle: Handle) -> None:
        with self._lock:
            self._cancels.append(handle._job)
            self._lock.notify()

    def shutdown(self, timeout: float = 120.0) -> None:
        """Cancels whatever still runs and stops the loop."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self._inbox) + len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def cells_in_use(self) -> int:
        cache = self.manager.cache
        return cache.max_cells - 1 - cache.free_cells

    # ------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._cancels or self._running or self._waiting or self._stopping):
                    self._lock.wait()
                arrived, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                stopping = self._stopping
            self._waiting.extend(arrived)
            for job in cancels:
                self._cancel(job)
            if stopping:
                for job in list(self._running) + list(self._waiting):
                    self._fail(job, "the server is shutting down")
                if self.state_dir is not None:
                    saved = save_sessions(self.prefix, self.state_dir, self.package_digest)
                    log.info("saved %d cached sessions to %s", saved, self.state_dir)
                return
            try:
                self._admit()
                if self._running:
                    self._step()
            except Exception:  # a bug: fail every request rather than hang them
                log.exception("the engine failed; failing every request")
                for job in list(self._running) + list(self._waiting):
                    self._fail(job, "internal error in the engine")
            self._note_cache()

    def _note_cache(self) -> None:
        """What the prefix cache holds, for the metrics: another thread must
        not walk the holders while this one changes them."""
        self.cached_entries = self.prefix.cached_count
        self.cached_cells = self.prefix.cached_only_cells()

    def _cancel(self, job: _Job) -> None:
        if job in self._running:
            self._close(job)
        elif job in self._waiting:
            self._waiting.remove(job)
        else:
            return  # it had finished
        self.cancelled += 1

    def _fail(self, job: _Job, message: str) -> None:
        if job in self._waiting:
            self._waiting.remove(job)
        if job in self._running:
            self._close(job)
        job.sink(Failed(message))

    def _close(self, job: _Job) -> None:
        """Frees a job's sessions that are still live (a cancelled or failed
        job's cells are released, not cached: its tokens may be partial)."""
        self._running.remove(job)
        self._active -= job.request.n
        for choice in job.choices:
            self._drop_draft(choice)
            if choice.session.live:
                self.prefix.forget(choice.holder)
                self.manager.release(choice.session)

    def _drop_draft(self, choice: _Choice, finished: bool = False) -> None:
        """Ends a choice's draft session: a finished one's is kept in the
        draft's prefix cache, a cancelled or failed one's released."""
        holder, choice.draft_holder = choice.draft_holder, None
        if holder is None or not holder.session.live:
            return
        if not finished:
            self.draft_prefix.forget(holder)
            self.draft.release(holder.session)
            return
        if holder.session.length > len(holder.tokens):  # drafts past what was delivered
            self.draft.rewind(holder.session, len(holder.tokens))
        self.draft_prefix.retire(holder)

    def _draft_session(self, choice: _Choice, prompt: list[int]) -> None:
        """A draft session for the choice, holding the longest prefix of the
        prompt the draft's cached sessions share (cloned: nothing is copied)."""
        while len(self.draft.cache.next_pos) >= MAX_SEQUENCES and self.draft_prefix.evict_one():
            pass
        holder, matched = self.draft_prefix.lookup(prompt)
        session = self.draft.clone(holder.session, matched) if holder is not None else self.draft.new_session()
        choice.drafting.draft_session, choice.drafting.draft_fed = session, matched
        # the holder's tokens are the drafting context itself: the draft's cells hold its first session.length
        choice.draft_holder = self.draft_prefix.hold(session, choice.drafting.context.tokens)

    # ---------------------------------------------------------- admission
    def _free_cells(self) -> int:
        return self.manager.cache.free_cells - sum(job.remaining_cells() for job in self._running)

    def _free_sequences(self) -> int:
        """Sequence ids free, less those running jobs will take when they fork their choices."""
        forks = sum(job.request.n - len(job.choices) for job in self._running)
        return MAX_SEQUENCES - len(self.manager.cache.next_pos) - forks

    def _admit(self) -> None:
        """Starts waiting jobs, first come first served, while sessions and cells allow."""
        while self._waiting:
            job = self._waiting[0]
            if self._active + job.request.n > self.max_sessions:
                return
            while self._free_sequences() < job.request.n and self.prefix.evict_one():
                pass
            if self._free_sequences() < job.request.n:
                return
            holder, matched = self.prefix.lookup(job.request.prompt)
            if holder is not None:
                session = self.manager.clone(holder.session, matched)
            else:
                session = self.manager.new_session()
            job.prefilled = job.cached_tokens = matched
            job.started = True  # remaining_cells() now counts from what the clone holds
            need = job.remaining_cells()
            while self._free_cells() < need and self.prefix.evict_one():
                pass
            if self._free_cells() < need:
                self.manager.release(session)
                job.started, job.prefilled, job.cached_tokens = False, 0, 0
                if not self._running and not self.prefix.cached_count:
                    self._waiting.popleft()
                    job.sink(Failed(f"the request needs {need} cells and the pool cannot free them"))
                    continue
                return
            self._waiting.popleft()
            self._start(job, session)

    def _start(self, job: _Job, session: Session) -> None:
        request = job.request
        holder = self.prefix.hold(session, list(request.prompt))
        job.choices = [self._choice(job, 0, holder)]
        self._running.append(job)
        self._active += request.n

    def _choice(self, job: _Job, index: int, holder: Holder) -> _Choice:
        generator = torch.Generator().manual_seed(job.request.seed + index)
        stream = TextStream(self.text) if self.text is not None else None
        choice = _Choice(index, holder, generator, stream, StopMatcher(job.request.stop))
        if job.request.grammar is not None:  # masked before each draw, drafted rows too
            choice.constraint = job.request.grammar.constraint()
        spec = self.speculation
        if spec is not None:
            choice.drafting = spec.drafting(job.request.prompt, generator)
            if self.draft is not None:
                self._draft_session(choice, list(job.request.prompt))
        return choice

    # --------------------------------------------------------------- step
    def _step(self) -> None:
        began = time.perf_counter()
        entries: list[StepEntry] = []
        due: list[tuple[_Job, _Choice | None]] = []  # per entry: the decoding choice, or None for a prefill slice
        for job in self._running:
            for choice in job.choices:
                if not choice.finished and choice.pending is not None:
                    due.append((job, choice))
        drafts, qs = self._drafts(due)
        for (job, choice), d in zip(due, drafts):
            entries.append(StepEntry(choice.session, [choice.pending, *d], True, rows=1 + len(d)))
        decodes = sum(len(e.tokens) for e in entries)
        budget = self.max_step_tokens - decodes
        for job in self._running:
            if budget <= 0:
                break
            if job.prefilling:
                prompt = job.request.prompt
                take = min(budget, len(prompt) - job.prefilled)
                last = job.prefilled + take == len(prompt)
                entries.append(StepEntry(job.choices[0].session, prompt[job.prefilled : job.prefilled + take], last))
                due.append((job, None))
                budget -= take
        if not entries:
            return
        tokens = sum(len(e.tokens) for e in entries)
        model_began = time.perf_counter()
        try:
            logits = self.manager.step(entries)
        except KvexportError as e:  # refused before any state changed: only these requests fail
            for job in {job for job, _ in due}:
                self._fail(job, f"the step was refused: {e}")
            return
        model_seconds = time.perf_counter() - model_began
        rows: list[tuple[_Job, _Choice, torch.Tensor]] = []
        checked: list[tuple[_Job, _Choice, list[int], torch.Tensor | None, torch.Tensor]] = []
        for k, ((job, choice), entry, row) in enumerate(zip(due, entries, logits)):
            if choice is not None and drafts[k]:
                checked.append((job, choice, drafts[k], qs[k], row if row.dim() == 2 else row.unsqueeze(0)))
                continue
            if choice is not None:
                choice.holder.tokens.append(choice.pending)
                choice.pending = None
                self.prefix.update(choice.holder)
                rows.append((job, choice, row))
                continue
            job.prefilled += len(entry.tokens)
            self.prefix.update(job.choices[0].holder)
            if row is not None:  # the prompt is in: every choice samples from its last logits
                self._fork(job)
                rows.extend((job, choice, row) for choice in job.choices)
        if checked:
            model_seconds += self._check(checked)
        if rows:
            model_began = time.perf_counter()
            drawn, logprobs = self._sample(rows)
            model_seconds += time.perf_counter() - model_began
            now = time.perf_counter()
            for (job, choice, _), token, lp in zip(rows, drawn, logprobs):
                self._deliver(job, choice, token, lp, now)
        if self.on_step is not None:
            own = time.perf_counter() - began - model_seconds
            self.on_step(StepStats(tokens, decodes, model_seconds, own, self.manager.cells_read))

    def _drafts(self, due: list[tuple[_Job, _Choice | None]]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Each decoding choice's drafts (none without speculation; as many as
        plan_drafts finds pay for the step), cut where a grammar refuses them."""
        if self.speculation is None or not due:
            return [[] for _ in due], [None] * len(due)
        drafting = [(k, job, choice) for k, (job, choice) in enumerate(due) if choice.drafting is not None]
        states = [choice.drafting for _, _, choice in drafting]
        left = [job.request.max_tokens - len(choice.output) for _, job, choice in drafting]
        others = len(due) - len(drafting)
        if any(job.prefilling for job in self._running):
            # a prompt slice joins the step, on forward_others, whose time grows with every row: drafts there
            # cost what a prompt's tokens do (bench/serve.py --speculative lookup, 16 clients: 0.93 x with them)
            allowed = [0] * len(states)
        else:
            allowed = plan_drafts(states, left, self.speculation.max_draft, others, self.manager, self.draft,
                                  self.draft_width)
        if self.draft is not None:  # room in the draft's pool for what its sessions lack and draft
            need = sum(len(s.context.tokens) - s.draft_fed + k for s, k in zip(states, allowed) if k)
            while self.draft.cache.free_cells < need and self.draft_prefix.evict_one():
                pass
        got, got_q = propose(states, allowed, self.draft, [job.request.sampling for _, job, _ in drafting])
        got = cut_to_grammar([choice.constraint for _, _, choice in drafting], got, got_q)
        drafts: list[list[int]] = [[] for _ in due]
        qs: list[torch.Tensor | None] = [None] * len(due)
        for (k, _, _), d, q in zip(drafting, got, got_q):
            drafts[k], qs[k] = d, q
        return drafts, qs

    def _check(self, checked: list[tuple[_Job, _Choice, list[int], torch.Tensor | None, torch.Tensor]]) -> float:
        """Keeps the drafts the target agrees with and delivers them and the
        target's own token; returns the model time it took."""
        spec = self.speculation
        began = time.perf_counter()
        drafts = [d for _, _, d, _, _ in checked]
        rows = apply_draft_masks([c.constraint for _, c, _, _, _ in checked], drafts, [r for _, _, _, _, r in checked])
        kept = verify(self.manager, [c.drafting for _, c, _, _, _ in checked], drafts, [q for _, _, _, q, _ in checked],
                      rows, [job.request.sampling for job, _, _, _, _ in checked])
        model_seconds = time.perf_counter() - began
        now = time.perf_counter()
        for (job, choice, drafted, _, _), tokens, row in zip(checked, kept, rows):
            logprobs = _logprobs(row[: len(tokens)], tokens, [job.request.logprobs] * len(tokens))
            settle(self.manager, choice.session, self.draft, choice.drafting, len(drafted), len(tokens) - 1,
                   spec.max_draft, spec.stats)
            choice.holder.tokens.extend([choice.pending, *drafted[: len(tokens) - 1]])
            choice.pending = None
            self.prefix.update(choice.holder)
            for token, logprob in zip(tokens, logprobs):
                self._deliver(job, choice, token, logprob, now)
                if choice.finished:
                    break
            if choice.draft_holder is not None:  # its cells hold delivered tokens only now
                self.draft_prefix.update(choice.draft_holder)
        return model_seconds

    def _fork(self, job: _Job) -> None:
        """n > 1: the other choices clone the prompt's cells (nothing is copied)."""
        first = job.choices[0]
        for index in range(1, job.request.n):
            session = self.manager.clone(first.session)
            holder = self.prefix.hold(session, list(job.request.prompt))
            job.choices.append(self._choice(job, index, holder))

    def _sample(self, rows: list[tuple[_Job, _Choice, torch.Tensor]]) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = apply_masks([choice.constraint for _, choice, _ in rows], [row for _, _, row in rows])
        params = torch.tensor([params_row(job.request.sampling, choice.generator) for job, choice, _ in rows],
                              dtype=torch.float32)
        drawn = self.manager.sample(logits, params).tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        wanted = [i for i, (job, _, _) in enumerate(rows) if job.request.logprobs is not None]
        if wanted:
            tops = [rows[i][0].request.logprobs for i in wanted]
            for i, logprob in zip(wanted, _logprobs(logits[wanted], [drawn[i] for i in wanted], tops)):
                logprobs[i] = logprob
        return drawn, logprobs

    def _deliver(self, job: _Job, choice: _Choice, token: int, logprob: TokenLogprob | None, now: float) -> None:
        request = job.request
        if job not in self._running:  # failed earlier in this step
            return
        if choice.constraint is not None:
            try:
                choice.constraint.advance(token)
            except KvexportError as e:  # the grammar refused a drawn token: only this request fails
                self._fail(job, str(e))
                return
        choice.output.append(token)
        if choice.drafting is not None:
            choice.drafting.extend(token)
        if self.on_token_times is not None:
            first = len(choice.output) == 1
            self.on_token_times(now - job.arrival if first else None, None if first else now - choice.last_token_time)
        choice.last_token_time = now
        eos = token in self.manager.eos_ids and not request.ignore_eos
        text, stopped = "", False
        if choice.stream is not None and not eos:
            text, stopped = choice.matcher.feed(choice.stream.push(token))
        reason = "stop" if eos or stopped else "length" if len(choice.output) >= request.max_tokens else None
        if reason is not None and not stopped:
            text += choice.matcher.flush()
        job.sink(Delta(choice.index, text, [token], [logprob] if logprob is not None else None))
        if reason is None:
            choice.pending = token
            return
        choice.finished = True
        self._drop_draft(choice, finished=True)
        job.sink(Finished(choice.index, reason))
        self.prefix.retire(choice.holder)
        if all(c.finished for c in job.choices) and len(job.choices) == request.n:
            self._running.remove(job)
            self._active -= request.n
            completion = sum(len(c.output) for c in job.choices)
            job.sink(Done(len(request.prompt), completion, job.cached_tokens))


def _logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int | None]) -> list[TokenLogprob | None]:
    """Per row of logits [R, V] (masked as the draw saw them), the
    log-probability of the token drawn from it and of its row's `tops` most
    likely ones; Nones where no logprobs are asked."""
    if all(k is None for k in tops):
        return [None] * len(tokens)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    out: list[TokenLogprob | None] = []
    for row, token, k in zip(log_probs, tokens, tops):
        values, ids = torch.topk(row, k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        out.append(TokenLogprob(token, float(row[token]), list(zip(ids.tolist(), values.tolist()))))
    return out
