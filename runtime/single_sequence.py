"""I/O managers of the single-sequence contracts: `ingraph_kv` v1 (the cache
lives in the program as buffers the runtime allocates and binds) and
`hf_static` v1 (the cache is program input, HF's static layout, updated in
place). One sequence, positions 0.. in order; `reset` starts over."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvexport.contract import manifest as mf
from kvexport.runtime.cell_cache import Allocator, allocate, io_buffer, zeros_allocator
from kvexport.contract.errors import CapacityError, RuntimeRefusal
from kvexport.runtime.loader import IOManager, LoadedPackage, check_output, register_io_manager
from kvexport.runtime.offgraph import check_token_ids
from kvexport.contract.sampler import sample, sample_argmax


class SingleSequenceManager(IOManager):
    context_key = ""

    def __init__(self, package: LoadedPackage, allocator: Allocator = zeros_allocator, **options: Any):
        super().__init__(package)
        unknown = sorted(k for k, v in options.items() if v is not None)
        if unknown:
            raise RuntimeRefusal(f"{package.manifest['contract']['name']} runtimes take no {', '.join(unknown)} option")
        md = package.metadata
        self.vocab_size: int = md["get_vocab_size"]
        self.eos_ids = frozenset(md["get_eos_ids"])
        self.max_step: int = md["get_max_seq_len"]
        self.context: int = md[self.context_key]
        self.allocator = allocator
        self.device = torch.device(package.device)
        self.position = 0
        self.caches = self._allocate_caches()

    def _allocate_caches(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _io(self, values: torch.Tensor) -> torch.Tensor:
        return io_buffer(self.allocator, values, self.device)

    def reset(self) -> None:
        """Starts a new sequence (old cache entries are masked by position)."""
        self.position = 0

    def check(self, tokens: Sequence[int]) -> None:
        """Refuses, before anything runs, what the context cannot hold."""
        check_token_ids(tokens, self.vocab_size, "the sequence")
        if len(tokens) == 0:
            raise RuntimeRefusal("a step needs at least one token")
        if self.position + len(tokens) > self.context:
            raise CapacityError(
                f"the sequence would reach {self.position + len(tokens)} tokens, past the context of {self.context}"
            )

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feeds tokens (in chunks of at most get_max_seq_len); returns the
        last token's logits [V]."""
        self.check(tokens)
        self.package.method("forward")  # rebuilt before any state changes
        logits = None
        start_position = self.position
        try:
            for start in range(0, len(tokens), self.max_step):
                chunk = [int(t) for t in tokens[start : start + self.max_step]]
                positions = torch.arange(self.position, self.position + len(chunk))
                logits = self.package.run("forward", self._io(torch.tensor([chunk])), self._io(positions), *self.caches)
                check_output("forward", logits, (1, self.vocab_size), torch.float32)
                self.position += len(chunk)
        except BaseException:
            self.position = start_position  # what was written past it is masked out
            raise
        return logits[0]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: torch.Tensor, on_device: bool = True) -> torch.Tensor:
        params = params.to(logits.device)
        return sample_argmax(logits) if bool((params[:, 0] <= 0).all()) else sample(logits, params)


@register_io_manager(mf.INGRAPH_KV, mf.INGRAPH_KV_VERSION)
class IngraphKVManager(SingleSequenceManager):
    context_key = "get_max_context_len"

    def _allocate_caches(self) -> list[torch.Tensor]:
        # the program's cache buffers: bound once, so no per-call inputs
        state = {}
        for spec in self.package.manifest["methods"]["forward"].get("state", []):
            state[spec["name"]] = allocate(self.allocator, tuple(spec["shape"]), getattr(torch, spec["dtype"]), self.device)
        self.package.state.update(state)
        self.state_buffers = list(state.values())
        return []


@register_io_manager(mf.HF_STATIC, mf.HF_STATIC_VERSION)
class HFStaticManager(SingleSequenceManager):
    context_key = "get_max_cache_len"

    def _allocate_caches(self) -> list[torch.Tensor]:
        specs = [s for s in self.package.manifest["methods"]["forward"]["inputs"] if s["role"] in ("kv_k", "kv_v")]
        return [allocate(self.allocator, tuple(s["shape"]), getattr(torch, s["dtype"]), self.device) for s in specs]
