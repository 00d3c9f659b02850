"""Where the engine's MLX graphs are evaluated: on the event loop's thread, or on a worker.

Inline (the default), each actor calls ``mx.async_eval`` on the event loop's thread and
the committer's readouts wait there too: while MLX encodes a round's graphs (most of a
round's host time on a GPU: ``python -m runtime.profile``), no other actor runs.
``mx.async_eval`` releases the GIL while it encodes, so with ``threaded`` the evaluations
and readouts run on a worker thread instead, and the event loop builds the next graphs and
commits rounds meanwhile. MLX streams are bound to the thread that made them unless made by
``mx.new_thread_unsafe_stream``, whose users must keep every use of it in sequence: one
evaluation or readout at a time (a capacity limiter of one), and the engine's graphs built
on that stream (the event loop thread's default stream while the engine runs). So with
``threaded``, nothing else may evaluate MLX arrays on that thread while the engine runs.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import anyio
import mlx.core as mx

from .batching import HostReadout

# one stream per device for every threaded engine of the process: compiled steps are traced
# per stream (runtime.models.steps), so a fresh stream per engine would trace them all again;
# the lock keeps two engines' uses of the shared stream in sequence
_SHARED: dict[str, tuple[mx.Stream, threading.Lock]] = {}


def shared_stream(device: mx.Device) -> tuple[mx.Stream, threading.Lock]:
    key = str(device)
    if key not in _SHARED:
        _SHARED[key] = (mx.new_thread_unsafe_stream(device), threading.Lock())
    return _SHARED[key]


class Evaluator:
    def __init__(self, threaded: bool = False) -> None:
        self.threaded = threaded
        self._previous: mx.Stream | None = None
        self._lock: threading.Lock | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    def start(self) -> None:
        """Inside the event loop, before any of the engine's graphs is built."""
        if not self.threaded:
            return
        device = mx.default_device()
        self._previous = mx.default_stream(device)
        stream, self._lock = shared_stream(device)
        mx.set_default_stream(stream)
        self._limiter = anyio.CapacityLimiter(1)

    def stop(self) -> None:
        if self._previous is not None:
            mx.set_default_stream(self._previous)
            self._previous = None

    async def submit(self, *arrays: Any) -> None:
        """Queue ``arrays``' graphs on the device."""
        if self._limiter is None:
            mx.async_eval(*arrays)
            return
        await self._on_worker(lambda: mx.async_eval(*arrays))

    async def fetch(self, readout: HostReadout) -> None:
        """Copy a step's results to the host (waiting for the step), so its rows read without waiting."""
        if readout.fetched:
            return
        if self._limiter is None:
            readout.fetch()
            return
        await self._on_worker(readout.fetch)

    async def _on_worker(self, work: Callable[[], None]) -> None:
        lock = self._lock
        assert lock is not None

        def locked() -> None:
            with lock:
                work()

        await anyio.to_thread.run_sync(locked, limiter=self._limiter)
