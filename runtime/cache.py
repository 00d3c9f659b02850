"""Key/value caches for the target and the drafter.

Keys and values are stored ``[B, kv_heads, T, head_dim]`` in a buffer that grows in
steps, so appending a block costs a slice update, and trimming is only moving the
valid length back: trimmed positions are overwritten by the next append and never
attended because attention reads only ``[:offset]``.
"""

from __future__ import annotations

import mlx.core as mx

GROWTH_STEP = 256


class KVCache:
    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        b, h, _, kd = keys.shape
        vd = values.shape[3]
        capacity = ((needed + GROWTH_STEP - 1) // GROWTH_STEP) * GROWTH_STEP
        new_k = mx.zeros((b, h, capacity, kd), keys.dtype)
        new_v = mx.zeros((b, h, capacity, vd), values.dtype)
        if self.keys is not None and self.values is not None and self.offset:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys/values [B, H, L, D]``; return everything valid including them."""
        length = keys.shape[2]
        end = self.offset + length
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(keys, values, end)
        assert self.keys is not None and self.values is not None
        self.keys[..., self.offset : end, :] = keys
        self.values[..., self.offset : end, :] = values
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions; returns how many were actually dropped."""
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


def trim_caches(caches: list[KVCache], n: int) -> None:
    for cache in caches:
        cache.trim(n)


def cache_length(caches: list[KVCache]) -> int:
    return caches[0].offset if caches else 0
