"""The Qwen3 family: Llama-shaped with per-head RMSNorm on queries and keys (QK-norm).
In mlx-lm's shape (mlx_lm/models/qwen3.py); the layers it shares with Llama come from llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

from . import llama
from .base import DecoderArgs

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    model_type: str = "qwen3"
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960


class Attention(llama.Attention):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__(args)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def projections(self, x: mx.array, offset: int | mx.array, branch: int = 0) -> tuple[mx.array, mx.array, mx.array]:
        """q and k (normed per head, then RoPE at ``offset``; each block of ``branch`` rows from it) and v,
        as ``[b, heads, L, head_dim]``."""
        q, k, v = self.qkv(x)
        q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, offset, branch), self.rope(k, offset, branch), v


MLP = llama.MLP


class TransformerBlock(llama.TransformerBlock):
    attention = Attention


class Qwen3Model(llama.LlamaModel):
    block = TransformerBlock


class Model(llama.Model):
    inner = Qwen3Model


def args_from_config(config: dict[str, Any]) -> ModelArgs:
    return ModelArgs.from_config(config)
