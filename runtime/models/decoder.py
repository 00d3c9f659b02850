"""The runtime's one interface to a decoder model, whatever its family.

A family's ``Model`` (runtime/models/llama.py, qwen3.py) builds its layers in mlx-lm's
shape; :class:`DecoderModel` adds what the runtime needs of every target: a forward that
can return tapped layer outputs, over plain or device KV caches (runtime.cache), as a
compiled step when asked (runtime.models.steps), with q/k/v and gate/up fused into one
matmul each for inference. :func:`cached_attention` is the attention over a cache every
family's ``Attention`` calls: the attention kernel (runtime.models.attention) over device
caches where it applies, else MLX's fused attention under the cache's mask.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, Sequence

import mlx.core as mx
from mlx import nn

from ..cache import ATTENTION_BUCKET, DeviceKVCache, KVCache, advance_layers, cache_arrays, round_up, traced_caches
from .attention import cache_attention, uses_kernel
from .base import DecoderArgs
from .batch_invariant import batch_invariant
from .steps import CompiledSteps, default_compile_steps, traceable

Cache = KVCache | DeviceKVCache
PREFILL_BUCKET = ATTENTION_BUCKET  # prompts are prefilled right-padded to whole buckets


class AttentionMask(NamedTuple):
    """What every layer's attention shares in one forward: the keys it reads (``extent``) and the
    cache's mask over them; ``branch`` > 0: the rows are blocks of that many, each continuing the
    cache on its own (runtime/branches.py), roped from the same position."""

    extent: int
    mask: mx.array | None
    branch: int = 0


class ForwardOutput(NamedTuple):
    """Logits ``[B, L, V]`` and, when asked, the tapped layer outputs ``[B, L, n_taps*H]``."""

    logits: mx.array
    taps: mx.array | None


def cached_attention(q: mx.array, k: mx.array, v: mx.array, cache: Cache | None, attention: AttentionMask | None,
                     scale: float) -> mx.array:
    """Attention of ``q`` over the cache after ``k, v`` (``[b, heads, L, head_dim]``) are written to it.

    Returns ``[b, L, heads*head_dim]``, ready for the output projection. ``attention``: the
    cache's ``attention_mask`` for this forward (shared by the layers).
    """
    b, _, length, head_dim = q.shape
    branch = attention.branch if attention is not None else 0
    if isinstance(cache, DeviceKVCache) and uses_kernel(length, head_dim, q.dtype, scale, branch):
        start = cache.length
        cache.write(k, v)
        out = cache_attention(q, cache.keys, cache.values, start, causal=True, scale=scale, branch=branch)
        return out.reshape(b, length, -1)
    mask: mx.array | str | None = "causal" if length > 1 else None
    if cache is not None:
        extent, mask, _ = attention or AttentionMask(*cache.attention_mask(length))
        k, v = cache.write_and_read(k, v, extent)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(b, length, -1)


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
    def of(cls, linear: nn.Linear) -> TransposedLinear:
        return cls(linear.weight.T, linear.bias if "bias" in linear else None)

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


def dense_weight(layer: nn.Module) -> mx.array | None:
    """A dense projection's or embedding's weight as ``[out, in]``; None for a quantized one."""
    if isinstance(layer, TransposedLinear):
        return layer.weight_t.T
    if type(layer) in (nn.Linear, nn.Embedding):
        return layer.weight
    return None


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


class DecoderModel(nn.Module):
    """A decoder-only causal LM as the runtime drives it; every family's ``Model`` is one.

    A subclass sets ``self.model`` (``embed_tokens``, ``layers``, ``norm``) and, unless its
    embeddings are tied, ``self.lm_head``; its layers take ``(x, cache, attention)``, and
    each layer's ``self_attn`` and ``mlp`` can ``fuse_projections``.
    """

    model: Any

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.compile_steps = default_compile_steps()  # verify forwards over device caches
        self._steps = CompiledSteps()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A checkpoint's tensors as this model names them (a family drops what it does not use)."""
        return weights

    @property
    def num_layers(self) -> int:
        return self.args.num_hidden_layers

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens)

    def logits(self, hidden: mx.array) -> mx.array:
        """The LM head on already-normed hidden states (tied embeddings act as a linear)."""
        if "tied_head" in self:
            return self.tied_head(hidden)
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
        branch: int = 0,
    ) -> ForwardOutput:
        """Forward ``tokens [B, L]``; ``tap_layers`` are 0-based layers whose output is returned.

        Taps come out as ``[B, L, n_taps*H]`` in ``tap_layers`` order: the
        ``[token, layer*dim]`` layout the DFlash drafter's ``fc`` consumes. ``last_only``
        computes the last row's logits alone; ``logits_row`` another row's (the last real
        token of a right-padded prompt). ``branch`` > 0: the rows are blocks of ``branch``
        tokens, each continuing the cache on its own (runtime/branches.py). With
        ``compile_steps``, a forward over device caches that returns every row (a verify) runs
        as a compiled step.
        """
        branch = branch if 0 < branch < tokens.shape[1] else 0  # one block: a plain forward
        if self.compile_steps and traceable(cache) and not last_only and logits_row is None:
            return self._compiled_forward(tokens, cache, tuple(tap_layers), branch)  # type: ignore[arg-type]
        return self._forward(tokens, cache, tap_layers, last_only, logits_row, branch)

    def prefill(self, prompt_ids: Sequence[int], cache: Sequence[DeviceKVCache],
                tap_layers: Sequence[int] = ()) -> ForwardOutput:
        """The prompt into empty device caches; logits ``[1, 1, V]`` of its last token.

        The verifier and plain decoding both start here, so their caches hold the same bits.
        Right-padded to whole buckets: prompts then come in few shapes, and backends that build
        kernels per shape (cuDNN attention on CUDA) build them a few times, not per prompt; the
        padding lies past the valid length, never attended, overwritten later.
        """
        n = len(prompt_ids)
        padded = list(prompt_ids) + [prompt_ids[-1]] * (round_up(n, PREFILL_BUCKET) - n)
        out = self(mx.array([padded]), cache, tap_layers=tap_layers, logits_row=n - 1)
        advance_layers(cache, mx.array(n, dtype=mx.int32))
        for layer in cache:
            layer.settle(n)
        return out

    def _compiled_forward(self, tokens: mx.array, cache: Sequence[DeviceKVCache], tap_layers: tuple[int, ...],
                          branch: int) -> ForwardOutput:
        logits, taps = self._steps.run(cache, tokens.shape[1], (tap_layers, branch), lambda extent: partial(
            self._traced_forward, extent=extent, tap_layers=tap_layers, branch=branch), tokens)
        return ForwardOutput(logits, taps if tap_layers else None)

    def _traced_forward(self, tokens: mx.array, arrays: list[mx.array], *, extent: int,
                        tap_layers: tuple[int, ...], branch: int) -> list[mx.array]:
        traced = traced_caches(arrays, extent)
        out = self._forward(tokens, traced, tap_layers, branch=branch)
        return [out.logits, out.taps if out.taps is not None else mx.zeros((0,)), *cache_arrays(traced)]

    def _forward(self, tokens: mx.array, cache: Sequence[KVCache] | Sequence[DeviceKVCache] | None,
                 tap_layers: Sequence[int] = (), last_only: bool = False, logits_row: int | None = None,
                 branch: int = 0) -> ForwardOutput:
        h = self.embed(tokens)
        wanted = {lid: i for i, lid in enumerate(tap_layers)}
        tapped: list[mx.array | None] = [None] * len(tap_layers)
        # every layer's cache has the same length: one mask for all (kernels are launched per op)
        attention = AttentionMask(*cache[0].attention_mask(tokens.shape[1], branch), branch) if cache else None
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

    def use_batch_invariant_projections(self) -> bool:
        """Compute every projection and the LM head with the batch-invariant kernel
        (runtime.models.batch_invariant), so a verify's rows equal one-token steps bit for bit;
        False (and nothing changed) where it does not apply to all of them: the CPU, 8-bit weights.
        """
        owners = [(layer.self_attn, name) for layer in self.model.layers for name in ("qkv_proj", "o_proj")]
        owners += [(layer.mlp, name) for layer in self.model.layers for name in ("gate_up_proj", "down_proj")]
        owners = [(owner, name) for owner, name in owners if name in owner]
        head = self.lm_head if "lm_head" in self else self.model.embed_tokens
        twins = [batch_invariant(owner[name], dense_weight(owner[name])) for owner, name in owners]
        head_twin = batch_invariant(head, dense_weight(head))
        if not owners or head_twin is None or any(twin is None for twin in twins):
            return False
        for (owner, name), twin in zip(owners, twins):
            owner[name] = twin
        if "lm_head" in self:
            self.lm_head = head_twin
        else:
            self.tied_head = head_twin
        mx.eval(self.parameters())
        return True

    def make_cache(self) -> list[KVCache]:
        """Per-layer caches; the batch axis comes from the first write."""
        return [KVCache() for _ in range(self.num_layers)]

    def make_device_cache(self) -> list[DeviceKVCache]:
        return [DeviceKVCache() for _ in range(self.num_layers)]
