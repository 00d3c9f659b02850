"""What the decoder families share, as in mlx-lm's models/base.py: the args they all have
and rotary embeddings. Each family (llama.py, qwen3.py) is a whole model file in mlx-lm's
shape (``ModelArgs``, ``Attention``, ``MLP``, ``TransformerBlock``, ``Model`` with
``sanitize``); what the runtime adds to a model (device caches, the attention kernel,
compiled steps, fused projections) is behind one interface, runtime/models/decoder.py.

Module trees mirror Hugging Face's parameter names (``model.layers.N.self_attn.q_proj``)
so a checkpoint's tensors load by name with no renaming table for HF folders.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

ArgsT = TypeVar("ArgsT", bound="DecoderArgs")


@dataclass(kw_only=True)
class DecoderArgs:
    """The hyper-parameters every supported decoder family shares; a family's ``ModelArgs``
    subclasses it with its own defaults."""

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
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls: type[ArgsT], config: dict[str, Any]) -> ArgsT:
        """From an HF config.json: the required fields must be there, the others default to the family's."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        heads = config["num_attention_heads"]

        def optional(name: str) -> Any:
            return config.get(name, defaults[name])

        return cls(
            model_type=defaults["model_type"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            vocab_size=config["vocab_size"],
            **{name: optional(name) for name in ("rms_norm_eps", "rope_theta", "rope_scaling", "head_dim",
                                                  "tie_word_embeddings", "max_position_embeddings", "attention_bias")},
        )


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

    def __call__(self, x: mx.array, offset: int | mx.array = 0, branch: int = 0) -> mx.array:
        """``x [b, heads, L, head_dim]`` at positions ``offset``.. (``[b]``: one per row); with
        ``branch`` > 0, each block of ``branch`` rows again from ``offset`` (runtime/branches.py)."""
        b, heads, length, dim = x.shape
        blocks = length // branch if branch else 1
        if blocks > 1:  # the blocks as more heads: rope's positions run along the rows of each
            x = x.reshape(b, heads * blocks, branch, dim)
        out = mx.fast.rope(
            x, self.head_dim, traditional=False, base=self.base, scale=self.scale,
            offset=offset, freqs=self._freqs,
        )
        return out.reshape(b, heads, length, dim) if blocks > 1 else out
