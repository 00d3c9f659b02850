"""What every actor shares: an inbox loop that isolates failures to their request.

An actor handles every message already in its inbox before it ``flush``es: the
drafter and the verifier record what became ready and run it in one batched forward
at the flush, so the rounds of many requests share each forward. The loop ends when
every sender has closed its end of the inbox (docs/actors.md, "Lifecycle").
"""

from __future__ import annotations

import traceback
from typing import Any, Awaitable, Callable, Generic, Iterable, Protocol, Sequence, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from protocol import ActorMessage, Drain, Failed

from .rounds import RoundResults

INBOX_SIZE = 256  # bounded: a flood of requests applies backpressure to their senders

Inbox = MemoryObjectReceiveStream[ActorMessage]
Outbox = MemoryObjectSendStream[ActorMessage]


def make_inbox() -> tuple[Outbox, Inbox]:
    return anyio.create_memory_object_stream[ActorMessage](INBOX_SIZE)


class Actor:
    """Reads its inbox until it closes; ``handle`` errors become ``Failed`` for that request.

    ``failures``: where ``Failed`` goes (the committer's inbox); None: failures raise.
    """

    name = "actor"

    def __init__(self, inbox: Inbox, failures: Outbox | None = None) -> None:
        self.inbox = inbox
        self.failures = failures
        self.handled = 0  # messages handled, drains aside
        self._drains: dict[int, anyio.Event] = {}
        self._drained: list[int] = []

    async def run(self) -> None:
        async with self.inbox:
            async for message in self.inbox:
                await self._take(message)
                # the rest already waiting, read without a trip through the event loop each (a
                # receive yields first): a batched round brings a few messages per request
                while (message := self._waiting()) is not None:
                    await self._take(message)
                if not self.inbox.statistics().current_buffer_used:
                    await self.flush()
                    for seq in self._drained:
                        self._drains.pop(seq).set()
                    self._drained.clear()

    def _waiting(self) -> ActorMessage | None:
        try:
            return self.inbox.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            return None

    async def _take(self, message: ActorMessage) -> None:
        if isinstance(message, Drain):
            self._drained.append(message.seq)
        else:
            self.handled += 1
            await self._isolated(message.request_id, self.handle, message)

    def expect_drain(self, seq: int) -> anyio.Event:
        """The event set once ``Drain(seq)`` and everything before it in the inbox are handled and flushed."""
        event = self._drains[seq] = anyio.Event()
        return event

    async def handle(self, message: Any) -> None:
        raise NotImplementedError

    async def flush(self) -> None:
        """Run the work that the messages handled so far made ready (batching actors)."""

    async def _isolated(self, request_id: str, work: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await work(*args)
        except Exception as exc:  # noqa: BLE001  (isolate: one request fails, the actor lives)
            await self.report_failure(request_id, exc)
            self.forget(request_id)

    async def run_batch(self, request_ids: Sequence[str], work: Callable[[list[str]], Awaitable[None]]) -> None:
        """``work`` for many requests in one go; if it fails, once per request, so only the faulty one fails.

        Batched work must leave its members as they were when it fails (the drafter and
        verifier restore their caches' snapshots), so each retry starts clean.
        """
        ids = list(request_ids)
        if len(ids) == 1:
            await self._isolated(ids[0], work, ids)
            return
        try:
            await work(ids)
        except Exception:  # noqa: BLE001
            for request_id in ids:
                await self._isolated(request_id, work, [request_id])

    def forget(self, request_id: str) -> None:
        """Drop every piece of state this actor holds for the request."""

    def drop(self, request_id: str) -> None:
        """The caller left: drop the request now (late messages about it are then ignored).

        Called by the engine, synchronously, from the ``finally`` of a cancelled caller.
        """
        self.forget(request_id)

    async def report_failure(self, request_id: str, exc: Exception) -> None:
        if self.failures is None:
            raise exc
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            await self.failures.send(Failed(request_id=request_id, error=f"{self.name}: {detail}", kind=type(exc).__name__))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # shutting down: nobody is left to tell


async def send_burst(stream: Outbox, messages: Iterable[ActorMessage]) -> None:
    """Send without yielding between messages, so the receiver finds a step's messages together."""
    for message in messages:
        await send_soon(stream, message)


async def send_soon(stream: Outbox, message: ActorMessage) -> None:
    """Send without yielding unless the inbox is full (a send yields first: a trip through the
    event loop per message, which at 32 requests a round is a share of the round's host time)."""
    try:
        stream.send_nowait(message)
    except anyio.WouldBlock:
        await stream.send(message)


class OwnedRequest(Protocol):
    """Per-request device state: its caches."""

    cache: list[Any]


RequestT = TypeVar("RequestT", bound=OwnedRequest)
OutputT = TypeVar("OutputT")


class DeviceStateOwner(Actor, Generic[RequestT, OutputT]):
    """An actor that owns requests' device state; others read its round results by handle."""

    def __init__(self, inbox: Inbox, failures: Outbox | None = None,
                 results: RoundResults[OutputT] | None = None) -> None:
        super().__init__(inbox, failures)
        self.requests: dict[str, RequestT] = {}
        self.results: RoundResults[OutputT] = RoundResults() if results is None else results  # written here only

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.results.drop(request_id)

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for r in self.requests.values() for c in r.cache)
