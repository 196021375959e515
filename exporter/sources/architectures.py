"""Which Hugging Face decoders the off-graph KV contract serves, keyed by the
config's `architectures` string. The model's own modules do the work (rotary
variants, q/k norms, biases, scaling, attention soft-capping); an entry only
says what the causal-LM wrapper does after the LM head, and gives a tiny
random config that the tests and `bench/architectures.py` verify against
Hugging Face.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvexport.contract.errors import ModelError

# what the *ForCausalLM forward does to the LM head's output
LOGITS_PLAIN = "plain"
LOGITS_SOFTCAP = "final_logit_softcapping"  # tanh(x / c) * c
LOGITS_DIVIDE = "logits_scaling"  # x / s


@dataclass(frozen=True)
class Architecture:
    name: str  # the `architectures` string
    family: str
    key: str  # built-in tiny model: tiny-<key>
    config_class: str
    logits: str = LOGITS_PLAIN
    tiny: dict[str, Any] = field(default_factory=dict)  # overrides of TINY_COMMON for the verified tiny model

    def finish_logits(self, config: Any, logits: torch.Tensor) -> torch.Tensor:
        if self.logits == LOGITS_SOFTCAP:
            cap = getattr(config, "final_logit_softcapping", None)
            return logits if cap is None else torch.tanh(logits / cap) * cap
        if self.logits == LOGITS_DIVIDE:
            return logits / config.logits_scaling
        return logits


TINY_COMMON: dict[str, Any] = dict(
    vocab_size=1031,  # not a power of two
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,  # peaked logits: greedy choices are not near-ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Each tiny model exercises something: GQA ratios 1, 2, 3 and multi-query,
# head_dim != hidden / heads, tied and untied embeddings, windows.
_ARCHITECTURES = [
    Architecture("LlamaForCausalLM", "Llama", "llama", "LlamaConfig", tiny=dict(tie_word_embeddings=True)),
    Architecture("MistralForCausalLM", "Mistral", "mistral", "MistralConfig",
                 tiny=dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16, sliding_window=8)),
    Architecture("Qwen2ForCausalLM", "Qwen2", "qwen2", "Qwen2Config", tiny=dict(num_key_value_heads=4, tie_word_embeddings=False)),
    Architecture("Qwen3ForCausalLM", "Qwen3", "qwen3", "Qwen3Config", tiny=dict(head_dim=24)),
    Architecture("GemmaForCausalLM", "Gemma", "gemma", "GemmaConfig", tiny=dict(num_key_value_heads=1, head_dim=16)),
    Architecture("Gemma2ForCausalLM", "Gemma2", "gemma2", "Gemma2Config", LOGITS_SOFTCAP,
                 tiny=dict(head_dim=16, sliding_window=8, final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                           query_pre_attn_scalar=16)),
    Architecture("Gemma3ForCausalLM", "Gemma3 (text)", "gemma3", "Gemma3TextConfig", LOGITS_SOFTCAP,
                 tiny=dict(num_hidden_layers=3, head_dim=16, sliding_window=8, final_logit_softcapping=4.0,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    Architecture("Phi3ForCausalLM", "Phi3", "phi3", "Phi3Config", tiny=dict(num_attention_heads=6, num_key_value_heads=2,
                                                                       hidden_size=48, sliding_window=None)),
    Architecture("Olmo2ForCausalLM", "OLMo2", "olmo2", "Olmo2Config"),
    Architecture("GraniteForCausalLM", "Granite", "granite", "GraniteConfig", LOGITS_DIVIDE,
                 tiny=dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1)),
    Architecture("SmolLM3ForCausalLM", "SmolLM3", "smollm3", "SmolLM3Config", tiny=dict(no_rope_layer_interval=2)),
    Architecture("Starcoder2ForCausalLM", "StarCoder2", "starcoder2", "Starcoder2Config", tiny=dict(sliding_window=8)),
]
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _ARCHITECTURES}

# What the contract cannot serve, and why; anything else unknown is refused too.
UNSERVABLE: dict[str, str] = {
    "MixtralForCausalLM": "mixture-of-experts routing, which the runtime cannot batch",
    "Qwen2MoeForCausalLM": "mixture-of-experts routing, which the runtime cannot batch",
    "Qwen3MoeForCausalLM": "mixture-of-experts routing, which the runtime cannot batch",
    "MambaForCausalLM": "recurrent state-space layers, not attention over a KV cache",
    "Mamba2ForCausalLM": "recurrent state-space layers, not attention over a KV cache",
    "RecurrentGemmaForCausalLM": "recurrent layers, not attention over a KV cache",
    "JambaForCausalLM": "recurrent layers mixed with mixture-of-experts",
    "RwkvForCausalLM": "linear-attention (recurrent) layers, not a KV cache",
    "LlavaForConditionalGeneration": "a multimodal model; export its language model instead",
    "Gemma3ForConditionalGeneration": "a multimodal model; export its text model (Gemma3ForCausalLM) instead",
}


def resolve(config: Any, where: str) -> Architecture:
    """The supported entry for a config, or a ModelError naming its
    `architectures` value and listing the supported ones."""
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    reasons = [f"{n}: {UNSERVABLE[n]}" for n in names if n in UNSERVABLE]
    why = f" ({'; '.join(reasons)})" if reasons else ""
    shown = names or [getattr(config, "model_type", "?")]
    raise ModelError(
        f"{where}: architecture {shown!r} is not supported{why}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def tiny_config(name: str) -> Any:
    """The verified tiny random config of a supported architecture."""
    import transformers

    arch = ARCHITECTURES[name]
    config = getattr(transformers, arch.config_class)(**{**TINY_COMMON, **arch.tiny})
    config.architectures = [arch.name]
    return config
