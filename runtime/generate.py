"""A batch executor: many prompts as concurrent sessions, one step per
generated token for all of them, sampling on the package's sampler."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvexport.runtime.cell_cache import MAX_SEQUENCES
from kvexport.contract.errors import CapacityError, KvexportError
from kvexport.runtime.offgraph import OffgraphKVManager, StepEntry, check_token_ids
from kvexport.contract.sampler import SamplingConfig, params_row
from kvexport.runtime.single_sequence import SingleSequenceManager
from kvexport.runtime.grammar import Grammar, apply_masks
from kvexport.runtime.speculative import Speculation, generate_speculative

TokenCallback = Callable[[int, int], None]  # (prompt index, token id)


def generate(
    manager: OffgraphKVManager,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    on_token: TokenCallback | None = None,
    on_device_sampler: bool = True,
    stop_at_eos: bool = True,
    speculation: Speculation | None = None,
    grammar: Grammar | None = None,
) -> list[list[int]]:
    """Generates for every prompt at once; returns the new ids per prompt, in
    prompt order (an EOS id that ended a sequence is included, as HF does).
    Prompt i samples with its own generator seeded `seed + i`, so its tokens
    do not depend on the other prompts. With `speculation` each session
    drafts tokens and checks them in one step (runtime/speculative.py): the
    same tokens at temperature 0, the same distribution otherwise. With
    `grammar` every output follows it (runtime/grammar.py): the tokens it
    forbids are masked out of the logits before each draw."""
    sampling.validate()
    _check_seed(seed, len(prompts))
    if max_new_tokens < 0:
        raise KvexportError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if speculation is not None:
        speculation.check(manager)
    if not manager.batches_sessions:
        return _generate_one_at_a_time(manager, prompts, max_new_tokens, sampling, seed, on_token, stop_at_eos, grammar)
    _check_admission(manager, prompts, max_new_tokens)
    if speculation is not None:
        return generate_speculative(manager, prompts, max_new_tokens, sampling, seed, on_token, on_device_sampler,
                                    stop_at_eos, speculation, grammar)
    outputs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return outputs
    sessions = []
    constraints = [grammar.constraint() for _ in prompts] if grammar is not None else None
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    pending = [list(p) for p in prompts]
    active = list(range(len(prompts)))
    try:
        sessions = [manager.new_session() for _ in prompts]
        while active:
            logits = manager.step_logits([StepEntry(sessions[i], pending[i], True) for i in active])
            rows = apply_masks([constraints[i] for i in active] if constraints is not None else [None] * len(active), logits)
            params = torch.tensor([params_row(sampling, generators[i]) for i in active], dtype=torch.float32)
            drawn = manager.sample(rows, params, on_device=on_device_sampler).tolist()
            still = []
            for i, token in zip(active, drawn):
                if constraints is not None:
                    constraints[i].advance(token)
                outputs[i].append(token)
                if on_token is not None:
                    on_token(i, token)
                if (stop_at_eos and token in manager.eos_ids) or len(outputs[i]) >= max_new_tokens:
                    manager.release(sessions[i])
                else:
                    pending[i] = [token]
                    still.append(i)
            active = still
    finally:
        for session in sessions:
            if session.live:
                manager.release(session)
    return outputs


SEEDS = 1 << 64  # a torch.Generator seed is an unsigned 64-bit integer


def _check_seed(seed: int, prompts: int) -> None:
    """Every seed + i a prompt samples with must be a generator's seed."""
    last = seed + max(prompts, 1) - 1
    if not (isinstance(seed, int) and 0 <= seed and last < SEEDS):
        raise KvexportError(
            f"--seed must be in 0..{SEEDS - max(prompts, 1)} (prompt i samples with seed + i, a 64-bit seed), got {seed}"
        )


def _check_admission(manager: OffgraphKVManager, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise KvexportError("no prompts to generate for")
    free_sequences = MAX_SEQUENCES - len(manager.cache.next_pos)
    if len(prompts) > free_sequences:
        raise CapacityError(
            f"{len(prompts)} prompts, but only {free_sequences} of {MAX_SEQUENCES} sessions are free; release some or run fewer"
        )
    context = manager.cache.max_context_len
    needed = 0
    for i, prompt in enumerate(prompts):
        check_token_ids(prompt, manager.vocab_size, f"prompt {i}")
        if len(prompt) == 0:
            raise KvexportError(f"prompt {i} is empty")
        length = len(prompt) + max_new_tokens
        if length > context:
            raise CapacityError(
                f"prompt {i} has {len(prompt)} tokens; with --max-new-tokens {max_new_tokens} it would need "
                f"{length} positions, past the package's context of {context}"
            )
        needed += len(prompt) + max(max_new_tokens - 1, 0)
    if needed > manager.cache.free_cells:
        raise CapacityError(
            f"these prompts need up to {needed} cells but {manager.cache.free_cells} are free; run fewer prompts, "
            f"lower --max-new-tokens, or export with a larger --max-cells"
        )


def _generate_one_at_a_time(
    manager: SingleSequenceManager,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    on_token: TokenCallback | None,
    stop_at_eos: bool,
    grammar: Grammar | None = None,
) -> list[list[int]]:
    """A single-sequence contract runs its prompts one after another; every
    prompt is checked against the context before any runs."""
    if not prompts:
        raise KvexportError("no prompts to generate for")
    for i, prompt in enumerate(prompts):
        check_token_ids(prompt, manager.vocab_size, f"prompt {i}")
        if len(prompt) == 0:
            raise KvexportError(f"prompt {i} is empty")
        if len(prompt) + max_new_tokens > manager.context:
            raise CapacityError(
                f"prompt {i} has {len(prompt)} tokens; with --max-new-tokens {max_new_tokens} it would need "
                f"{len(prompt) + max_new_tokens} positions, past the package's context of {manager.context}"
            )
    outputs: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        manager.reset()
        generator = torch.Generator().manual_seed(seed + i)
        constraint = grammar.constraint() if grammar is not None else None
        out: list[int] = []
        pending = list(prompt)
        while len(out) < max_new_tokens:
            logits = manager.step(pending)
            if constraint is not None:
                logits = constraint.apply(logits)
            params = torch.tensor([params_row(sampling, generator)], dtype=torch.float32)
            token = int(manager.sample(logits.unsqueeze(0), params)[0])
            if constraint is not None:
                constraint.advance(token)
            out.append(token)
            if on_token is not None:
                on_token(i, token)
            if stop_at_eos and token in manager.eos_ids:
                break
            pending = [token]
        outputs.append(out)
    return outputs
