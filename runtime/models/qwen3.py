"""The Qwen3 family: Llama-shaped with per-head RMSNorm on queries and keys (QK-norm)."""

from __future__ import annotations

from typing import Any

from .base import DecoderArgs, decoder_args_from_hf

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)


def args_from_config(config: dict[str, Any]) -> DecoderArgs:
    return decoder_args_from_hf(config, "qwen3", rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True)
