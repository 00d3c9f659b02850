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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, NamedTuple, Sequence

import anyio
from anyio.abc import ObjectSendStream, TaskGroup

from actors import Committer, Drafter, Verifier
from actors.mailbox import make_inbox
from protocol import ActorMessage, Admit, Cancelled, GenerationParams, ModelIdentity, RequestRecord, TokenEvent

from .batching import default_pad_batches
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


class Schedule(NamedTuple):
    """How far a mode runs ahead of the committer."""

    lookahead: int  # rounds drafted beyond the last committed one
    verify_after_commit: bool = False  # round N+1 is verified only once round N is committed


# pipelined reads round N once N+1 is queued, pipelined2 once N+2 is (the host then waits on
# the device less often behind it), sequential at once; draft-ahead drafts N+1 before reading
# N but verifies it after: its cache writes then never land in buffers a queued verify still
# reads (MLX copies such a buffer whole rather than write it in place)
MODES = {"pipelined": Schedule(1), "sequential": Schedule(0), "pipelined2": Schedule(2),
         "draft-ahead": Schedule(1, verify_after_commit=True)}


@dataclass
class EngineStats:
    live_requests: int
    cache_bytes: int
    discarded_rounds: int


class Engine:
    def __init__(self, target: LoadedModel, drafter: DFlashDrafter, *, mode: str = "pipelined",
                 log: str | Path | None = None, drafter_identity: ModelIdentity | None = None,
                 pad_batches: bool | None = None) -> None:
        """``pad_batches``: run batched steps at power-of-two row counts (default: on a GPU only)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        self.target, self.drafter, self.mode = target, drafter, mode
        self.log = RunLog(log) if log else None
        self._drafter_identity = drafter_identity
        self._target_identity: ModelIdentity | None = None
        self._ids = itertools.count()
        self._task_group: TaskGroup | None = None
        self._inboxes: dict[str, ObjectSendStream[ActorMessage]] = {}
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
             log: str | Path | None = None, dtype: str = "auto", pad_batches: bool | None = None) -> "Engine":
        """Load the target (default SmolLM2-135M-Instruct) and the drafter (default: bundled)."""
        target = load_target(model or default_model_path(), dtype=dtype)
        spec = str(draft) if draft is not None else None
        drafter = resolve_drafter(spec, target)
        return cls(target, drafter, mode=mode, log=log, drafter_identity=drafter_identity(spec), pad_batches=pad_batches)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "Engine":
        drafter_send, drafter_recv = make_inbox()
        verifier_send, verifier_recv = make_inbox()
        committer_send, committer_recv = make_inbox()
        model = self.target.model
        schedule = MODES[self.mode]
        self.verifier = Verifier(model, self.drafter.tap_layers, verifier_recv, self._pad_batches,
                                 schedule.verify_after_commit)
        self.drafter_actor = Drafter(self.drafter, drafter_recv, schedule.lookahead, self._pad_batches)
        self.committer = Committer(self.target.tokenizer, len(self.drafter.tap_layers), model.args.hidden_size,
                                   committer_recv, log=self.log.write if self.log else None)
        self.verifier.committer, self.verifier.drafter_inbox, self.verifier.drafter = committer_send, drafter_send, self.drafter_actor
        self.drafter_actor.verifier_inbox, self.drafter_actor.verifier = verifier_send, self.verifier
        self.committer.acks = [drafter_send, verifier_send]
        self.committer.verifier, self.committer.drafter = self.verifier, self.drafter_actor
        for actor in (self.verifier, self.drafter_actor):
            actor.failures = committer_send
        self._inboxes = {"drafter": drafter_send, "verifier": verifier_send, "committer": committer_send}
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        for actor in (self.drafter_actor, self.verifier, self.committer):
            self._task_group.start_soon(actor.run)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Cancel what is still running, let the actors settle, then stop them."""
        assert self._task_group is not None
        for request_id in list(self.committer.requests):
            self.cancel(request_id)
        await self._quiesce()
        self._task_group.cancel_scope.cancel()
        result = await self._task_group.__aexit__(*exc_info)
        if self.log:
            self.log.close()
        return result

    async def _quiesce(self) -> None:
        """Wait until every inbox is empty: all messages sent so far have been handled."""
        while any(inbox.statistics().current_buffer_used for inbox in self._inboxes.values()):
            await anyio.sleep(0)
        await anyio.sleep(0)

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
        send, receive = anyio.create_memory_object_stream[TokenEvent](params.max_tokens + 8)
        self.committer.register(request_id, admit, send)
        self._log_request(admit)
        finished = False
        try:
            await self._inboxes["drafter"].send(admit)
            await self._inboxes["verifier"].send(admit)
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
        Messages still in flight for it are ignored by their receivers.
        """
        for actor in (self.committer, self.drafter_actor, self.verifier):
            actor.cancel(request_id)
        # an Admit still queued would bring the request back after this: a Cancelled queued
        # behind it drops it again; and the drafter, which may hold the other requests' next step for
        # this one (lockstep), then looks again at who is ready
        for name in ("drafter", "verifier"):
            try:
                self._inboxes[name].send_nowait(Cancelled(request_id=request_id))
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError, KeyError):
                pass  # a full inbox will bring a flush anyway; a closed one has no actor left

    async def stats(self) -> EngineStats:
        """Live requests and cache bytes, once the actors have handled what is in flight."""
        await self._quiesce()
        return self.snapshot()

    def snapshot(self) -> EngineStats:
        """Live requests and cache bytes now, without waiting (for scrapes while requests run)."""
        live = set(self.verifier.requests) | set(self.drafter_actor.requests) | set(self.committer.requests)
        return EngineStats(len(live), self.verifier.cache_bytes + self.drafter_actor.cache_bytes,
                           self.committer.discarded_rounds)

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
            n_taps=len(self.drafter.tap_layers), hidden_size=self.target.model.args.hidden_size,
        ))
