"""Oracle acceptance: a measuring instrument that fixes how many drafts every round accepts.

Trained drafters for 4B-8B targets cannot be had here, and random weights draft nothing
right (tau ~1), so the runtime's throughput at a given tau cannot be measured with real
drafts. On a random target (``runtime.random_targets``) greedy decoding follows a known
successor of each token, so its plain greedy continuation of any anchor is known.
:class:`OracleDrafter` runs the whole drafter forward (its cost is the real one), then
replaces the drafts by that continuation for the first ``k`` positions and a wrong token
after: the verifier, unchanged, accepts exactly ``k`` drafts, and each round delivers
``tau = k + 1`` tokens. A fractional tau mixes ``floor`` and ``floor + 1`` accepted per
round, chosen by the anchor token (a walk of a random permutation: a fair draw).

It is never a default: ``python -m runtime.bench --oracle-tau T`` names it in its output.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .errors import RequestError
from .models.dflash import DFlashDrafter, Proposal

MIX_RESOLUTION = 1000  # a fractional tau is met to 1/1000 of a round, in expectation


def continuation_table(successor: np.ndarray, length: int) -> np.ndarray:
    """``[V, length]``: row t is greedy decoding's next ``length`` tokens after token t."""
    table = np.empty((len(successor), length), dtype=np.int32)
    table[:, 0] = successor
    for i in range(1, length):
        table[:, i] = successor[table[:, i - 1]]
    return table


class OracleDrafter(DFlashDrafter):
    """A drafter whose drafts the verifier accepts ``tau - 1`` of, on average (see the module doc)."""

    def aim(self, successor: np.ndarray, tau: float) -> OracleDrafter:
        drafts = self.args.block_size - 1
        if not 1.0 <= tau <= drafts + 1:
            raise RequestError("oracle_tau", f"must lie in 1..{drafts + 1} (the block holds {drafts} drafts), got {tau}")
        self.tau = tau
        self._continuation = mx.array(continuation_table(successor, drafts))
        self._vocab = len(successor)
        self._accepted = math.floor(tau - 1)
        self._extra_per_mille = round((tau - 1 - self._accepted) * MIX_RESOLUTION)
        return self

    def propose(self, hidden: mx.array, anchors: mx.array, temperatures: mx.array | None = None,
                noise: mx.array | None = None, branches: int = 1,
                context: tuple[mx.array, mx.array] | None = None) -> Proposal:
        real = super().propose(hidden, anchors, temperatures, noise, branches, context)
        n = hidden.shape[1]
        anchors = anchors.astype(mx.int32)
        right = self._continuation[anchors][:, :n]
        accepted = self._accepted + (anchors % MIX_RESOLUTION < self._extra_per_mille).astype(mx.int32)
        wrong = mx.arange(n)[None] >= accepted[:, None]
        oracle = mx.where(wrong, (right + 1) % self._vocab, right)
        # a select on the real drafts (never negative) keeps the drafter's head and argmax in
        # the graph: without it, lazy evaluation would skip the cost this instrument measures
        return Proposal(mx.where(real.tokens < 0, real.tokens, oracle[:, None]), None)  # every block the oracle's
