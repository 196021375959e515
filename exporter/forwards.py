"""The traced forward of the offgraph_kv contract, built from the model's own
Hugging Face modules. One attention function, registered in transformers'
attention registry, serves every model that uses the standard attention
interface: rotary variants, q/k norms, biases and scaling stay the model's.

Per layer it writes the step's K/V into the layer's cell pools at the step's
cells and attends over the pools with the contract's mask for the layer's
window. The final norm and the LM head see only the selected rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvexport.exporter.sources.architectures import resolve
from kvexport.contract.errors import ExportError, ModelError
from kvexport.contract.manifest import CacheGeometry
from kvexport.contract.offgraph_kv import ForwardInputs
from kvexport.contract.sampler import sample, sample_argmax

ATTENTION_NAME = "kvexport_offgraph"
_STATE_KEY = "kvexport_state"

log = logging.getLogger(__name__)


@dataclass
class StepState:
    """What the attention function needs from the forward's inputs."""

    pools: tuple[torch.Tensor, ...]  # k0, v0, k1, v1, ... each [C, n_kv_heads, head_dim]
    cells: torch.Tensor  # [T]
    masks: dict[int, torch.Tensor]  # window -> bool [T, C]
    windows: tuple[int, ...]  # per layer


@dataclass
class GeometryProbe:
    """Records each layer's K shape during an eager dry run."""

    layers: dict[int, tuple[int, int]]


def offgraph_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    state = kwargs.get(_STATE_KEY)
    layer = module.layer_idx
    if isinstance(state, GeometryProbe):
        state.layers[layer] = (key.shape[1], key.shape[3])
        return _attend_dense(query, key, value, scaling, softcap), None
    if not isinstance(state, StepState):
        raise ExportError(f"{ATTENTION_NAME} attention called without the step state (layer {layer})")
    window = state.windows[layer]
    if sliding_window is not None and sliding_window != window:
        raise ExportError(f"layer {layer}: the model attends with window {sliding_window}, the cache geometry says {window}")
    k_pool, v_pool = state.pools[2 * layer], state.pools[2 * layer + 1]
    k_pool.index_copy_(0, state.cells, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, state.cells, value[0].transpose(0, 1).to(v_pool.dtype))
    if _sdpa_attends(query, softcap):
        # strided views straight into the pools ([1, H_kv, C, D]); sdpa reads
        # them without a copy and never materializes the [H, T, C] scores
        # (bench/attention_kernels.py: 1.7-4.7 x faster than the products below at 128-2048 tokens)
        k = k_pool.permute(1, 0, 2).unsqueeze(0).to(query.dtype)
        v = v_pool.permute(1, 0, 2).unsqueeze(0).to(query.dtype)
        out = F.scaled_dot_product_attention(
            query, k, v, attn_mask=state.masks[window], scale=_scale(scaling, query.shape[-1]), enable_gqa=True
        )
        return out.transpose(1, 2), None  # [1, T, H, D]
    return _attend_products(query, k_pool, v_pool, state.masks[window], scaling, softcap), None


def _sdpa_attends(query: torch.Tensor, softcap: float | None) -> bool:
    """Whether sdpa attends over the pools: not where the model soft-caps
    its scores (Gemma 2), which sdpa cannot, and not on CUDA, where sdpa
    with grouped heads over the strided pool views traced to guards on the
    cell count (torch 2.11 on an H200); the products below attend there."""
    return softcap is None and query.device.type == "cpu"


def _attend_products(query, k_pool, v_pool, mask, scaling, softcap) -> torch.Tensor:
    """Attention as products over the pools: the scores (capped where the
    model soft-caps them), masked and normalized. Every tensor keeps a kv
    head's query heads as their own dimension: merging them with the tokens
    or the cells makes torch 2.11's export guard on those sizes."""
    heads, tokens, head_dim = query.shape[1:]
    kv_heads = k_pool.shape[1]
    q = query.view(kv_heads, heads // kv_heads, tokens, head_dim)  # [H_kv, G, T, D]
    k = k_pool.permute(1, 2, 0).unsqueeze(1).to(query.dtype)  # [H_kv, 1, D, C]
    v = v_pool.permute(1, 0, 2).unsqueeze(1).to(query.dtype)  # [H_kv, 1, C, D]
    scores = torch.matmul(q, k) * _scale(scaling, head_dim)  # [H_kv, G, T, C]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v)  # [H_kv, G, T, D]
    return out.permute(2, 0, 1, 3).reshape(tokens, heads, head_dim).unsqueeze(0)  # [1, T, H, D]


def _scale(scaling: float | None, head_dim: int) -> float:
    return head_dim**-0.5 if scaling is None else scaling


def _attend_dense(query, key, value, scaling, softcap) -> torch.Tensor:
    """Plain causal attention for the geometry dry run."""
    heads, tokens, head_dim = query.shape[1:]
    group = heads // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, k.transpose(-1, -2)) * _scale(scaling, head_dim)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=scores.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return torch.matmul(probs, v).transpose(1, 2)


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, offgraph_attention)


def layer_windows(config: Any, n_layers: int) -> tuple[int, ...]:
    """Per-layer window (0 = full history) from the config."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        out = []
        for i, kind in enumerate(layer_types[:n_layers]):
            if kind == "full_attention":
                out.append(0)
            elif kind == "sliding_attention":
                out.append(window)
            else:
                raise ModelError(f"layer {i} is of type {kind!r}, which the off-graph KV contract cannot serve")
        return tuple(out)
    if window and getattr(config, "use_sliding_window", True):
        return (window,) * n_layers
    return (0,) * n_layers


class ContractForward(nn.Module):
    """The model's decoder, final norm and LM head, with the off-graph
    attention function; subclasses give the contract's forward signature."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        register_attention()
        if not getattr(causal_lm.config, "architectures", None):
            causal_lm.config.architectures = [type(causal_lm).__name__]
        self.architecture = resolve(causal_lm.config, type(causal_lm).__name__)
        causal_lm.config._attn_implementation = ATTENTION_NAME
        decoder = getattr(causal_lm, causal_lm.base_model_prefix)
        norm = getattr(decoder, "norm", None)
        if norm is None:
            raise ModelError(f"{type(causal_lm).__name__}: no final norm at .{causal_lm.base_model_prefix}.norm")
        # the final norm runs after row selection, on K rows instead of T
        decoder.norm = nn.Identity()
        self.decoder = decoder
        self.final_norm = norm
        self.lm_head = causal_lm.get_output_embeddings()
        self.config = causal_lm.config
        self.geometry = self._probe_geometry()

    @torch.no_grad()
    def _probe_geometry(self) -> CacheGeometry:
        """Runs the decoder on two tokens to see each attention layer's
        heads and head size: under fake tensors, so that no weight is read
        (a mapped 7B model stays on disk), or for real where the model's
        code needs values (data-dependent Python)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        probe = GeometryProbe({})
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                ids = torch.tensor([[0, 1]], device=self.device)
                self.decoder(input_ids=ids, position_ids=ids, use_cache=False, **{_STATE_KEY: probe})
        except Exception as e:  # noqa: BLE001  (any failure of the fake run: the real one decides)
            log.info("cache geometry: the run under fake tensors failed (%s: %s); probing with the weights", type(e).__name__, e)
            probe = GeometryProbe({})
            ids = torch.tensor([[0, 1]], device=self.device)
            self.decoder(input_ids=ids, position_ids=ids, use_cache=False, **{_STATE_KEY: probe})
        n = len(probe.layers)
        if sorted(probe.layers) != list(range(n)):
            raise ModelError(f"attention layers reported indices {sorted(probe.layers)}; expected 0..{n - 1}")
        heads = tuple(probe.layers[i][0] for i in range(n))
        dims = tuple(probe.layers[i][1] for i in range(n))
        return CacheGeometry(heads, dims, layer_windows(self.config, n))

    @property
    def device(self) -> torch.device:
        """Where the head's weights (a float weight or packed codes) live."""
        return next(iter(self.lm_head.state_dict().values())).device

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def _rows_logits(self, tokens: torch.Tensor, input_pos: torch.Tensor, step: StepState, rows) -> torch.Tensor:
        hidden = self.decoder(
            input_ids=tokens, position_ids=input_pos.unsqueeze(0), use_cache=False, **{_STATE_KEY: step}
        ).last_hidden_state  # [1, T, hidden]
        selected = rows(hidden[0])  # [K, hidden]
        logits = self.lm_head(self.final_norm(selected))
        return self.architecture.finish_logits(self.config, logits).float()  # [K, V]


class OffgraphForward(ContractForward):
    """forward(tokens [1, T], input_pos [T], logits_to_keep [K], *pools,
    cells [T], *masks) -> logits float32 [K, V]"""

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, logits_to_keep: torch.Tensor, *state: torch.Tensor):
        inputs = ForwardInputs.unpack((tokens, input_pos, logits_to_keep, *state), self.geometry)
        step = StepState(
            pools=inputs.pools,
            cells=inputs.cells,
            masks=dict(zip(self.geometry.distinct_windows, inputs.masks)),
            windows=self.geometry.windows,
        )
        return self._rows_logits(tokens, input_pos, step, lambda h: h.index_select(0, inputs.logits_to_keep))


CACHE_BUFFER = "kv_cache"  # ingraph_kv: buffer names kv_cache.<layer>.<k|v>


class SingleSequenceForward(ContractForward):
    """One sequence whose cache holds every position of the context:
    - ingraph_kv: forward(tokens [1, T], input_pos [T]) -> logits [1, V], the
      cache in the program as mutable buffers [context, n_kv_heads, head_dim];
    - hf_static: forward(tokens, input_pos, k0, v0, k1, v1, ...) -> logits
      [1, V], the cache as inputs in HF's static layout
      [1, n_kv_heads, max_cache_len, head_dim], updated in place.
    The mask is built in the graph from positions: token i sees position j
    iff j <= pos_i (and j > pos_i - w on a window w)."""

    def __init__(self, causal_lm: nn.Module, context: int, cache_dtype: torch.dtype, cache_as_inputs: bool):
        super().__init__(causal_lm)
        self.context = context
        self.cache_as_inputs = cache_as_inputs
        if not cache_as_inputs:
            self.kv_cache = nn.Module()
            for layer, (heads, dim) in enumerate(zip(self.geometry.kv_heads, self.geometry.head_dims)):
                holder = nn.Module()
                device = self.device
                holder.register_buffer("k", torch.zeros(context, heads, dim, dtype=cache_dtype, device=device), persistent=False)
                holder.register_buffer("v", torch.zeros(context, heads, dim, dtype=cache_dtype, device=device), persistent=False)
                self.kv_cache.add_module(str(layer), holder)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *caches: torch.Tensor):
        if self.cache_as_inputs:
            pools = tuple(c[0].permute(1, 0, 2) for c in caches)  # [1, H_kv, L, D] -> views [L, H_kv, D]
        else:
            pools = tuple(t for layer in self.kv_cache.children() for t in (layer.k, layer.v))
        cell_pos = torch.arange(self.context, device=input_pos.device).unsqueeze(0)  # [1, L]
        pos = input_pos.unsqueeze(1)  # [T, 1]
        masks = {}
        for window in self.geometry.distinct_windows:
            seen = cell_pos <= pos
            masks[window] = seen if window == 0 else seen & (cell_pos > pos - window)
        step = StepState(pools=pools, cells=input_pos, masks=masks, windows=self.geometry.windows)
        return self._rows_logits(tokens, input_pos, step, lambda h: h[-1:])  # [1, V]


class SampleModule(nn.Module):
    def forward(self, logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return sample(logits, params)


class SampleArgmaxModule(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return sample_argmax(logits)
