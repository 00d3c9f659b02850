"""Plain autoregressive decoding (no drafter): the reference every faster mode must equal."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.core as mx

from protocol import GenerationParams

from .cache import advance_layers
from .errors import ContextLengthError
from .models import DecoderModel
from .sampling import Sampler, check_params
from .stopping import Emission, TextStream
from .tokenizer import Tokenizer


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    stats: dict[str, object] = field(default_factory=dict)

    @property
    def usage(self) -> dict[str, int]:
        n = len(self.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first token (time to first token is reported apart)."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def check_context(model: DecoderModel, prompt_len: int, max_tokens: int) -> None:
    limit = model.args.max_position_embeddings
    if prompt_len == 0:
        raise ContextLengthError("the prompt is empty: give at least one token of prompt")
    if prompt_len + max_tokens > limit:
        raise ContextLengthError(
            f"prompt of {prompt_len} tokens plus max_tokens {max_tokens} exceeds the model's "
            f"context of {limit}; shorten the prompt or lower max_tokens"
        )


def plain_steps(model: DecoderModel, prompt_ids: Sequence[int], sampler: Sampler) -> Iterator[int]:
    """Yield tokens forever; step n+1 is queued on the device before step n is read.

    Each token comes from the verifier's own one-token forward: the prompt prefilled as the
    verifier does, then steps over the same device caches, so that speculative output can
    equal plain decoding bit for bit in half precision too (docs/exactness.md).
    """
    cache = model.make_device_cache()
    token = sampler.sample(model.prefill(prompt_ids, cache).logits[:, -1])
    mx.async_eval(token)
    length = len(prompt_ids)
    while True:
        next_token = sampler.sample(model(token[:, None], cache).logits[:, -1])
        advance_layers(cache, 1)
        mx.async_eval(next_token)
        length += 1
        for layer in cache:
            layer.settle(length)
        yield int(token.item())
        token = next_token


def generate_plain(
    model: DecoderModel, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: GenerationParams
) -> Iterator[Emission]:
    """Stream emissions of plain decoding until EOS, a stop string or max_tokens."""
    check_params(params)
    check_context(model, len(prompt_ids), params.max_tokens)
    stream = TextStream(tokenizer, params.max_tokens, params.stop)
    for token in plain_steps(model, prompt_ids, Sampler(params)):
        emission = stream.push([token])
        yield emission
        if emission.finish_reason is not None:
            return


def run_to_end(emissions: Iterator[Emission], prompt_tokens: int) -> GenerationResult:
    """Drain a stream of emissions into one result, timing first token and decode."""
    start = time.perf_counter()
    first = None
    text, ids, reason = [], [], "length"
    for emission in emissions:
        if first is None:
            first = time.perf_counter()
        text.append(emission.text)
        ids.extend(emission.token_ids)
        reason = emission.finish_reason or reason
    end = time.perf_counter()
    first = first or end
    return GenerationResult("".join(text), ids, reason, prompt_tokens, first - start, end - first)
