"""The Llama family (Llama 2/3.x, SmolLM2, Mistral-style configs): GQA, tied or untied
embeddings, Llama 3 RoPE scaling, optional attention bias. In mlx-lm's shape
(mlx_lm/models/llama.py); the runtime's forward is DecoderModel's (runtime/models/decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

from .base import DecoderArgs, RoPE
from .decoder import AttentionMask, Cache, DecoderModel, cached_attention, concatenated

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "mistral")


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    model_type: str = "llama"
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim or 0
        self.scale = hd**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=False)
        self.rope = RoPE(hd, args.rope_theta, args.rope_scaling)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        """``[b, L, n*head_dim]`` as ``[b, n, L, head_dim]``."""
        b, length, _ = x.shape
        return x.reshape(b, length, n, self.head_dim).transpose(0, 2, 1, 3)

    def fuse_projections(self) -> None:
        """Compute q, k and v in one matmul (an inference model: the HF names are gone after it)."""
        fused = concatenated([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self["q_proj"], self["k_proj"], self["v_proj"]

    def qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k and v as ``[b, heads, L, head_dim]``, before RoPE."""
        if "qkv_proj" in self:
            qkv = self._heads(self.qkv_proj(x), self.n_heads + 2 * self.n_kv_heads)
            q, k, v = mx.split(qkv, [self.n_heads, self.n_heads + self.n_kv_heads], axis=1)  # one split, not three slices
            return q, k, v
        return self._heads(self.q_proj(x), self.n_heads), self._heads(self.k_proj(x), self.n_kv_heads), \
            self._heads(self.v_proj(x), self.n_kv_heads)

    def projections(self, x: mx.array, offset: int | mx.array, branch: int = 0) -> tuple[mx.array, mx.array, mx.array]:
        """q and k (RoPE at ``offset``; each block of ``branch`` rows from it) and v, as ``[b, heads, L, head_dim]``."""
        if "qkv_proj" in self:  # q and k heads sit side by side at the same positions: one RoPE
            qkv = self._heads(self.qkv_proj(x), self.n_heads + 2 * self.n_kv_heads)
            # one split, not a slice per part: on a GPU every op costs host time
            qk, v = mx.split(qkv, [self.n_heads + self.n_kv_heads], axis=1)
            q, k = mx.split(self.rope(qk, offset, branch), [self.n_heads], axis=1)
            return q, k, v
        q, k, v = self.qkv(x)
        return self.rope(q, offset, branch), self.rope(k, offset, branch), v

    def __call__(self, x: mx.array, cache: Cache | None, attention: AttentionMask | None = None) -> mx.array:
        branch = attention.branch if attention is not None else 0
        q, k, v = self.projections(x, cache.offset if cache is not None else 0, branch)
        return self.o_proj(cached_attention(q, k, v, cache, attention, self.scale))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def fuse_projections(self) -> None:
        """Compute gate and up in one matmul (an inference model: the HF names are gone after it)."""
        fused = concatenated([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self["gate_proj"], self["up_proj"]

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), [self.intermediate], axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.silu(gate) * up)


class TransformerBlock(nn.Module):
    attention = Attention

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.self_attn = self.attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Cache | None, attention: AttentionMask | None = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """``model.*`` in HF naming: embedding, layers, final norm."""

    block = TransformerBlock

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [self.block(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(DecoderModel):
    inner = LlamaModel

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__(args)
        self.model = self.inner(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop the precomputed RoPE frequencies, and the LM head where it is the embedding."""
        weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.args.tie_word_embeddings:
            for suffix in ("weight", "scales", "biases"):
                weights.pop(f"lm_head.{suffix}", None)
        return weights


def args_from_config(config: dict[str, Any]) -> ModelArgs:
    return ModelArgs.from_config(config)
