"""What a round leaves on the device, and where others find it by handle.

Messages name device state by handle, (request id, round), never carry it
(docs/actors.md, "Handles"). The actor that computes a round's results keeps them in its
own :class:`RoundResults`, writes and frees them; the others get a :class:`RoundReader`
of it from the engine, which can only look a handle up. No actor reaches another actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

import mlx.core as mx

from runtime.batching import HostReadout

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
    drafts: list[int]
    ctx_before: int
    ctx_after: int


@dataclass
class DraftOutputs:
    """The drafter's results of one round."""

    drafts: mx.array  # [width-1]: the request's full block width; the first block-1 are real
    block_size: int
    readout: HostReadout  # the step's drafts, context lengths before and after
    row: int
    probs: mx.array | None = None  # [width-1, V]: the q the drafts were drawn from (DFlash 2 sampling), else None

    def host(self) -> DraftedRow:
        values = self.readout.row(self.row).tolist()
        return DraftedRow(values[: self.block_size - 1], values[-2], values[-1])


class VerifiedRow(NamedTuple):
    """One request's round results on the host."""

    accepted: int
    bonus: int
    keep: int
    kv_before: int
    kv_after: int
    target_tokens: list[int]


@dataclass
class RoundOutputs:
    """The verifier's results of one round (or of the prefill, round -1)."""

    bonus: mx.array  # the next anchor
    taps: mx.array  # [1, rows, n_taps*H]
    keep: mx.array  # how many leading tap rows are accepted positions
    readout: HostReadout  # the step's accepted, bonus, keep, kv before/after, target tokens
    row: int
    block_size: int

    def host(self) -> VerifiedRow:
        values = self.readout.row(self.row).tolist()
        return VerifiedRow(*values[:5], values[5 : 5 + self.block_size])
