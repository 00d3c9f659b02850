"""The embedded async API: an engine that wires the drafter, verifier and committer actors.

    async with Engine.load() as engine:
        async for event in engine.generate("What is 2+2?", GenerationParams(max_tokens=32)):
            print(event.text, end="")

Works under asyncio and trio (anyio). Many generations may run at once; leaving the
``async for`` or cancelling its scope ends the request and frees its device state.
"""

from __future__ import annotations

import itertools
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, NamedTuple, Sequence

import anyio

from actors import Committer, Drafter, Verifier
from actors.mailbox import Actor, Outbox, make_inbox
from actors.rounds import DraftOutputs, RoundOutputs, RoundResults
from actors.schedule import MODES
from protocol import Admit, Cancelled, Drain, GenerationParams, ModelIdentity, RequestRecord, TokenEvent

from .batching import default_pad_batches
from .branches import check_branches
from .defaults import default_drafter_path, default_model_path
from .drafters import RANDOM_PREFIX, resolve_drafter
from .loading import LoadedModel, hash_folder, load_target
from .logs import RunLog
from .models.dflash import DFlashDrafter
from .plain import check_context
from .sampling import check_params, params_with
from .speculative import block_size_for


def drafter_identity(spec: str | None) -> ModelIdentity | None:
    """What a run log records of the drafter ``resolve_drafter(spec)`` loads (None for random:L: no weights to rerun)."""
    path = Path(spec) if spec is not None else default_drafter_path()
    if path is None or str(spec).startswith(RANDOM_PREFIX):
        return None
    return ModelIdentity(path.name, str(path), "dflash", hash_folder(path))


class Actors(NamedTuple):
    """The actors of one running engine, and the send ends of their inboxes that the engine keeps."""

    drafter: Drafter
    verifier: Verifier
    committer: Committer
    inboxes: dict[str, Outbox]  # the engine's own ends: Admit, Cancelled and Drain go in there
    senders: list[Outbox]  # every send end, the actors' included: closing them all ends the actors' loops


@dataclass
class EngineStats:
    live_requests: int
    cache_bytes: int
    discarded_rounds: int


class Engine:
    def __init__(self, target: LoadedModel, drafter: DFlashDrafter, *, mode: str = "pipelined",
                 log: str | Path | None = None, drafter_identity: ModelIdentity | None = None,
                 pad_batches: bool | None = None, branches: int = 1) -> None:
        """``pad_batches``: run batched steps at power-of-two row counts (default: on a GPU only).
        ``branches``: blocks each round drafts and verifies, keeping the one accepted furthest
        (runtime/branches.py; greedy requests, DFlash 1 drafters)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        check_branches(branches)
        self.target, self.drafter, self.mode, self.branches = target, drafter, mode, branches
        self.log = RunLog(log) if log else None
        self._drafter_identity = drafter_identity
        self._target_identity: ModelIdentity | None = None
        self._ids = itertools.count()
        self._drains = itertools.count()
        self._actors: Actors | None = None  # the latest run's (kept after it, for its final stats)
        self._exit: AsyncExitStack | None = None
        self._pad_batches = pad_batches

    @property
    def pads_batches(self) -> bool:
        """Whether batched steps run at power-of-two row counts (see runtime.batching)."""
        return default_pad_batches() if self._pad_batches is None else self._pad_batches

    @property
    def compiles_steps(self) -> bool:
        """Whether verify and draft forwards run as compiled steps (runtime.models.steps)."""
        return bool(self.target.model.compile_steps or self.drafter.compile_steps)

    @classmethod
    def load(cls, model: str | Path | None = None, draft: str | Path | None = None, *, mode: str = "pipelined",
             log: str | Path | None = None, dtype: str = "auto", pad_batches: bool | None = None,
             branches: int = 1) -> "Engine":
        """Load the target (default SmolLM2-135M-Instruct) and the drafter (default: bundled)."""
        check_branches(branches)
        target = load_target(model or default_model_path(), dtype=dtype)
        spec = str(draft) if draft is not None else None
        drafter = resolve_drafter(spec, target)
        return cls(target, drafter, mode=mode, log=log, drafter_identity=drafter_identity(spec), pad_batches=pad_batches,
                   branches=branches)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "Engine":
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._running())
            self._exit = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Cancel what is still running, let the actors settle, then close their inboxes."""
        assert self._exit is not None, "the engine is not running"
        return await self._exit.__aexit__(*exc_info)

    def _wire(self) -> Actors:
        """The actors, each given at construction the streams it sends on and the results it reads by handle."""
        (to_drafter, drafter_inbox), (to_verifier, verifier_inbox), (to_committer, committer_inbox) = (
            make_inbox(), make_inbox(), make_inbox())
        senders = [to_drafter, to_verifier, to_committer]

        def clone(stream: Outbox) -> Outbox:
            senders.append(stream.clone())
            return senders[-1]

        model, schedule = self.target.model, MODES[self.mode]
        drafts: RoundResults[DraftOutputs] = RoundResults()
        verified: RoundResults[RoundOutputs] = RoundResults()
        drafter = Drafter(self.drafter, schedule, drafter_inbox, verified=verified, verifier=clone(to_verifier),
                          committer=clone(to_committer), results=drafts, pad_batches=self._pad_batches,
                          branches=self.branches)
        verifier = Verifier(model, self.drafter.tap_layers, schedule, verifier_inbox, drafts=drafts,
                            drafter=clone(to_drafter), committer=clone(to_committer), results=verified,
                            pad_batches=self._pad_batches)
        committer = Committer(self.target.tokenizer, len(self.drafter.tap_layers), model.args.hidden_size, schedule,
                              committer_inbox, verified=verified, drafts=drafts,
                              acks=[clone(to_drafter), clone(to_verifier)], log=self.log.write if self.log else None)
        inboxes = {"drafter": to_drafter, "verifier": to_verifier, "committer": to_committer}
        return Actors(drafter, verifier, committer, inboxes, senders)

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        actors = self._wire()
        try:
            async with anyio.create_task_group() as tg:
                for actor in (actors.drafter, actors.verifier, actors.committer):
                    tg.start_soon(actor.run)
                self._actors = actors
                try:
                    yield
                finally:
                    try:
                        for request_id in list(actors.committer.requests):
                            self.cancel(request_id)
                        await self._settle()
                    finally:
                        self._exit = None
                        for stream in actors.senders:  # the inboxes end: each actor's loop, then the group
                            stream.close()
        finally:
            if self.log:
                self.log.close()

    def _running_actors(self) -> Actors:
        if self._actors is None or self._exit is None:
            raise RuntimeError("the engine is not running: use it as `async with engine:`")
        return self._actors

    async def _settle(self) -> None:
        """Wait until the actors have handled every message sent so far, and those they sent in turn.

        A round trip per actor (a ``Drain`` each handles once it has flushed what came before
        it), repeated until a whole pass finds nothing new handled.
        """
        actors = self._actors
        if actors is None or self._exit is None:
            return
        order = [("drafter", actors.drafter), ("verifier", actors.verifier), ("committer", actors.committer)]
        while True:
            handled = sum(actor.handled for _, actor in order)
            for name, actor in order:
                await self._drain(actors.inboxes[name], actor)
            if sum(actor.handled for _, actor in order) == handled:
                return

    async def _drain(self, inbox: Outbox, actor: Actor) -> None:
        seq = next(self._drains)
        drained = actor.expect_drain(seq)
        await inbox.send(Drain(seq=seq))
        await drained.wait()

    # ------------------------------------------------------------------ the API

    def encode(self, prompt: str | Sequence[dict[str, Any]] | Sequence[int]) -> list[int]:
        """Text (raw), chat messages (templated) or token ids, to prompt token ids."""
        tok = self.target.tokenizer
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, dict)):
            raise TypeError(f"prompt must be text, a list of chat messages or a list of token ids, "
                            f"not {type(prompt).__name__}")
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return tok.encode(tok.apply_chat_template(items), add_special_tokens=False)  # type: ignore[arg-type]
        return [int(t) for t in items]  # type: ignore[arg-type]

    async def generate(self, prompt: str | Sequence[dict[str, Any]] | Sequence[int],
                       params: GenerationParams | None = None, **fields: Any) -> AsyncIterator[TokenEvent]:
        """Stream token events; the last one has ``finish_reason`` (and usage, timings, stats).

        ``fields`` are GenerationParams' own, as keywords (``max_tokens=64, temperature=0.7``),
        over ``params`` when both are given. A wrong type raises TypeError naming the argument;
        invalid values, a block larger than the drafter's and a prompt that does not fit the
        context raise (``RequestError``, ``ContextLengthError``) before anything is admitted.
        """
        params = params_with(params, fields)
        prompt_ids = self.encode(prompt)
        check_params(params)
        block_size_for(self.drafter, params)
        check_context(self.target.model, len(prompt_ids), params.max_tokens)
        request_id = f"req-{next(self._ids)}"
        admit = Admit(request_id=request_id, prompt_ids=prompt_ids, params=params)
        actors = self._running_actors()
        send, receive = anyio.create_memory_object_stream[TokenEvent](params.max_tokens + 8)
        actors.committer.register(request_id, admit, send)
        self._log_request(admit)
        finished = False
        try:
            await actors.inboxes["drafter"].send(admit)
            await actors.inboxes["verifier"].send(admit)
            async for event in receive:
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(request_id)
            receive.close()  # synchronous: no checkpoint between cancelling and closing

    def cancel(self, request_id: str) -> None:
        """End a request now: every actor drops its state at once.

        Synchronous on purpose: it runs in ``finally`` blocks of cancelled callers, where
        awaiting is not possible, and it frees the request's device memory immediately.
        Messages still in flight for it are ignored by their receivers. Each actor drops its
        own state (``drop``): the engine calls it on the actors it made, none reaches another.
        """
        actors = self._actors
        if actors is None:
            return
        actors.committer.drop(request_id, rounds_started=actors.drafter.rounds_started(request_id))
        actors.drafter.drop(request_id)
        actors.verifier.drop(request_id)
        # an Admit still queued would bring the request back after this: a Cancelled queued
        # behind it drops it again; and the drafter, which may hold the other requests' next step for
        # this one (lockstep), then looks again at who is ready
        for name in ("drafter", "verifier"):
            try:
                actors.inboxes[name].send_nowait(Cancelled(request_id=request_id))
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError, KeyError):
                pass  # a full inbox will bring a flush anyway; a closed one has no actor left

    async def stats(self) -> EngineStats:
        """Live requests and cache bytes, once the actors have handled what is in flight."""
        await self._settle()
        return self.snapshot()

    def snapshot(self) -> EngineStats:
        """Live requests and cache bytes now, without waiting (for scrapes while requests run)."""
        actors = self._actors
        if actors is None:
            return EngineStats(0, 0, 0)
        live = set(actors.verifier.requests) | set(actors.drafter.requests) | set(actors.committer.requests)
        return EngineStats(len(live), actors.verifier.cache_bytes + actors.drafter.cache_bytes,
                           actors.committer.discarded_rounds)

    def _log_request(self, admit: Admit) -> None:
        if self.log is None:
            return
        if self._target_identity is None:
            t = self.target
            self._target_identity = ModelIdentity(t.name, str(t.source), t.format, t.content_hash())
        params = admit.params
        self.log.write(RequestRecord(
            request_id=admit.request_id, time=time.time(), target=self._target_identity,
            drafter=self._drafter_identity, params=params, seed=params.seed if params.seed is not None else -1,
            prompt_ids=admit.prompt_ids, mode=self.mode, block_size=block_size_for(self.drafter, params),
            n_taps=len(self.drafter.tap_layers), hidden_size=self.target.model.args.hidden_size, branches=self.branches,
        ))
