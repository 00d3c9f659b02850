"""What every actor shares: an inbox loop that isolates failures to their request."""

from __future__ import annotations

import traceback
from typing import Any, Generic, Protocol, TypeVar

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from protocol import ActorMessage, Failed

INBOX_SIZE = 256  # bounded: a flood of requests applies backpressure to their senders


def make_inbox() -> tuple[ObjectSendStream[ActorMessage], ObjectReceiveStream[ActorMessage]]:
    return anyio.create_memory_object_stream[ActorMessage](INBOX_SIZE)


class Actor:
    """Reads its inbox until it closes; ``handle`` errors become ``Failed`` for that request."""

    name = "actor"

    def __init__(self, inbox: ObjectReceiveStream[ActorMessage]) -> None:
        self.inbox = inbox
        self.failures: ObjectSendStream[ActorMessage] | None = None  # where Failed goes (the committer)

    async def run(self) -> None:
        async with self.inbox:
            async for message in self.inbox:
                try:
                    await self.handle(message)
                except Exception as exc:  # noqa: BLE001  (isolate: one request fails, the actor lives)
                    await self.report_failure(message.request_id, exc)
                    self.forget(message.request_id)

    async def handle(self, message: Any) -> None:
        raise NotImplementedError

    def forget(self, request_id: str) -> None:
        """Drop every piece of state this actor holds for the request."""

    def cancel(self, request_id: str) -> None:
        """The caller left: drop the request now (late messages about it are then ignored)."""
        self.forget(request_id)

    async def report_failure(self, request_id: str, exc: Exception) -> None:
        if self.failures is None:
            raise exc
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        await self.failures.send(Failed(request_id=request_id, error=f"{self.name}: {detail}", kind=type(exc).__name__))


class OwnedRequest(Protocol):
    """Per-request device state: caches, and the outputs of rounds not yet consumed."""

    cache: list[Any]
    outputs: dict[int, Any]


RequestT = TypeVar("RequestT", bound=OwnedRequest)


class DeviceStateOwner(Actor, Generic[RequestT]):
    """An actor that owns requests' device state; others read its round outputs by handle."""

    def __init__(self, inbox: ObjectReceiveStream[ActorMessage]) -> None:
        super().__init__(inbox)
        self.requests: dict[str, RequestT] = {}

    def outputs(self, request_id: str, round: int) -> Any:
        return self.requests[request_id].outputs[round]

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for r in self.requests.values() for c in r.cache)
