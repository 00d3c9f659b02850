"""What a caller asks of one generation."""

from __future__ import annotations

import msgspec


class GenerationParams(msgspec.Struct, kw_only=True, frozen=True):
    """Sampling and stopping for one request. ``temperature`` below 1e-5 (0 included) means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    block_size: int | None = None  # speculative block; None: the drafter's trained size
