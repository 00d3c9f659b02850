"""The Llama family (Llama 2/3.x, SmolLM2, Mistral-style configs): GQA, tied or untied
embeddings, Llama 3 RoPE scaling, optional attention bias."""

from __future__ import annotations

from typing import Any

from .base import DecoderArgs, decoder_args_from_hf

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "mistral")


def args_from_config(config: dict[str, Any]) -> DecoderArgs:
    return decoder_args_from_hf(config, "llama", rope_theta=10000.0, max_position_embeddings=4096, qk_norm=False)
