"""The three actors of the DFlash pipeline, one module each.

Each actor is an anyio task that owns its requests' state, reads its bounded inbox and
sends to the next actor; device arrays stay with their owner and messages name them by
(request id, round). A failure while handling one request ends only that request.
"""

from .committer import Committer
from .drafter import Drafter
from .verifier import Verifier

__all__ = ["Committer", "Drafter", "Verifier"]
