"""What batching rounds across requests needs besides stacked caches: host readouts and padding.

A batched step produces per-row results on the device. The committer must read them to
the host, but one read per request would sync once per row: a ``HostReadout`` packs a
step's per-row integers in one array, read once, the first time any row is asked for.

Batch shapes: backends that build kernels per shape (cuDNN attention on CUDA) would
build new ones whenever the number of requests in a step changes. With ``pad_batches``
a step runs ``padded_batch(R)`` rows (a power of two), the extra ones blank; on the CPU,
where padding rows is real compute and no kernel is built per shape, it is off.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np


class HostReadout:
    """Per-row int32 results of one step (``[R, columns]``), copied to the host once."""

    def __init__(self, columns: Sequence[mx.array]) -> None:
        self.packed = mx.concatenate([c.astype(mx.int32).reshape(c.shape[0], -1) for c in columns], axis=1)
        self._host: np.ndarray | None = None

    def row(self, index: int) -> np.ndarray:
        if self._host is None:
            self._host = np.array(self.packed)  # waits for the step: the only host sync of it
        return self._host[index]


def padded_batch(rows: int) -> int:
    """The next power of two: a few batch shapes for any number of requests."""
    return 1 << (rows - 1).bit_length()


def default_pad_batches() -> bool:
    return mx.default_device() == mx.gpu


def padded(values: mx.array, rows: int) -> mx.array:
    """``values [n, ...]`` with zero rows after them up to ``rows`` (the batch's blank rows)."""
    missing = rows - values.shape[0]
    return mx.concatenate([values, mx.zeros((missing, *values.shape[1:]), dtype=values.dtype)]) if missing else values


def pad_rows(rows: Sequence[mx.array], width: int, axis: int = 0) -> mx.array:
    """Stack rows of unequal length along a new leading axis, zero-padded to ``width`` on ``axis``."""
    out = []
    for row in rows:
        missing = width - row.shape[axis]
        if missing:
            pads = [(0, 0)] * row.ndim
            pads[axis] = (0, missing)
            row = mx.pad(row, pads)
        out.append(row)
    return mx.stack(out)
