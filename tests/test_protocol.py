"""Messages and records round-trip through JSON and msgpack; bad input is rejected clearly."""

from __future__ import annotations

import msgspec
import pytest

from protocol import (Admit, Cancelled, Drafted, Failed, FinishRecord, GenerationParams, ModelIdentity, Prefilled,
                      ProtocolError, RequestRecord, RoundAck, RoundRecord, VerdictQueued, Verified, messages, records)

MESSAGES = [
    Admit(request_id="r1", prompt_ids=[1, 2, 3], params=GenerationParams(max_tokens=8, temperature=0.7, stop=("\n",))),
    Prefilled(request_id="r1", queued_at=1.5),
    Drafted(request_id="r1", round=0, block_size=16, speculative=False, draft_queued_at=2.0),
    Verified(request_id="r1", round=0, block_size=16, speculative=True, draft_queued_at=2.0, verify_queued_at=2.1),
    VerdictQueued(request_id="r1", round=3),
    RoundAck(request_id="r1", round=3, finished=False, target_kv=40, drafter_ctx=38, generated=9),
    Cancelled(request_id="r1"),
    Failed(request_id="r1", error="verifier: boom", kind="RuntimeError"),
]
IDENTITY = ModelIdentity("m", "/m", "gguf", "ab" * 32)
RECORDS = [
    RequestRecord(request_id="r1", time=1.0, target=IDENTITY, drafter=None, params=GenerationParams(), seed=-1,
                  prompt_ids=[1], mode="pipelined", block_size=16, n_taps=5, hidden_size=576),
    RoundRecord(request_id="r1", time=2.0, round=0, anchor_pos=4, block_size=4, drafts=[1, 2, 3], target_tokens=[1, 9, 3, 4],
                accepted=1, committed=[1, 9], target_kv_before=4, target_kv_after=6, drafter_ctx_before=0,
                drafter_ctx_after=4, new_ctx_rows=2, tap_shape=[4, 128], greedy=True, speculative=False,
                draft_queued=0.1, draft_ready=None, verify_queued=0.2, verify_ready=0.3, commit=0.31),
    FinishRecord(request_id="r1", time=3.0, finish_reason="stop", token_ids=[1, 9], text="ab", rounds=1),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json_and_msgpack(message: msgspec.Struct) -> None:
    assert messages.from_json(messages.to_json(message)) == message
    assert messages.from_msgpack(messages.to_msgpack(message)) == message


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_log_record_round_trips(record: msgspec.Struct) -> None:
    assert records.from_json(records.to_json(record)) == record
    assert records.from_msgpack(records.to_msgpack(record)) == record


def test_every_message_carries_the_schema_version() -> None:
    assert all(b'"v":1' in messages.to_json(m) for m in MESSAGES)


@pytest.mark.parametrize("data,match", [
    (b'{"type":"teleport","request_id":"x"}', "teleport"),
    (b'{"type":"ack","request_id":"x","round":"three","finished":false}', "round"),
    (b'{"type":"ack","request_id":"x"}', "round"),
    (b'{"type":"ack","request_id":"x","round":1,"finished":true,"v":99}', "schema version 99"),
    (b'{"type":"ack", "request_id"', "truncated|malformed|JSON"),
    (b'[1, 2]', "Expected `object`"),
])
def test_unknown_or_malformed_messages_are_rejected_with_a_clear_error(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        messages.from_json(data)


def test_device_arrays_cannot_travel_in_a_message() -> None:
    import mlx.core as mx

    smuggled = Drafted(request_id="r", round=mx.array(1), block_size=4, speculative=False, draft_queued_at=0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        messages.to_json(smuggled)
