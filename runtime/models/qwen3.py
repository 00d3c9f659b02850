"""The Qwen3 family: Llama-shaped with per-head RMSNorm on queries and keys (QK-norm)."""

from __future__ import annotations

from typing import Any

from .base import DecoderArgs

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)


def args_from_config(config: dict[str, Any]) -> DecoderArgs:
    return DecoderArgs(
        model_type="qwen3",
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        vocab_size=config["vocab_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", 1000000.0),
        rope_scaling=config.get("rope_scaling"),
        head_dim=config.get("head_dim"),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        max_position_embeddings=config.get("max_position_embeddings", 40960),
        qk_norm=True,
        attention_bias=config.get("attention_bias", False),
    )

