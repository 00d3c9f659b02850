"""Structured log records: one per request, one per round, one per finish.

Enough for ``python -m runtime.replay`` to rebuild a run without the models.
"""

from __future__ import annotations

import msgspec

from .messages import SCHEMA_VERSION
from .params import GenerationParams


class ModelIdentity(msgspec.Struct, frozen=True):
    name: str
    path: str
    format: str
    sha256: str


class Record(msgspec.Struct, tag_field="event", kw_only=True, frozen=True):
    v: int = SCHEMA_VERSION
    request_id: str
    time: float


class RequestRecord(Record, tag="request"):
    target: ModelIdentity
    drafter: ModelIdentity | None
    params: GenerationParams
    seed: int
    prompt_ids: list[int]
    mode: str
    block_size: int
    n_taps: int
    hidden_size: int
    branches: int = 1  # blocks each round verified (runtime/branches.py)


class RoundRecord(Record, tag="round"):
    round: int
    anchor_pos: int
    block_size: int
    drafts: list[int]
    target_tokens: list[int]
    accepted: int
    committed: list[int]
    target_kv_before: int
    target_kv_after: int
    drafter_ctx_before: int
    drafter_ctx_after: int
    new_ctx_rows: int
    tap_shape: list[int]
    greedy: bool
    speculative: bool
    draft_queued: float
    draft_ready: float | None  # known only when the host waited for the draft (sequential mode)
    verify_queued: float
    verify_ready: float
    commit: float
    batch_size: int = 1  # requests verified in the same target forward
    branch: int = 0  # which of the blocks the round verified it kept (runtime/branches.py)


class FinishRecord(Record, tag="finish"):
    finish_reason: str
    token_ids: list[int]
    text: str
    rounds: int
    error: str | None = None
    # speculative rounds the drafter had started after the last committed one (work the
    # finish threw away); None: not logged by this committer
    discarded_rounds: int | None = None


LogRecord = RequestRecord | RoundRecord | FinishRecord
