"""Key/value caches for the target and the drafter.

Keys and values are stored ``[B, kv_heads, T, head_dim]`` in a buffer that grows in
steps, so appending a block costs a slice update, and trimming is only moving the
valid length back: trimmed positions are overwritten by the next append and never
attended because attention reads only ``[:offset]``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

import mlx.core as mx

GROWTH_STEP = 256
ATTENTION_BUCKET = 64  # multi-token attention reads keys in whole buckets: few distinct shapes


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def causal_mask(keys: int, start: int | mx.array, n: int, branch: int = 0) -> mx.array:
    """Which of ``keys`` positions each of ``n`` queries written at ``start`` attends: ``[n, keys]``
    (``[R, n, keys]`` for a start per row ``[R]``).

    Query i sees the keys before it. With ``branch`` > 0 the queries are blocks of ``branch``
    rows, each continuing the cache on its own (runtime/branches.py): a query sees the keys
    before ``start`` and its own block's rows up to itself, never another block's.
    """
    key_pos, start = mx.arange(keys), mx.array(start)
    query_pos = start[..., None] + mx.arange(n)  # [n], or [R, n]
    mask = key_pos <= query_pos[..., None]
    if branch and branch < n:
        own_block = start[..., None] + (mx.arange(n) // branch) * branch
        mask = mask & ((key_pos < start[..., None, None]) | (key_pos >= own_block[..., None]))
    return mask


def bucketed(length: int, capacity: int) -> int:
    """``length`` rounded up to a whole bucket, within the buffer."""
    return min(capacity, round_up(length, ATTENTION_BUCKET))


class KVCache:
    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        b, h, _, kd = keys.shape
        vd = values.shape[3]
        capacity = round_up(needed, GROWTH_STEP)
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

    def attention_mask(self, n: int, branch: int = 0) -> tuple[int, mx.array | None]:
        """Before ``n`` rows are written: the keys attention will read after it, and the mask
        (``branch``: the rows are blocks of that many, each on its own: ``causal_mask``).

        One query reads the valid keys only. Several queries (a prefill, a verified block)
        read keys in whole buckets under a mask, so their key shape changes once every
        ATTENTION_BUCKET positions: per-shape attention kernels (cuDNN on CUDA) are then
        built a few times per request rather than once per round. Every layer's cache has
        the same length, so a forward computes this once and shares it.
        """
        end = self.offset + n
        if n == 1:
            return end, None
        extent = round_up(end, ATTENTION_BUCKET)  # within the buffer: it grows in GROWTH_STEPs
        return extent, causal_mask(extent, self.offset, n, branch)

    def write_and_read(self, keys: mx.array, values: mx.array, extent: int) -> tuple[mx.array, mx.array]:
        """Append, then the first ``extent`` key/value rows (from ``attention_mask``)."""
        self.update_and_fetch(keys, values)
        assert self.keys is not None and self.values is not None
        return self.keys[..., :extent, :], self.values[..., :extent, :]

    def move_rows(self, source: int, to: int, rows: int) -> None:
        """Copy ``rows`` positions from ``source`` to ``to`` (a verify's kept block: runtime/branches.py)."""
        assert self.keys is not None and self.values is not None
        if source != to:
            self.keys[..., to : to + rows, :] = self.keys[..., source : source + rows, :]
            self.values[..., to : to + rows, :] = self.values[..., source : source + rows, :]

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


class DeviceKVCache:
    """A cache whose valid length lives on the device, for pipelined rounds.

    The host cannot know how many drafts round N accepted until round N+1 is already
    queued, so the write position (``length``) is a device scalar: each append writes at
    ``length`` with ``slice_update`` and attention masks keys at or past the valid end.
    ``bound`` is the host's upper bound on ``length`` (every write could be kept); it sizes
    the buffer, and ``settle`` tightens it once the true length is read. Attention reads
    ``extent`` keys (the bound in whole ATTENTION_BUCKETs) under the mask, so key shapes
    change once per bucket: backends that build a kernel or graph per shape (cuDNN
    attention on CUDA) then build a few per request, not one per round.
    """

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.length = mx.array(0, dtype=mx.int32)
        self.bound = 0
        self._unsettled: list[int] = []  # sizes of writes the host has not seen resolved

    @property
    def offset(self) -> mx.array:
        return self.length

    def _ensure_capacity(self, keys: mx.array, values: mx.array, needed: int) -> None:
        if self.keys is not None and needed <= self.keys.shape[2]:
            return
        b, h, _, kd = keys.shape
        capacity = round_up(needed, GROWTH_STEP)
        grow_k = mx.zeros((b, h, capacity - (0 if self.keys is None else self.keys.shape[2]), kd), keys.dtype)
        grow_v = mx.zeros((b, h, grow_k.shape[2], values.shape[3]), values.dtype)
        self.keys = grow_k if self.keys is None else mx.concatenate([self.keys, grow_k], axis=2)
        self.values = grow_v if self.values is None else mx.concatenate([self.values, grow_v], axis=2)

    @property
    def extent(self) -> int:
        """Buffer rows attention reads (valid or not): the bound in whole buckets."""
        return self.extent_after(0)

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Write ``keys/values [B, H, L, D]`` at the device length (one per row when stacked)."""
        length = keys.shape[2]
        self._ensure_capacity(keys, values, self.bound + length)
        assert self.keys is not None and self.values is not None
        if self.length.ndim == 0:
            start = self.length.reshape(1)
            self.keys = mx.slice_update(self.keys, keys, start_indices=start, axes=(2,))
            self.values = mx.slice_update(self.values, values, start_indices=start, axes=(2,))
        else:  # stacked requests: row r writes at its own length[r]
            rows = (self.length[:, None] + mx.arange(length))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(rows, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(rows, values.shape), values, axis=2)
        self._count_write(length)

    def _count_write(self, rows: int) -> None:
        """``rows`` more could become valid: the bound grows until ``settle`` learns how many did."""
        self._unsettled.append(rows)
        self.bound += rows

    def extent_after(self, rows: int) -> int:
        """``extent`` once ``rows`` more are written (the buffer then holds whole GROWTH_STEPs)."""
        return round_up(self.bound + rows, ATTENTION_BUCKET) if self.keys is not None or rows else 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def reserve(self, rows: int) -> None:
        """Grow the buffer now for ``rows`` more, so a compiled step never has to."""
        assert self.keys is not None and self.values is not None, "reserve after the first write"
        self._ensure_capacity(self.keys, self.values, self.bound + rows)

    def attention_mask(self, n: int, branch: int = 0) -> tuple[int, mx.array]:
        """Before ``n`` rows are written at ``length``: the keys read after it, and the causal
        mask over them that admits valid keys only (``[R, 1, n, extent]`` when stacked;
        ``branch``: see ``causal_mask``)."""
        extent = self.extent_after(n)
        mask = causal_mask(extent, self.length, n, branch)
        return extent, mask[:, None] if mask.ndim == 3 else mask

    def write_and_read(self, keys: mx.array, values: mx.array, extent: int) -> tuple[mx.array, mx.array]:
        self.write(keys, values)
        assert self.keys is not None and self.values is not None
        return self.keys[..., :extent, :], self.values[..., :extent, :]

    def snapshot(self) -> tuple[object, ...]:
        """Everything a write changes (references: cheap), for ``restore`` after a failed step."""
        return self.keys, self.values, self.length, self.bound, list(self._unsettled)

    def restore(self, state: tuple[object, ...]) -> None:
        self.keys, self.values, self.length, self.bound, self._unsettled = state  # type: ignore[assignment]

    def advance(self, n: mx.array | int) -> None:
        """Keep ``n`` of the positions written last (lazy): the rest lie past the valid end."""
        self.length = (self.length + n).astype(mx.int32)

    def settle(self, length: int) -> None:
        """The host has read the length after the oldest unsettled write: tighten the bound."""
        self._unsettled.pop(0)
        self.bound = length + sum(self._unsettled)

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def blank(self) -> "DeviceKVCache":
        """An empty cache shaped like this one: a padding row of a stacked step."""
        other = DeviceKVCache()
        assert self.keys is not None and self.values is not None
        other.keys, other.values = mx.zeros_like(self.keys), mx.zeros_like(self.values)
        return other


def moved_index(capacity: int, source: mx.array, to: mx.array, rows: int) -> mx.array:
    """``[B or 1, 1, capacity, 1]``: each position's row after ``rows`` rows from ``source`` are
    copied to ``to``, for ``take_along_axis`` over a buffer's positions. One gather a buffer
    instead of a slice and a slice update (on a GPU each is a kernel launch the host pays,
    and a cache buffer passed into a step is copied whole by a slice update all the same),
    and one index for every buffer of a model's cache."""
    positions = mx.arange(capacity).reshape(1, 1, capacity, 1)
    source, to = source.reshape(-1, 1, 1, 1), to.reshape(-1, 1, 1, 1)
    inside = (positions >= to) & (positions < to + rows)
    return mx.where(inside, positions + (source - to), positions).astype(mx.int32)


def advance_layers(caches: Sequence[DeviceKVCache], n: mx.array | int) -> None:
    """Keep ``n`` of the positions just written in every layer's cache.

    The layers of a model's cache were all written the same rows, so they share one valid
    length: one device add for the model instead of one per layer (each op costs host time).
    """
    caches[0].advance(n)
    for cache in caches[1:]:
        cache.length = caches[0].length


class TracedKVCache(DeviceKVCache):
    """A device cache inside a compiled step: buffers and length are the step's inputs.

    A trace must not depend on the host-side ``bound``, which changes every round: the
    caller fixes the extent instead (the buffer's capacity: attention then reads the whole
    buffer under the mask), so one trace serves every round until the buffer grows.
    """

    def __init__(self, keys: mx.array, values: mx.array, length: mx.array, extent: int) -> None:
        super().__init__()
        self.keys, self.values, self.length = keys, values, length
        self._extent = extent

    def extent_after(self, rows: int) -> int:
        return self._extent


def traced_caches(arrays: Sequence[mx.array], extent: int) -> list[TracedKVCache]:
    """Stand-ins for a compiled step's caches, from its inputs (``cache_arrays``'s layout)."""
    n = len(arrays) // 3
    return [TracedKVCache(arrays[i], arrays[n + i], arrays[2 * n + i], extent) for i in range(n)]


def cache_arrays(caches: Sequence[DeviceKVCache]) -> list[mx.array]:
    """Every layer's keys, then values, then lengths: a compiled step's cache inputs and outputs."""
    return [c.keys for c in caches] + [c.values for c in caches] + [c.length for c in caches]  # type: ignore[misc]


def adopt_arrays(caches: Sequence[DeviceKVCache], arrays: Sequence[mx.array], rows_written: int) -> None:
    """Give the caches a compiled step's outputs, and count the rows it wrote."""
    n = len(caches)
    for i, cache in enumerate(caches):
        cache.keys, cache.values, cache.length = arrays[i], arrays[n + i], arrays[2 * n + i]
        if rows_written:
            cache._count_write(rows_written)


class StackedKVCache(DeviceKVCache):
    """One layer's caches of several requests on the batch axis, for batched forwards.

    Row r is member r's cache: ``length`` is ``[R]``, so each row writes, ropes and
    attends at its own length. After a step, ``count_writes`` does the members' bookkeeping
    and ``release_rows`` gives members their rows back (a stack may serve several steps first:
    ``KeptStack``). Stacking copies the members' buffers: far cheaper than the kernel
    launches a separate forward per request would be.
    """

    def __init__(self, members: Sequence[DeviceKVCache], new_rows: int) -> None:
        super().__init__()
        self.members = list(members)
        self.bound = max(c.bound for c in members)
        self.length = mx.stack([c.length for c in members])
        capacity = round_up(self.bound + new_rows, GROWTH_STEP)
        self.keys = mx.concatenate([_fit(c.keys, capacity) for c in members], axis=0)
        self.values = mx.concatenate([_fit(c.values, capacity) for c in members], axis=0)

    def regathered(self, members: Sequence[DeviceKVCache], rows_here: Sequence[int | None], leaving: Sequence[int],
                   new_rows: int, blanks: int) -> StackedKVCache:
        """This stack re-formed for other members: member ``i`` takes row ``rows_here[i]`` of this
        stack, or (None) joins with its own buffers; ``blanks`` zero rows follow. The members at
        rows ``leaving`` get their rows back first. A few ops a layer (fit, concatenate the
        joiners, one gather) however many members stay, where unstacking and stacking anew
        slices and copies every member's rows."""
        assert self.keys is not None and self.values is not None
        self.release_rows(leaving)
        joining = [c for c, row in zip(members, rows_here) if row is None]
        capacity = round_up(max(c.bound for c in members) + new_rows, GROWTH_STEP)
        keys, values, length = _fit(self.keys, capacity), _fit(self.values, capacity), self.length
        first_join, zero_row = keys.shape[0], keys.shape[0] + len(joining)
        if joining or blanks:
            _, h, _, d = keys.shape
            keys = mx.concatenate([keys, *(_fit(c.keys, capacity) for c in joining), mx.zeros((1, h, capacity, d), keys.dtype)])
            values = mx.concatenate([values, *(_fit(c.values, capacity) for c in joining),
                                     mx.zeros((1, h, capacity, values.shape[3]), values.dtype)])
            length = mx.concatenate([length, mx.stack([c.length for c in joining] + [mx.array(0, dtype=mx.int32)])])
        joined = iter(range(first_join, zero_row))
        index = [row if row is not None else next(joined) for row in rows_here] + [zero_row] * blanks
        if index != list(range(keys.shape[0])):
            order = mx.array(index, dtype=mx.int32)
            keys, values, length = keys[order], values[order], length[order]
        stack = StackedKVCache.__new__(StackedKVCache)  # its rows are made here, not copied from the members
        DeviceKVCache.__init__(stack)
        stack.members = [*members, *(DeviceKVCache() for _ in range(blanks))]
        stack.bound = max(c.bound for c in stack.members)
        stack.keys, stack.values, stack.length = keys, values, length
        return stack

    def count_writes(self, written: Sequence[int]) -> None:
        """The members' host-side bookkeeping of a step's writes (their device rows stay here).

        A member written ``0`` rows took part without new rows (they lie past its valid end
        and its bound): the drafter's newcomers, whose context went in beforehand.
        """
        for cache, rows in zip(self.members, written):
            if rows:
                cache._count_write(rows)

    def release_rows(self, rows: Iterable[int]) -> None:
        """Give the members at these rows their rows of the buffers and the device length."""
        assert self.keys is not None and self.values is not None
        for row in rows:
            cache = self.members[row]
            cache.keys, cache.values = self.keys[row : row + 1], self.values[row : row + 1]
            cache.length = self.length[row]

    def fits(self, new_rows: int) -> bool:
        """Take the members' current bounds (acknowledgements tighten them); whether ``new_rows``
        more still fit the buffer, so the stack can serve another step as it is."""
        self.bound = max(c.bound for c in self.members)
        self._unsettled.clear()  # the stack's own write counts: its members keep the ones that matter
        return self.bound + new_rows <= self.capacity


def stack_layers(requests: Sequence[Sequence[DeviceKVCache]], new_rows: int, rows: int) -> list[StackedKVCache]:
    """Each layer's caches of these requests stacked, blank rows after them up to ``rows``."""
    blanks = [[layer.blank() for layer in requests[0]] for _ in range(rows - len(requests))]
    return [StackedKVCache(layers, new_rows) for layers in zip(*requests, *blanks)]


def _fit(buffer: mx.array | None, capacity: int) -> mx.array:
    """A member's buffer cut or zero-padded to ``capacity`` rows (nothing valid lies past its bound)."""
    assert buffer is not None, "a member joins a stack after its first write"
    if buffer.shape[2] >= capacity:
        return buffer[..., :capacity, :]
    b, h, t, d = buffer.shape
    return mx.concatenate([buffer, mx.zeros((b, h, capacity - t, d), buffer.dtype)], axis=2)


class KeptStack:
    """Stacked caches kept from step to step, re-formed as requests join and leave.

    Stacking copies every member's buffers and unstacking makes a view per row and layer:
    ops that cost host time on a GPU. While the same requests run together (same order and
    row count) and the new rows fit, one stack serves step after step and holds their device
    rows (their own caches keep only the host-side bookkeeping). When the members change
    and some stay, the stack is re-formed (``StackedKVCache.regathered``): leavers get their
    rows back, joiners' buffers are added, a gather puts the rows in order; a finished
    request is dropped at the next step. It breaks up when none stays, one runs alone, or
    a step fails.
    """

    def __init__(self) -> None:
        self.ids: tuple[str, ...] = ()
        self.layers: list[StackedKVCache] | None = None
        self.dropped: set[str] = set()  # members gone for good (finished, cancelled): their rows go with the stack

    def holds(self, request_id: str) -> bool:
        return self.layers is not None and request_id in self.ids and request_id not in self.dropped

    def drop(self, request_id: str) -> None:
        """A member is gone for good: its rows leave at the next step's re-forming (the stack goes
        when none of its members is left), so the others stay stacked."""
        if self.holds(request_id):
            self.dropped.add(request_id)
            if self.dropped.issuperset(self.ids):
                self.break_up()

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers) if self.layers is not None else 0

    @contextmanager
    def stacked(self, ids: Sequence[str], caches: Sequence[Sequence[DeviceKVCache]], new_rows: int, rows: int,
                written: Sequence[int] | None = None) -> Iterator[Sequence[DeviceKVCache]]:
        """The layers' caches of these requests for one step (stacked, blank rows up to ``rows``;
        a lone request's own caches), and after it ``written`` rows (default ``new_rows``) counted
        for each. On failure the caches, or the stack (whose rows then go back to the requests),
        are restored, so a retry starts from the same state."""
        if rows == 1:
            self.break_up()
            with restored_on_failure(caches):
                yield caches[0]
            return
        if self.layers is None or self.ids != tuple(ids) or len(self.layers[0].members) != rows \
                or not all(layer.fits(new_rows) for layer in self.layers):
            here = {rid: row for row, rid in enumerate(self.ids) if rid not in self.dropped}
            if self.layers is not None and any(rid in here for rid in ids):  # some stay: re-form, not rebuild
                rows_here, staying = [here.get(rid) for rid in ids], set(ids)
                leaving = [row for rid, row in here.items() if rid not in staying]
                self.layers = [layer.regathered(members, rows_here, leaving, new_rows, rows - len(ids))
                               for layer, members in zip(self.layers, zip(*caches))]
                self.ids, self.dropped = tuple(ids), set()
            else:
                self.break_up()
                self.ids, self.layers = tuple(ids), stack_layers(caches, new_rows, rows)
            for layers in caches:  # their rows live in the stack now: drop the copies
                for layer in layers:
                    layer.keys = layer.values = None
        try:
            with restored_on_failure([self.layers]):
                yield self.layers
        except BaseException:
            self.break_up()
            raise
        for layer in self.layers:
            layer.count_writes(written if written is not None else [new_rows] * len(ids))

    def break_up(self) -> None:
        """Give the members their rows back."""
        if self.layers is not None:
            for layer in self.layers:
                layer.release_rows(row for row, rid in enumerate(self.ids) if rid not in self.dropped)
            self.ids, self.layers, self.dropped = (), None, set()


@contextmanager
def restored_on_failure(caches: Sequence[Sequence[DeviceKVCache]]) -> Iterator[None]:
    """Give every cache back the state it had on entry if the block raises (a batched step's retry starts clean)."""
    saved = [[layer.snapshot() for layer in layers] for layers in caches]
    try:
        yield
    except BaseException:
        for layers, states in zip(caches, saved):
            for layer, state in zip(layers, states):
                layer.restore(state)
        raise


def trim_caches(caches: list[KVCache], n: int) -> None:
    for cache in caches:
        cache.trim(n)


def cache_length(caches: list[KVCache]) -> int:
    return caches[0].offset if caches else 0
