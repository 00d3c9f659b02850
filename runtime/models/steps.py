"""Compiled steps: a model's forward over device caches, traced once per configuration.

On the GPU a round is bound by the host: each op costs microseconds to build and queue
(docs/decode-loop.md, "Pipelining"; ``python -m runtime.profile`` measures it), so a 30-layer verify spends
more time on the host than on the device. ``mx.compile`` traces a step once and replays
it, fusing what it can. A trace must see only the step's arrays: the caches enter as
inputs and leave as outputs (runtime.cache.TracedKVCache). Attention then reads the
whole buffer under the mask rather than whole buckets of it, so a trace serves every
round until the buffer grows (every GROWTH_STEP positions); what else the host decides
per round that would change the trace (which inputs exist) is part of the configuration
a trace is kept under.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Hashable, Sequence

import mlx.core as mx

from ..cache import DeviceKVCache, adopt_arrays, cache_arrays

Step = Callable[..., list[mx.array]]


def default_compile_steps() -> bool:
    """On by default on a GPU; on the CPU a trace builds C++ kernels and saves little."""
    return mx.default_device() == mx.gpu


def compiled_step(function: Callable[..., Any], **fixed: Hashable) -> Callable[..., Any]:
    """``function`` with the keyword arguments ``fixed`` bound, ``mx.compile``'d where steps are
    compiled by default (a GPU: a step of many small ops then costs the host one call); one
    per function and binding."""
    return _bound(function, tuple(sorted(fixed.items())), default_compile_steps())


@lru_cache(maxsize=None)
def _bound(function: Callable[..., Any], fixed: tuple[tuple[str, Hashable], ...], compiled: bool) -> Callable[..., Any]:
    def step(*arrays: mx.array) -> Any:
        return function(*arrays, **dict(fixed))

    return mx.compile(step) if compiled else step


def traceable(caches: Sequence[object] | None) -> bool:
    """Device caches that already hold buffers (a first write sizes them outside any trace)."""
    return bool(caches) and all(isinstance(c, DeviceKVCache) and c.keys is not None for c in caches)  # type: ignore[union-attr]


class CompiledSteps:
    """``mx.compile``'d steps, one per configuration (input shapes are mx.compile's own key)."""

    def __init__(self) -> None:
        self._steps: dict[Hashable, Step] = {}

    def get(self, configuration: Hashable, make: Callable[[], Step]) -> Step:
        step = self._steps.get(configuration)
        if step is None:
            step = self._steps[configuration] = mx.compile(make())
        return step

    def run(self, caches: Sequence[DeviceKVCache], rows: int, configuration: Hashable,
            make: Callable[[int], Step], *inputs: object) -> list[mx.array]:
        """One step over ``caches`` that writes ``rows`` rows to each: the buffers grow first (never
        inside a trace), then the step traced for the buffer size runs (``make(extent)`` builds
        it: attention reads the whole buffer under the mask, so a trace serves every round until
        the buffer grows). The step returns its results then ``cache_arrays``; the caches adopt
        theirs, the results come back."""
        for layer in caches:
            layer.reserve(rows)
        extent = caches[0].capacity
        step = self.get((extent, configuration), lambda: make(extent))
        outputs = step(*inputs, cache_arrays(caches))
        results = len(outputs) - 3 * len(caches)
        adopt_arrays(caches, outputs[results:], rows)
        return outputs[:results]
