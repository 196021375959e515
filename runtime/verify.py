"""Verifying a package: against the reference tokens it stores (what
`kvexport verify PKG` and the export's own check run), and against the
Hugging Face model it came from (each forward method's logits, and greedy
tokens against HF `generate`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvexport.contract.errors import PackageError
from kvexport.contract.offgraph_kv import ForwardInputs
from kvexport.contract.sections import ReferenceSection, SectionError
from kvexport.runtime import OffgraphKVManager, StepEntry, generate
from kvexport.runtime.cell_cache import sequence_bit


def method_logits(runtime: OffgraphKVManager, method: str, prefix: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """Feeds `prefix` through the runtime, then `tokens` through `method`
    itself with every row selected; returns logits [len(tokens), V]. The
    session is released afterwards."""
    session = runtime.new_session()
    try:
        if prefix:
            runtime.step([StepEntry(session, list(prefix), wants_logits=False)])
        cache = runtime.cache
        cache.check_step({session.seq: len(tokens)})
        cells, positions = cache.place([session.seq] * len(tokens))
        n_cells = cache.read_len({session.seq})
        masks = cache.masks(torch.full((len(tokens),), sequence_bit(session.seq)), positions, n_cells)
        with torch.inference_mode():
            inputs = ForwardInputs(
                torch.tensor([list(tokens)]), positions, torch.arange(len(tokens)), cache.views(n_cells), cells, masks
            )
            return runtime.package.method(method)(*inputs.pack())
    finally:
        runtime.release(session)


def hf_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)], device=model.device)).logits[0].float().cpu()


def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([list(prompt)], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def method_widths(runtime: OffgraphKVManager) -> dict[str, int]:
    """A width each forward method takes: N for forward_N, and one past the
    widest static size for forward_others."""
    widths = {f"forward_{n}": n for n in runtime.static_sizes}
    if runtime.others_min_tokens is not None:
        widths["forward_others"] = runtime.others_min_tokens
    return widths


def verify(runtime: OffgraphKVManager, model: Any, prompts: Sequence[Sequence[int]], new_tokens: int = 32) -> dict[str, Any]:
    """Max |logits - HF| per method (after a prefix of the first prompt), and
    whether greedy tokens equal HF `generate` for every prompt, alone and
    batched."""
    prefix = list(prompts[0])
    diffs = {}
    for method, width in method_widths(runtime).items():
        tokens = [(7 * i + 3) % runtime.vocab_size for i in range(width)]
        got = method_logits(runtime, method, prefix, tokens).cpu()
        want = hf_logits(model, prefix + tokens)[len(prefix) :]
        diffs[method] = float((got - want).abs().max())
    want = [hf_greedy(model, p, new_tokens) for p in prompts]
    alone = [generate(runtime, [p], new_tokens)[0] for p in prompts]
    batched = generate(runtime, prompts, new_tokens)
    return {
        "max_abs_logits_diff": diffs,
        "greedy_equal_alone": alone == want,
        "greedy_equal_batched": batched == want,
        "hf_tokens": want,
        "tokens": batched,
    }


# ------------------------------------------------- the package's own reference
@dataclass
class ReferenceCheck:
    ok: bool
    summary: str  # one line
    differences: list[str] = field(default_factory=list)  # the first one names the first differing step
    notes: list[str] = field(default_factory=list)  # near-ties where a probe stopped being compared


def check_reference(runtime: Any, section: ReferenceSection | None = None, source: str = "the reference stored at export") -> ReferenceCheck:
    """Reruns the probes the package stores (exporter/golden.py), or those of
    `section`, with this runtime, alone and, when the contract batches
    sessions, together, and compares greedy tokens step by step and the
    first step's best logits."""
    if section is None:
        try:
            section = ReferenceSection.parse(runtime.package.manifest.get("reference"))
        except SectionError as e:
            raise PackageError(str(e)) from None
    if section is None:
        raise PackageError("the package holds no reference tokens (exported with --no-verify, or by an older kvexport): "
                           "nothing to verify; compare with the model itself: kvexport verify PKG --against MODEL")
    vocab = runtime.package.metadata["get_vocab_size"]
    for probe in section.probes:
        ids = probe["prompt"] + probe["tokens"] + [pair[0] for pair in probe["top"]]
        if max(ids) >= vocab:
            raise PackageError(f"reference probe {probe['name']}: token ids up to {max(ids)}, outside the vocabulary 0..{vocab - 1}")
    by_name = {p["name"]: p for p in section.probes}
    runs = [("alone", [[p] for p in section.probes])]
    if getattr(runtime, "batches_sessions", False) and len(section.batch) > 1:
        runs.append(("batched", [[by_name[n] for n in section.batch]]))
    differences, notes = [], []
    for mode, groups in runs:
        for group in groups:
            results = _greedy(runtime, [p["prompt"] for p in group], section.steps)
            for probe, (tokens, first) in zip(group, results):
                _compare(probe, tokens, first, section, mode, differences, notes)
    probes = ", ".join(by_name)
    modes = " and ".join(mode for mode, _ in runs)
    if differences:
        return ReferenceCheck(False, f"differs from its reference: {differences[0]}", differences, notes)
    return ReferenceCheck(True, f"verified: {len(by_name)} probes ({probes}) x {section.steps} greedy tokens, {modes}, "
                          f"match {source}", [], notes)


def _greedy(runtime: Any, prompts: list[list[int]], steps: int) -> list[tuple[list[int], torch.Tensor]]:
    """(greedy tokens, first step's logits) per prompt, the prompts run as
    one batch of sessions (or one after another on a single-sequence runtime)."""
    if not getattr(runtime, "batches_sessions", False):
        out = []
        for prompt in prompts:
            runtime.reset()
            logits = runtime.step(prompt)
            first, tokens = logits.float().clone(), [int(logits.argmax())]
            for _ in range(steps - 1):
                tokens.append(int(runtime.step([tokens[-1]]).argmax()))
            out.append((tokens, first))
        return out
    sessions = [runtime.new_session() for _ in prompts]
    try:
        rows = runtime.step([StepEntry(s, p) for s, p in zip(sessions, prompts)])
        firsts = [r.float().clone() for r in rows]
        tokens = [[int(r.argmax())] for r in rows]
        for _ in range(steps - 1):
            rows = runtime.step([StepEntry(s, [t[-1]]) for s, t in zip(sessions, tokens)])
            for t, r in zip(tokens, rows):
                t.append(int(r.argmax()))
        return list(zip(tokens, firsts))
    finally:
        for s in sessions:
            runtime.release(s)


def _compare(probe: dict, tokens: list[int], first: torch.Tensor, section: ReferenceSection, mode: str,
             differences: list[str], notes: list[str]) -> None:
    name = f"probe {probe['name']} ({mode})"
    for token, logit in probe["top"]:
        got = float(first[token])
        if abs(got - logit) > section.logits_atol + section.logits_rtol * abs(logit):
            differences.append(f"{name}, step 0: logit of token {token} is {got:.4f}, the reference {logit:.4f} "
                               f"(tolerance {section.logits_atol} + {section.logits_rtol} x |logit|)")
            return
    for step, (got, want, margin) in enumerate(zip(tokens, probe["tokens"], probe["margins"])):
        if got == want:
            continue
        if margin < section.tie_margin:
            notes.append(f"{name}: step {step} is a near-tie (reference margin {margin}); compared up to there")
            return
        differences.append(f"{name}, step {step}: token {got}, the reference {want} (reference margin {margin}, "
                           f"above the tie margin {section.tie_margin})")
        return
