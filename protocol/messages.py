"""Messages between the engine and its actors. Device state is referred to by handle
(request id, round number), never carried: the arrays stay with the actor that owns them.

Times are ``time.perf_counter()`` seconds of the engine's process.
"""

from __future__ import annotations

import msgspec

from .params import GenerationParams

SCHEMA_VERSION = 1


class Message(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    v: int = SCHEMA_VERSION
    request_id: str


class Admit(Message, tag="admit"):
    """A new request (engine -> drafter, and -> verifier, which prefills it)."""

    prompt_ids: list[int]
    params: GenerationParams


class Prefilled(Message, tag="prefilled"):
    """The prompt's forward is queued; its first token and taps are the verifier's (round -1)."""

    queued_at: float


class Drafted(Message, tag="drafted"):
    """Round ``round``'s drafts are queued on the device (drafter -> verifier, which verifies them,
    and -> committer, which reads the round before once this one is queued)."""

    round: int
    block_size: int
    speculative: bool  # started before the previous round was acknowledged
    draft_queued_at: float
    batch_size: int = 1  # requests drafted in the same forward (verified together, too)


class VerdictQueued(Message, tag="verdict_queued"):
    """Round ``round``'s verify and verdict are queued: the next round may be drafted from them."""

    round: int


class Verified(Message, tag="verified"):
    """Round ``round`` is queued end to end (verifier -> committer): its drafting's facts, and when
    its verify was queued."""

    round: int
    block_size: int
    speculative: bool
    draft_queued_at: float
    verify_queued_at: float
    batch_size: int = 1


class RoundAck(Message, tag="ack"):
    """The committer has checked and streamed round ``round`` (committer -> drafter, verifier).

    Round -1 is the prefill's first token; a request that ends early gets ``Cancelled`` instead.

    It carries what the host now knows for certain, so owners can tighten their caches.
    """

    round: int
    finished: bool
    target_kv: int = 0
    drafter_ctx: int = 0
    generated: int = 0


class Cancelled(Message, tag="cancelled"):
    """The request ended before its rounds did (its caller left, or it failed): every owner drops
    its state for it, and a queued Admit ahead of this is undone."""


class Drain(Message, tag="drain", kw_only=True):
    """The engine's marker (engine -> any actor): the actor reports ``seq`` once it has handled and
    flushed everything queued before it (Engine.stats waits on it instead of polling)."""

    request_id: str = ""
    seq: int


class Failed(Message, tag="failed"):
    """An actor could not process a request; only that request ends."""

    error: str
    kind: str


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenEvent(msgspec.Struct, frozen=True, kw_only=True):
    """What a caller of ``Engine.generate`` receives: committed tokens and their text."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error" on the last event
    usage: Usage | None = None
    timings: dict[str, float] = {}
    stats: dict[str, float | int | list[float]] = {}
    error: str | None = None


ActorMessage = Admit | Prefilled | Drafted | VerdictQueued | Verified | RoundAck | Cancelled | Drain | Failed
