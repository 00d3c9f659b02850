"""What a round leaves on the device, and where others find it by handle.

Messages name device state by handle, (request id, round), never carry it
(docs/actors.md, "Handles"). The actor that computes a round's results keeps them in its
own :class:`RoundResults`, writes and frees them; the others get a :class:`RoundReader`
of it from the engine, which can only look a handle up. No actor reaches another actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, Sequence, TypeVar

import mlx.core as mx

from runtime.batching import HostReadout, padded

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class RoundReader(Protocol[T_co]):
    """Read access to an owner's round results, by handle."""

    def get(self, request_id: str, round: int) -> T_co: ...


class RoundResults(Generic[T]):
    """One owner's device results per (request id, round); only the owner writes here."""

    def __init__(self) -> None:
        self._rounds: dict[str, dict[int, T]] = {}

    def get(self, request_id: str, round: int) -> T:
        return self._rounds[request_id][round]

    def put(self, request_id: str, round: int, value: T) -> None:
        self._rounds.setdefault(request_id, {})[round] = value

    def pop(self, request_id: str, round: int) -> None:
        self._rounds.get(request_id, {}).pop(round, None)

    def drop(self, request_id: str) -> None:
        self._rounds.pop(request_id, None)


class DraftedRow(NamedTuple):
    blocks: list[list[int]]  # the drafts of each block the round verifies (runtime/branches.py)
    ctx_before: int
    ctx_after: int


@dataclass
class DraftStep:
    """One draft forward's device results, a row per request drafted in it."""

    drafts: mx.array  # [R, K, width-1]: K blocks a row, every row at the step's widest block
    probs: mx.array | None  # [R, width-1, V]: the q the drafts were drawn from (DFlash 2 sampling), else None
    readout: HostReadout  # the step's drafts, context lengths before and after


@dataclass
class DraftOutputs:
    """The drafter's results of one round: a row of a draft step."""

    step: DraftStep
    row: int
    block_size: int
    sampled: bool  # whether the drafts were drawn (their q is kept) rather than taken greedily

    @property
    def drafts(self) -> mx.array:
        """``[K, width-1]``: the request's blocks at full block width; the first block-1 of each are real."""
        return self.step.drafts[self.row]

    @property
    def probs(self) -> mx.array | None:
        return self.step.probs[self.row] if self.sampled and self.step.probs is not None else None

    def host(self) -> DraftedRow:
        values = self.step.readout.row(self.row).tolist()
        _, branches, width = self.step.drafts.shape
        blocks = [values[k * width : k * width + self.block_size - 1] for k in range(branches)]
        return DraftedRow(blocks, values[-2], values[-1])


class VerifiedRow(NamedTuple):
    """One request's round results on the host."""

    accepted: int
    bonus: int
    keep: int
    kv_before: int
    kv_after: int
    branch: int  # the block kept (runtime/branches.py)
    target_tokens: list[int]


@dataclass
class VerifyStep:
    """One verify forward's (or a prefill's) device results, a row per request in it."""

    bonus: mx.array  # [R]: the next anchors
    taps: mx.array  # [R, rows, n_taps*H]: the target's taps at the step's positions (the kept block's)
    keep: mx.array  # [R]: how many leading tap rows are accepted positions
    tokens: mx.array  # [R, width]: a round's committed tokens, the first keep of each row (the prefill: its first)
    readout: HostReadout  # the step's accepted, bonus, keep, kv before/after, block kept, target tokens


@dataclass
class RoundOutputs:
    """The verifier's results of one round (or of the prefill, round -1): a row of a verify step."""

    step: VerifyStep
    row: int
    block_size: int  # 0 for the prefill: every tap row is the prompt's

    @property
    def bonus(self) -> mx.array:
        return self.step.bonus[self.row]

    @property
    def taps(self) -> mx.array:
        """``[1, rows, n_taps*H]``: the request's own tap rows."""
        taps = self.step.taps[self.row : self.row + 1]
        return taps[:, : self.block_size] if self.block_size else taps

    @property
    def keep(self) -> mx.array:
        return self.step.keep[self.row]

    @property
    def tap_shape(self) -> tuple[int, ...]:
        rows, features = self.step.taps.shape[1:]
        return (min(rows, self.block_size) if self.block_size else rows, features)

    def host(self) -> VerifiedRow:
        values = self.step.readout.row(self.row).tolist()
        return VerifiedRow(*values[:6], values[6 : 6 + self.block_size])


def stacked_rows(parts: Sequence[tuple[mx.array, int]], rows: int | None = None) -> mx.array:
    """Rows ``(array, row)`` of steps' arrays stacked in order, zero rows after them up to ``rows``.

    Rows of one step cost no op when they are the whole step in order, and one slice or
    gather otherwise, so a batch's hand-off between the actors does not grow with its requests
    (a stack of per-request slices did: ~16 device ops a request a round).
    """
    whole = parts[0][0]
    if all(array is whole for array, _ in parts):
        order = [row for _, row in parts]
        if order == list(range(len(order))):
            out = whole if whole.shape[0] == len(order) else whole[: len(order)]
        else:
            out = whole[mx.array(order)]
    else:
        out = mx.stack([array[row] for array, row in parts])
    return padded(out, rows or len(parts))
