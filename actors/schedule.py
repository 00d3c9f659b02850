"""The round schedule of every mode, in one place: what may be drafted, verified and
committed, and in what order (docs/actors.md, "The schedule").

A :class:`Schedule` holds no state: each actor asks it about the facts it owns (the
drafter about its requests' rounds, verdicts and acknowledgements, the verifier about the
rounds waiting for it, the committer about the rounds it has seen drafted), so the rules
live here while the state stays with its owner.

Round numbers: ``PREFILL`` (-1) is the prompt's forward and its first token; rounds
0, 1, ... follow. A round is acknowledged once the committer has checked and streamed it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

PREFILL = -1  # the prompt's forward: its first token is acknowledged as round -1
NONE = -2  # no round yet (before the prefill's acknowledgement, or before any draft)


class DraftProgress(Protocol):
    """What the drafter knows of one request, as the schedule reads it."""

    next_round: int  # the round it drafts next
    verdict_queued: int  # latest round whose verdict is on the device queue
    acked: int  # latest round the committer acknowledged
    generated: int  # tokens committed as of that acknowledgement
    max_tokens: int


@dataclass(frozen=True)
class Schedule:
    """How far a mode runs ahead of the committer.

    ``lookahead``: rounds drafted beyond the last acknowledged one (0: sequential).
    ``verify_after_commit``: round N+1 is verified only once round N is acknowledged.
    """

    lookahead: int
    verify_after_commit: bool = False

    # ------------------------------------------------------------------ drafting

    @staticmethod
    def needed(round: int, acked: int, generated: int, max_tokens: int) -> bool:
        """Whether ``round`` can still commit a token: each unacknowledged round before it commits one.

        A needed round drafts its whole block even near max_tokens (the committer trims what
        lies past it): a block shrunk to what remains would draft differently in each mode,
        since only the sequential one knows how many the rounds in flight commit.
        """
        in_flight = round - 1 - acked
        return max_tokens - generated - in_flight >= 1

    def may_draft(self, request: DraftProgress) -> bool:
        """The request's next round has its anchor queued (the verdict before it) and is within lookahead."""
        return (request.next_round == request.verdict_queued + 1
                and request.acked >= request.next_round - 1 - self.lookahead)

    def draft_step(self, requests: Mapping[str, DraftProgress]) -> list[str]:
        """The requests whose next round is drafted now, together in one forward (lockstep).

        Nothing is drafted while a request that has drafted before still waits for its
        verdict or acknowledgement: it will be ready within the step, and drafting without
        it would split the batch for good. Newcomers (no round drafted yet) join the next
        step; requests whose rounds in flight already reach max_tokens take no part.
        """
        ready, waiting = [], False
        for request_id, request in requests.items():
            if not self.needed(request.next_round, request.acked, request.generated, request.max_tokens):
                continue
            if self.may_draft(request):
                ready.append(request_id)
            elif request.next_round > 0:
                waiting = True
        return [] if waiting else ready

    # ------------------------------------------------------------------ verifying

    def may_verify(self, round: int, acked: int) -> bool:
        """Whether a drafted ``round`` may be verified, given the latest acknowledged round."""
        return not self.verify_after_commit or acked >= round - 1

    def verify_step(self, drafted: Mapping[str, int], acked: Mapping[str, int]) -> bool:
        """Whether the drafted rounds (request id -> round) are verified now, all in one forward.

        All or none: with verify-after-commit each drafted round waits for all the others
        (each one's round before is already verified, so its acknowledgement is on its way);
        the committer acknowledges a step's rounds one by one, and verifying each as its
        acknowledgement came would split the batch into single rows.
        """
        return bool(drafted) and all(self.may_verify(r, acked[rid]) for rid, r in drafted.items())

    # ------------------------------------------------------------------ committing

    def may_commit(self, round: int, drafted: int, generated: int, max_tokens: int) -> bool:
        """Whether verified ``round`` is read and committed now, given the latest round drafted.

        Reading round N blocks the host until the device has finished it; the rounds drafted
        ahead of it (N+1, and N+2 with two rounds of lookahead) are queued first, else the
        device idles while the host builds them. A round that will not be drafted (the rounds
        before it reach max_tokens) is not waited for.
        """
        ahead = round + self.lookahead
        return (self.lookahead == 0 or drafted >= ahead
                or not self.needed(ahead, round - 1, generated, max_tokens))


# pipelined reads round N once N+1 is queued, pipelined2 once N+2 is (the host then waits on
# the device less often behind it), sequential at once; draft-ahead drafts N+1 before reading
# N but verifies it after: its cache writes then never land in buffers a queued verify still
# reads (MLX copies such a buffer whole rather than write it in place)
MODES = {"pipelined": Schedule(1), "sequential": Schedule(0), "pipelined2": Schedule(2),
         "draft-ahead": Schedule(1, verify_after_commit=True)}
