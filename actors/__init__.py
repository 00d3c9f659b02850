"""The three actors of the DFlash pipeline, one module each (docs/actors.md).

Each actor is an anyio task that owns its requests' state, reads its bounded inbox and
sends to the other actors' inboxes, which the engine hands it at construction; device
arrays stay with their owner and messages name them by (request id, round). When a round
may be drafted, verified and committed is the mode's ``Schedule`` (actors/schedule.py).
No actor module imports another: the shared pieces are mailbox, rounds and schedule.
A failure while handling one request ends only that request.
"""

from .committer import Committer
from .drafter import Drafter
from .verifier import Verifier

__all__ = ["Committer", "Drafter", "Verifier"]
