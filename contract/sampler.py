"""The samplers of the contracts (docs/contracts/offgraph_kv-v1.md, sampling). The exporter traces these same
functions into the package's `sample` and `sample_argmax` methods, so the
host sampler and the package's draw the same token for the same coin.

A params row is (temperature, top_p, top_k, coin). Temperature <= 0 is
argmax. Otherwise top-k (k > 0) takes precedence over top-p (p < 1), else the
full distribution is used. Probabilities are sorted stably, the kept ones
renormalised, and the first token whose cumulative probability exceeds the
coin is drawn. The index is clamped to the last kept token (which is never
past V - 1), so rounding in the cumulative sum can never pick a token the
filter removed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvexport.contract.errors import KvexportError, PackageError


def sample_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> int64 [R]; ties go to the lowest id, as in HF generate."""
    return torch.argmax(logits, dim=-1)


def sample(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float, params [R, 4] float32 -> int64 [R]."""
    logits = logits.float()
    temperature, top_p, top_k, coin = params.unbind(-1)  # each [R]
    greedy = temperature <= 0
    _, order, keep, cumulative = _filtered(logits, temperature, top_p, top_k)
    # The kept tokens are a prefix of the sorted ones, so their renormalised
    # cumulative probability is the prefix's cumulative sum over the kept
    # mass (which ends at exactly 1): one scan, over the sorted probabilities
    # alone (a scan over a broadcast expression fails inductor's CUDA code
    # generation in torch 2.11).
    last_kept = keep.sum(dim=-1) - 1
    mass = torch.gather(cumulative, -1, last_kept.clamp(min=0).unsqueeze(-1))  # [R, 1]
    index = (cumulative / mass <= coin.unsqueeze(-1)).sum(dim=-1)
    index = torch.minimum(index, last_kept)
    drawn = torch.gather(order, -1, index.unsqueeze(-1)).squeeze(-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), drawn)


def _kept(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor):
    """(kept, order), each [R, V]: the probabilities a row draws from, sorted
    (descending, stable) with the filtered ones zero and the rest
    renormalised; the token id of each."""
    sorted_probs, order, keep, _ = _filtered(logits, temperature, top_p, top_k)
    kept = sorted_probs * keep
    return kept / kept.sum(dim=-1, keepdim=True), order


def _filtered(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor):
    """(sorted_probs, order, keep, cumulative), each [R, V]: the
    probabilities sorted (descending, stable), the token id of each, which
    are kept (a prefix), and their cumulative sum."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [R, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)  # [1, V]
    use_k = (top_k > 0).unsqueeze(-1)
    use_p = ((top_k <= 0) & (top_p < 1)).unsqueeze(-1)
    keep_k = ranks < top_k.unsqueeze(-1)
    # keep a token while the mass before it is still short of top_p
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    keep_p = cumulative - sorted_probs < top_p.unsqueeze(-1)
    keep = torch.where(use_k, keep_k, torch.where(use_p, keep_p, torch.ones_like(keep_k)))
    return sorted_probs, order, keep, cumulative


def probabilities(logits: torch.Tensor, config: "SamplingConfig") -> torch.Tensor:
    """logits [R, V] -> [R, V] float32: the distribution `sample` draws each
    row from under config (greedy: all on the argmax), in vocabulary order.
    Speculative decoding's accept/reject rule reads it."""
    logits = logits.float()
    if config.greedy:
        return torch.nn.functional.one_hot(torch.argmax(logits, dim=-1), logits.shape[-1]).float()
    rows = logits.shape[0]
    temperature = torch.full((rows,), float(config.temperature))
    kept, order = _kept(logits, temperature, torch.full((rows,), float(config.top_p)), torch.full((rows,), float(config.top_k)))
    return torch.zeros_like(kept).scatter_(-1, order, kept)


def draw(p: torch.Tensor, coin: float) -> int:
    """The token a coin in [0, 1) picks from the distribution p [V], walking
    the tokens as `sample` does (most likely first, ties by id) and never
    past the last one with mass: draw(probabilities(l, c)[0], coin) is
    sample's token for that coin."""
    sorted_p, order = torch.sort(p, descending=True, stable=True)
    index = int((torch.cumsum(sorted_p, dim=0) <= coin).sum())
    index = min(index, int((sorted_p > 0).sum()) - 1)
    return int(order[index])


def check_sampled(method: str, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A package's sampler is untrusted: an id it returns past the vocabulary
    would be emitted, decoded and fed back as the next step's token."""
    bad = [t for t in tokens.tolist() if not 0 <= t < vocab_size]  # a few ids: one copy, not four tensor operations
    if bad:
        raise PackageError(
            f"methods.{method}: returned token id {bad[0]}, outside the vocabulary 0..{vocab_size - 1}: the package's "
            "sampler is damaged. Re-export the package, or sample on the host (--host-sampler)"
        )
    return tokens


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def validate(self) -> None:
        if not math.isfinite(self.temperature):
            raise KvexportError(f"--temperature must be a finite number, got {self.temperature}")
        if self.top_k < 0:
            raise KvexportError(f"--top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise KvexportError(f"--top-p must be in (0, 1], got {self.top_p}")


def params_row(config: SamplingConfig, generator: torch.Generator | None) -> list[float]:
    """One params row; draws a coin from the session's generator unless the
    row is greedy (greedy rows draw no coin, so they do not shift the stream)."""
    coin = 0.0 if config.greedy or generator is None else float(torch.rand((), generator=generator))
    return [config.temperature, config.top_p, float(config.top_k), coin]
