"""Turning logits into tokens: greedy, temperature, top-k, top-p, reproducible with a seed.

Plain decoding and speculative decoding share :func:`probabilities`, so "lossless"
means the same distribution in both, not merely a similar one.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import msgspec

from protocol import GenerationParams

from .errors import RequestError

# Below this a temperature is greedy, as vLLM treats it: dividing logits by 1e-40 overflows
# float32 to inf (and inf - inf to NaN), which would sample garbage, EOS included.
GREEDY_BELOW = 1e-5


def params_with(params: GenerationParams | None, fields: dict[str, Any], caller: str = "generate") -> GenerationParams:
    """``params`` (or the defaults) with ``fields`` replaced, every field's type checked.

    The keyword form (``generate(prompt, max_tokens=64, temperature=0.7)``) is what users of
    mlx-lm and vLLM write; a wrong type is a TypeError naming the argument, not a failure deep
    inside a round.
    """
    if params is not None and not isinstance(params, GenerationParams):
        raise TypeError(f"{caller}(): params must be a GenerationParams, not {type(params).__name__}; "
                        f"or pass its fields as keywords: {caller}(prompt, max_tokens=64, temperature=0.7)")
    known = GenerationParams.__struct_fields__
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r} (fields: {', '.join(known)})")
    if isinstance(fields.get("stop"), str):
        fields = {**fields, "stop": (fields["stop"],)}
    try:
        return msgspec.convert({**msgspec.structs.asdict(params or GenerationParams()), **fields}, GenerationParams)
    except msgspec.ValidationError as exc:
        where, _, _ = str(exc).rpartition(" - at `$.")
        name = str(exc).rpartition("`$.")[2].rstrip("`").split("[")[0]
        raise TypeError(f"{caller}(): {name}: {where or exc}") from None


def check_params(params: GenerationParams) -> None:
    """Reject values no sampler can honour, naming the field."""
    if params.max_tokens < 1:
        raise RequestError("max_tokens", f"must be at least 1, got {params.max_tokens}")
    if not 0.0 <= params.temperature <= 10.0:
        raise RequestError("temperature", f"must be in [0, 10], got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise RequestError("top_p", f"must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise RequestError("top_k", f"must be 0 (off) or positive, got {params.top_k}")
    if params.block_size is not None and params.block_size < 1:
        raise RequestError("block_size", f"must be at least 1, got {params.block_size}")
    if any(not s for s in params.stop):
        raise RequestError("stop", "stop strings must be non-empty")


def is_greedy(params: GenerationParams) -> bool:
    return params.temperature < GREEDY_BELOW


def probabilities(logits: mx.array, params: GenerationParams) -> mx.array:
    """The sampling distribution over the last axis after temperature, top-k and top-p."""
    logits = logits.astype(mx.float32) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -params.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        # the smallest prefix whose mass reaches top_p, and always the likeliest token: a top_p
        # that underflows float32 (5e-324) keeps that one instead of none (0 / 0 = NaN)
        keep_sorted = (before < params.top_p) | (mx.arange(probs.shape[-1]) == 0)
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


class Sampler:
    """Draws tokens for one request; a seed makes the sequence of draws reproducible.

    ``drafts=True``: the stream of the drafter's own draws (a DFlash 2 selector at
    temperature > 0), seeded by the same seed but apart from the verifier's: its chain starts
    at ``split(key(seed), 3)[2]``, a key the verifier's chain (``split`` in two at every draw)
    does not produce, so a draft never shares a key with an acceptance test.
    """

    def __init__(self, params: GenerationParams, drafts: bool = False) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else int(mx.random.randint(0, 2**31 - 1).item())
        self._key = mx.random.split(mx.random.key(seed), 3)[2] if drafts else mx.random.key(seed)

    def next_key(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key

    def sample(self, logits: mx.array) -> mx.array:
        """Tokens for ``logits [..., V]`` (argmax when greedy)."""
        if is_greedy(self.params):
            return mx.argmax(logits, axis=-1)
        return self.draw(probabilities(logits, self.params))

    def draw(self, probs: mx.array) -> mx.array:
        """One draw per row of an explicit distribution ``probs [..., V]``."""
        return mx.random.categorical(mx.log(probs), axis=-1, key=self.next_key())

    def uniform(self, shape: tuple[int, ...]) -> mx.array:
        return mx.random.uniform(shape=shape, key=self.next_key())

    def gumbel(self, shape: tuple[int, ...]) -> mx.array:
        """Gumbel noise: the argmax of ``scores + noise`` is a draw from ``softmax(scores)``."""
        return mx.random.gumbel(shape=shape, key=self.next_key())
