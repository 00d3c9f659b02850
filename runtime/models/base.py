"""Pieces shared by the decoder-only target families (Llama, Qwen3).

The module tree mirrors Hugging Face's parameter names (``model.layers.N.self_attn.q_proj``)
so a checkpoint's tensors load by name with no renaming table for HF folders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..cache import DeviceKVCache, KVCache, cache_arrays, traced_caches
from .attention import cache_attention, uses_kernel
from .steps import CompiledSteps, default_compile_steps, traceable


@dataclass
class DecoderArgs:
    """The hyper-parameters every supported decoder family shares."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    qk_norm: bool = False
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads


def decoder_args_from_hf(config: dict[str, Any], model_type: str, *, rope_theta: float,
                         max_position_embeddings: int, qk_norm: bool) -> DecoderArgs:
    """DecoderArgs from an HF config.json; families differ only in defaults and QK-norm."""
    heads = config["num_attention_heads"]
    return DecoderArgs(
        model_type=model_type,
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        vocab_size=config["vocab_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", rope_theta),
        rope_scaling=config.get("rope_scaling"),
        head_dim=config.get("head_dim"),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        max_position_embeddings=config.get("max_position_embeddings", max_position_embeddings),
        qk_norm=qk_norm,
        attention_bias=config.get("attention_bias", False),
    )


class ForwardOutput(NamedTuple):
    """Logits ``[B, L, V]`` and, when asked, the tapped layer outputs ``[B, L, n_taps*H]``."""

    logits: mx.array
    taps: mx.array | None


def llama3_rope_frequencies(head_dim: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """Llama 3.x's frequency-dependent RoPE stretch (long wavelengths scaled, short kept)."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen = old_context / low
    high_wavelen = old_context / high
    freqs = base ** (mx.arange(0, head_dim, 2) / head_dim)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    is_medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (old_context / wavelens - low) / (high - low)
    medium = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(is_medium, medium, freqs)


class RoPE(nn.Module):
    """Non-interleaved rotary embedding, optionally with Llama 3 or linear scaling."""

    def __init__(self, head_dim: int, base: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.base: float | None = base
        self.scale = 1.0
        self._freqs: mx.array | None = None
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "llama3":
            self._freqs = llama3_rope_frequencies(head_dim, base, scaling or {})
            self.base = None
        elif kind == "linear":
            self.scale = 1.0 / float((scaling or {})["factor"])
        elif kind not in ("default", None):
            raise ValueError(f"unsupported rope_scaling type {kind!r}")

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x, self.head_dim, traditional=False, base=self.base, scale=self.scale,
            offset=offset, freqs=self._freqs,
        )


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
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = RoPE(hd, args.rope_theta, args.rope_scaling)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        b, length, _ = x.shape
        return x.reshape(b, length, n, self.head_dim)

    def fuse_projections(self) -> None:
        """Compute q, k and v in one matmul (an inference model: the HF names are gone after it)."""
        fused = concatenated([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self["q_proj"], self["k_proj"], self["v_proj"]

    def _projections(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q and k (RoPE at ``offset``) and v, as ``[b, heads, L, head_dim]``."""
        q_end, k_end = self.n_heads, self.n_heads + self.n_kv_heads
        if "qkv_proj" in self:
            qkv = self._heads(self.qkv_proj(x), self.n_heads + 2 * self.n_kv_heads).transpose(0, 2, 1, 3)
            # one split, not a slice per part: on a GPU every op costs host time
            if "q_norm" not in self:  # q and k heads sit side by side at the same positions: one RoPE
                qk, v = mx.split(qkv, [k_end], axis=1)
                q, k = mx.split(self.rope(qk, offset), [q_end], axis=1)
                return q, k, v
            q, k, v = mx.split(qkv, [q_end, k_end], axis=1)
        else:
            q, k, v = (self._heads(proj(x), n).transpose(0, 2, 1, 3) for proj, n in (
                (self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads), (self.v_proj, self.n_kv_heads)))
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, offset), self.rope(k, offset), v

    def __call__(self, x: mx.array, cache: KVCache | DeviceKVCache | None,
                 attention: tuple[int, mx.array | None] | None = None) -> mx.array:
        """``attention``: the cache's ``attention_mask`` for this forward (shared by the layers)."""
        b, length, _ = x.shape
        q, k, v = self._projections(x, cache.offset if cache is not None else 0)
        if isinstance(cache, DeviceKVCache) and uses_kernel(length, self.head_dim, q.dtype, self.scale):
            start = cache.length
            cache.write(k, v)
            out = cache_attention(q, cache.keys, cache.values, start, causal=True, scale=self.scale)
            return self.o_proj(out.reshape(b, length, -1))
        mask: mx.array | str | None = "causal" if length > 1 else None
        if cache is not None:
            extent, mask = attention or cache.attention_mask(length)
            k, v = cache.write_and_read(k, v, extent)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward, as in Llama and Qwen3."""

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


class TransposedLinear(nn.Module):
    """A dense projection whose weight is stored ``[in, out]``: ``x @ weight_t``.

    ``nn.Linear`` computes ``x @ weight.T``, one Transpose op per call, and a matmul of
    3D input adds a Flatten and an Unflatten: on a GPU each op costs host time, so
    inference models (rows kept 2D, as the drafter does) get one Matmul per projection.
    """

    def __init__(self, weight_t: mx.array, bias: mx.array | None = None) -> None:
        super().__init__()
        self.weight_t = mx.contiguous(weight_t)
        if bias is not None:
            self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> "TransposedLinear":
        return cls(linear.weight.T, linear.bias if "bias" in linear else None)

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


def concatenated(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One projection whose outputs are ``parts``' outputs side by side; None if they differ in kind.

    Output rows are independent in a matmul (and in a quantized one, whose groups run along
    the input), so stacking the weights' rows gives each part's own result, with one op
    where there were several: on a GPU each op costs host time (runtime.models.steps).
    Dense parts become a ``TransposedLinear``.
    """
    first = parts[0]
    if all(type(p) is nn.Linear for p in parts):
        bias = mx.concatenate([p.bias for p in parts]) if "bias" in first else None
        return TransposedLinear(mx.concatenate([p.weight for p in parts], axis=0).T, bias)
    if not all(type(p) is nn.QuantizedLinear and (p.group_size, p.bits, p.mode) == (first.group_size, first.bits, first.mode)
               for p in parts):
        return None
    fused = nn.QuantizedLinear(first.group_size, 1, bias="bias" in first, group_size=first.group_size,
                               bits=first.bits, mode=first.mode)
    for name, value in first.items():
        if isinstance(value, mx.array):
            fused[name] = mx.concatenate([p[name] for p in parts], axis=0)
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | DeviceKVCache | None,
                 attention: tuple[int, mx.array | None] | None = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """``model.*`` in HF naming: embedding, layers, final norm."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class DecoderModel(nn.Module):
    """A decoder-only causal LM whose forward can also return tapped layer outputs."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderStack(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.compile_steps = default_compile_steps()  # verify forwards over device caches
        self._steps = CompiledSteps()

    @property
    def num_layers(self) -> int:
        return self.args.num_hidden_layers

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens)

    def logits(self, hidden: mx.array) -> mx.array:
        """The LM head on already-normed hidden states (tied embeddings act as a linear)."""
        if "lm_head" in self:
            return self.lm_head(hidden)
        return self.model.embed_tokens.as_linear(hidden)

    def __call__(
        self,
        tokens: mx.array,
        cache: Sequence[KVCache] | Sequence[DeviceKVCache] | None = None,
        tap_layers: Sequence[int] = (),
        last_only: bool = False,
        logits_row: int | None = None,
    ) -> ForwardOutput:
        """Forward ``tokens [B, L]``; ``tap_layers`` are 0-based layers whose output is returned.

        Taps come out as ``[B, L, n_taps*H]`` in ``tap_layers`` order: the
        ``[token, layer*dim]`` layout the DFlash drafter's ``fc`` consumes. ``last_only``
        computes the last row's logits alone; ``logits_row`` another row's (the last real
        token of a right-padded prompt). With ``compile_steps``, a forward over device
        caches that returns every row (a verify) runs as a compiled step.
        """
        if self.compile_steps and traceable(cache) and not last_only and logits_row is None:
            return self._compiled_forward(tokens, cache, tuple(tap_layers))  # type: ignore[arg-type]
        return self._forward(tokens, cache, tap_layers, last_only, logits_row)

    def _compiled_forward(self, tokens: mx.array, cache: Sequence[DeviceKVCache], tap_layers: tuple[int, ...]) -> ForwardOutput:
        logits, taps = self._steps.run(cache, tokens.shape[1], tap_layers, lambda extent: partial(
            self._traced_forward, extent=extent, tap_layers=tap_layers), tokens)
        return ForwardOutput(logits, taps if tap_layers else None)

    def _traced_forward(self, tokens: mx.array, arrays: list[mx.array], *, extent: int,
                        tap_layers: tuple[int, ...]) -> list[mx.array]:
        traced = traced_caches(arrays, extent)
        out = self._forward(tokens, traced, tap_layers)
        return [out.logits, out.taps if out.taps is not None else mx.zeros((0,)), *cache_arrays(traced)]

    def _forward(self, tokens: mx.array, cache: Sequence[KVCache] | Sequence[DeviceKVCache] | None,
                 tap_layers: Sequence[int] = (), last_only: bool = False, logits_row: int | None = None) -> ForwardOutput:
        h = self.embed(tokens)
        wanted = {lid: i for i, lid in enumerate(tap_layers)}
        tapped: list[mx.array | None] = [None] * len(tap_layers)
        # every layer's cache has the same length: one mask for all (kernels are launched per op)
        attention = cache[0].attention_mask(tokens.shape[1]) if cache else None
        for lid, layer in enumerate(self.model.layers):
            h = layer(h, cache[lid] if cache is not None else None, attention)
            if lid in wanted:
                tapped[wanted[lid]] = h
        if last_only:
            h = h[:, -1:]
        elif logits_row is not None:
            h = h[:, logits_row : logits_row + 1]
        logits = self.logits(self.model.norm(h))
        taps = mx.concatenate(tapped, axis=-1) if tap_layers else None  # type: ignore[arg-type]
        return ForwardOutput(logits, taps)

    def fuse_projections(self) -> None:
        """q/k/v and gate/up in one matmul each, in every layer (for inference: see ``concatenated``)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        mx.eval(self.parameters())  # once, here: lazy concatenations would be recomputed by every forward

    def make_cache(self) -> list[KVCache]:
        """Per-layer caches; the batch axis comes from the first write."""
        return [KVCache() for _ in range(self.num_layers)]

    def make_device_cache(self) -> list[DeviceKVCache]:
        return [DeviceKVCache() for _ in range(self.num_layers)]
