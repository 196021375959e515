"""Output that follows a grammar: a JSON schema, any JSON object, or a
regular expression, through llguidance (a maintained grammar engine, from
the package registry) over the package's own tokenizer.

Each constrained sequence keeps a matcher. Before each draw the tokens the
grammar forbids get -inf logits, so whatever the sampler draws (the
package's `sample` methods or the host's) is allowed, greedy or not; each
drawn token then advances the matcher. When the grammar is complete the
only token left is an EOS id, so generation ends there.

With speculative decoding the drafts a grammar refuses are cut before the
step (the target could never keep them), and each row of the step is masked
by the matcher's state after the drafts before it, so the target keeps and
draws exactly what it would one token at a time.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from typing import Any, Sequence

import numpy as np
import torch

from kvexport.contract.errors import KvexportError

# llguidance's tokenizer of each package's Text (converting one takes about a second)
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_EXECUTOR: list = []  # llguidance's thread pool, made on first use


class GrammarError(KvexportError):
    """A grammar the engine refused (a bad schema or regex): the message says why."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:  # pragma: no cover  (a dependency of kvexport; a broken install)
        raise KvexportError("structured output needs llguidance: pip install llguidance") from None
    return llguidance


class Grammar:
    """A grammar checked against one package's tokenizer; `constraint()`
    makes the state of one sequence."""

    def __init__(self, text, grammar: str, vocab_size: int, eos_ids: frozenset[int], what: str):
        llg = _llguidance()
        if text is None:
            raise GrammarError(f"{what}: the package has no tokenizer, and a grammar is matched on text")
        self.tokenizer = _tokenizer(text, vocab_size, eos_ids)
        self.grammar, self.vocab_size, self.what = grammar, vocab_size, what
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{what}: refused by the grammar engine: {_short(matcher.get_error())}")

    @classmethod
    def json_schema(cls, text, schema: Any, vocab_size: int, eos_ids: frozenset[int]) -> "Grammar":
        """Any JSON value that validates against `schema` (a dict or its JSON text)."""
        llg = _llguidance()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(_finite_numbers(schema), defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema was refused: {_short(str(e))}") from None
        return cls(text, grammar, vocab_size, eos_ids, "the JSON schema")

    @classmethod
    def json_object(cls, text, vocab_size: int, eos_ids: frozenset[int]) -> "Grammar":
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls.json_schema(text, {"type": "object"}, vocab_size, eos_ids)

    @classmethod
    def regex(cls, text, pattern: str, vocab_size: int, eos_ids: frozenset[int]) -> "Grammar":
        grammar = _llguidance().LLMatcher.grammar_from_regex(pattern)
        return cls(text, grammar, vocab_size, eos_ids, f"the regex {pattern!r}")

    def constraint(self) -> "Constraint":
        return Constraint(self)


class Constraint:
    """One sequence's place in a grammar."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.matcher = _llguidance().LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next."""
        return allowed_tokens([self])[0]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every forbidden token at -inf."""
        return apply_masks([self], logits.unsqueeze(0))[0]

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)) or self.matcher.is_error():
            raise KvexportError(f"{self.grammar.what}: token {token} broke the grammar "
                                f"({_short(self.matcher.get_error())})")


def allowed_tokens(constraints: Sequence[Constraint]) -> torch.Tensor:
    """bool [len(constraints), V]: the tokens each allows next, computed
    together on llguidance's thread pool (one at a time, the masks of 8
    sessions took a tenth of a decode step, bench/structured.py)."""
    vocab = _vocabulary(constraints)
    words = torch.full((len(constraints), (vocab + 31) // 32), -1, dtype=torch.int32)
    # what llguidance.torch.fill_next_token_bitmask_par does, without importing that module (which
    # defines torch.compile'd and torch.jit code on import); `words` is ours, contiguous, on the CPU
    _executor().unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)], words.data_ptr(),
                                        words.shape[1] * 4, len(constraints))
    return _unpack(words, vocab)


def allowed_after_drafts(constraints: Sequence[Constraint], drafts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per constraint, bool [1 + len(drafts[i]), V]: the tokens it allows
    next and after each of its drafts in turn, up to the first draft it
    refuses (the rows past that one allow everything: nothing is kept
    there). The matchers end where they began."""
    vocab = _vocabulary(constraints)
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + 1 + len(d))
    words = torch.full((starts[-1], (vocab + 31) // 32), -1, dtype=torch.int32)
    held = list(zip(constraints, starts, drafts))  # llguidance takes no empty drafts in its draft call
    if any(not d for _, _, d in held):
        _executor().unsafe_compute_mask_ptr([(c.matcher, start) for c, start, d in held if not d], words.data_ptr(),
                                            words.shape[1] * 4, starts[-1])
    if any(d for _, _, d in held):
        _executor().unsafe_compute_mask_ptr_with_draft_token(
            [(c.matcher, start, [int(t) for t in d]) for c, start, d in held if d], words.data_ptr(),
            words.shape[1] * 4, starts[-1])
    allowed = _unpack(words, vocab)
    return [allowed[a:b] for a, b in zip(starts, starts[1:])]


def valid_drafts(constraints: Sequence[Constraint | None], drafts: Sequence[list[int]]) -> list[list[int]]:
    """Each sequence's drafts up to the first its grammar refuses: a
    constrained target never keeps that one or any after it."""
    return [d[: c.matcher.validate_tokens([int(t) for t in d])] if c is not None and d else d
            for c, d in zip(constraints, drafts)]


def _vocabulary(constraints: Sequence[Constraint]) -> int:
    vocab = constraints[0].grammar.vocab_size
    if any(c.grammar.vocab_size != vocab for c in constraints):
        raise ValueError("constraints of one batch share a vocabulary")
    return vocab


def _executor():
    if not _EXECUTOR:
        _EXECUTOR.append(_llguidance().LLExecutor(min(len(os.sched_getaffinity(0)), 8)))
    return _EXECUTOR[0]


def _unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] of llguidance's bitmasks: bit t % 32 of word t // 32
    allows token t; in little-endian bytes, bit t % 8 of byte t // 8, which
    numpy's unpackbits reads (a tenth of the time of a torch lookup table,
    bench/structured.py)."""
    octets = words.numpy().view(np.uint8)
    if sys.byteorder == "big":
        octets = octets.reshape(len(octets), -1, 4)[:, :, ::-1].reshape(len(octets), -1)
    return torch.from_numpy(np.unpackbits(octets, axis=1, count=vocab, bitorder="little")).view(torch.bool)


def apply_masks(constraints: Sequence[Constraint | None], logits: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """logits ([B, V], or B rows of [V]) as one [B, V] tensor, each row's
    tokens its constraint forbids at -inf; a row without a constraint as it
    is."""
    logits = torch.stack(list(logits)) if not isinstance(logits, torch.Tensor) else logits
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    allowed = allowed_tokens([constraints[i] for i in rows]).to(logits.device)
    if len(rows) == len(logits):
        return torch.where(allowed, logits, float("-inf"))
    out = logits.clone()
    out[rows] = torch.where(allowed, logits[rows], float("-inf"))
    return out


def apply_draft_masks(constraints: Sequence[Constraint | None], drafts: Sequence[Sequence[int]],
                      rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """rows[i] [1 + len(drafts[i]), V] (the logits after a sequence's pending
    token and after each of its drafts) with, at every position, the tokens
    its constraint forbids there at -inf; a sequence without one as it is."""
    out = list(rows)
    held = [i for i, c in enumerate(constraints) if c is not None]
    if held:
        for i, allowed in zip(held, allowed_after_drafts([constraints[i] for i in held], [drafts[i] for i in held])):
            out[i] = torch.where(allowed.to(rows[i].device), rows[i], float("-inf"))
    return out


NUMBER_STEP = 1e-6  # a number without its own multipleOf is written to at most 6 decimals


def _finite_numbers(schema: Any) -> Any:
    """The schema with every number that has no multipleOf given one of
    NUMBER_STEP: JSON allows a number endless digits, and a sampled model
    may write them until it runs out of tokens. What validates against the
    result validates against the schema."""
    if isinstance(schema, list):
        return [_finite_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _finite_numbers(value) for key, value in schema.items()}
    kind = schema.get("type")
    if (kind == "number" or (isinstance(kind, list) and "number" in kind)) and "multipleOf" not in schema:
        out["multipleOf"] = NUMBER_STEP
    return out


def _tokenizer(text, vocab_size: int, eos_ids: frozenset[int]):
    """llguidance's view of the package's tokenizer, made once a tokenizer
    (about a second), with the package's vocabulary size and EOS ids."""
    key = (vocab_size, tuple(sorted(eos_ids)))
    cached = _TOKENIZERS.get(text)
    if cached is not None and cached[0] == key:
        return cached[1]
    llg = _llguidance()
    try:
        tokenizer = llg.hf.from_tokenizer(text.tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the grammar engine cannot read this package's tokenizer: {_short(str(e))}") from None
    _TOKENIZERS[text] = (key, tokenizer)
    return tokenizer


def _short(message: str) -> str:
    return message.strip().splitlines()[0][:300] if message.strip() else "no reason given"
