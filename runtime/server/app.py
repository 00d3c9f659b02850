"""The FastAPI app: OpenAI-compatible completions over one embedded :class:`Engine`.

``create_app(engine, settings)`` takes an engine that is not yet started: the app's
lifespan enters it (``async with engine``) in the server's own event loop, warms it up
with a short greedy generation, and only then reports ``/health`` 200. On shutdown it
stops admitting (503 + Retry-After), drains the running requests for ``drain_timeout_s``,
ends the ones still open with an error (an error event on a stream, 503 otherwise), then
stops the engine.

What a request costs the event loop before it is admitted is bounded: the body is read up
to ``max_body_bytes`` (413 beyond), and JSON parsing and tokenization run in worker threads,
so a large body never stalls ``/health`` or the streams of others.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from protocol import GenerationParams, TokenEvent

from ..cache import GROWTH_STEP
from ..engine import Engine
from ..errors import ContextLengthError, RequestError, RuntimeErrorBase
from ..plain import check_context
from ..sampling import check_params
from ..speculative import block_size_for
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .schemas import ChatCompletionRequest, CompletionRequest, error_body

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
SHOWN_NAME_CHARS = 40  # an unknown model's name is echoed this far, never whole
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


WARM_CONTEXT = 4 * GROWTH_STEP  # buffer sizes traced at start-up; longer requests trace theirs when they get there
WARM_MARGIN = 40  # a warm-up prompt this far below a buffer size stays inside it for its few rounds


@dataclass
class ServerSettings:
    model_name: str | None = None  # the id clients pass as ``model``; None: the target's name
    max_concurrent: int = 8        # generations running at once in the engine
    max_queue: int = 64            # requests waiting for a slot; beyond: 429
    retry_after_s: int = 1
    default_max_tokens: int = 256  # when a request names none (capped by the context)
    block_size: int | None = None  # default speculative block; None: the drafter's
    warmup: bool = True
    drain_timeout_s: float = 30.0  # after a shutdown signal, open requests may finish this long
    queue_timeout_s: float = 60.0  # a request waits this long for a slot, then gets 503
    max_body_bytes: int = 4 * 1024 * 1024  # beyond: 413, before the body is parsed
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    allowed_hosts: list[str] | None = None  # Host header values accepted (DNS rebinding); None: any
    enable_docs: bool = False  # /docs and /openapi.json
    enable_internal_stats: bool = False  # /v1/internal/stats (engine internals, for tests and debugging)


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """A loopback server answers only to loopback names: a web page cannot reach it by a rebound DNS name."""
    return list(LOOPBACK_HOSTS) if bind_host in LOOPBACK_HOSTS else None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status, headers=self.headers)


class Admission:
    """At most ``max_concurrent`` generations at once and ``max_queue`` waiting; no new ones while draining."""

    def __init__(self, max_concurrent: int, max_queue: int, metrics: Metrics, retry_after_s: int) -> None:
        self.max_concurrent, self.max_queue, self.metrics = max_concurrent, max_queue, metrics
        self.min_retry_after = retry_after_s
        self.mean_service_s = float(retry_after_s)  # moving mean of a generation's time in its slot
        self.running = self.waiting = 0
        self.draining = False
        self._slots = anyio.Semaphore(max_concurrent)
        self._idle: anyio.Event | None = None  # set when the last request leaves (wait_idle waits on it)

    def retry_after(self) -> str:
        """Seconds until a slot is likely free: the queue ahead, served max_concurrent at a time."""
        ahead = (self.waiting + 1) / self.max_concurrent
        return str(min(60, max(self.min_retry_after, math.ceil(ahead * self.mean_service_s))))

    def unavailable(self, message: str) -> APIError:
        return APIError(503, message, type_="server_unavailable", headers={"Retry-After": self.retry_after()})

    async def acquire(self, timeout: float = math.inf) -> None:
        if self.draining:
            raise self.unavailable("the server is shutting down; retry on another instance")
        if self._slots.value == 0 and self.waiting >= self.max_queue:
            raise APIError(429, f"too many requests: {self.running} running and {self.waiting} queued "
                           f"(limits {self.max_concurrent} + {self.max_queue})", type_="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": self.retry_after()})
        self.waiting += 1
        self.metrics.set_queued(self.waiting)
        try:
            with anyio.move_on_after(timeout) as waited:
                await self._slots.acquire()
        finally:
            self.waiting -= 1
            self.metrics.set_queued(self.waiting)
            self._left()
        if waited.cancelled_caught:
            raise self.unavailable(f"no generation slot became free within {timeout:g} s")
        self.running += 1
        self.metrics.set_running(self.running)

    def release(self, service_s: float | None = None) -> None:
        if service_s is not None:
            self.mean_service_s += 0.2 * (service_s - self.mean_service_s)
        self.running -= 1
        self.metrics.set_running(self.running)
        self._slots.release()
        self._left()

    def _left(self) -> None:
        if self._idle is not None and not (self.running or self.waiting):
            self._idle.set()

    async def wait_idle(self, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            while self.running or self.waiting:
                self._idle = anyio.Event()
                await self._idle.wait()


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")))]
    return ".".join(parts) or None


def _parse(model: type, body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"malformed JSON body: {err['msg']}") from None
        loc = tuple(err["loc"])
        if not loc:
            raise APIError(400, "the request body must be a JSON object") from None
        param = _param(loc)
        if err["type"] == "missing":
            raise APIError(400, f"{param} is required", param=param) from None
        value = err.get("input")
        shown = json.dumps(value)[:80] if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
        raise APIError(400, f"{param}: {err['msg']} (got {shown})", param=param) from None


def _json_content_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {media_type[:40] or 'none'!r}",
                       code="unsupported_media_type")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit`` bytes."""
    too_large = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _shown(name: str) -> str:
    return repr(name if len(name) <= SHOWN_NAME_CHARS else name[:SHOWN_NAME_CHARS] + "...")


class ClientWatch:
    """Cancels ``scope`` once the client disconnects; ``gone`` says whether it did."""

    def __init__(self, receive: Any, scope: anyio.CancelScope) -> None:
        self.receive, self.scope = receive, scope
        self.gone = False

    async def watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.scope.cancel()


class _SSE(Response):
    """Server-sent events driven by ``run(send_event, receive)``; the client's disconnect is watched for."""

    media_type = "text/event-stream"

    def __init__(self, run: Callable[[Callable[[Any], Awaitable[None]], Any], Awaitable[None]]) -> None:
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def event(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        if await self.run(event, receive):
            try:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass


class Server:
    """State shared by the routes of one app."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.model_name = settings.model_name or engine.target.name
        self.metrics = Metrics(self.model_name)
        self.admission = Admission(settings.max_concurrent, settings.max_queue, self.metrics, settings.retry_after_s)
        self.ready = False
        self.created = int(time.time())
        self.open: set[anyio.CancelScope] = set()  # each queued or running request's scope, for a forced shutdown
        self.aborting = False
        self._shutdown: anyio.Event | None = None
        self._loop: Any = None

    # ---------------------------------------------------------------- shutdown

    def begin_shutdown(self) -> None:
        """Stop admitting; after ``drain_timeout_s`` end what is still open. Safe from a signal handler."""
        self.admission.draining = True
        if self._loop is not None and self._shutdown is not None:
            self._loop.call_soon_threadsafe(self._shutdown.set)

    async def end_open_requests_after_drain(self) -> None:
        self._loop = asyncio.get_running_loop()  # uvicorn serves on asyncio; its signal handler calls begin_shutdown
        self._shutdown = anyio.Event()
        await self._shutdown.wait()
        await anyio.sleep(self.settings.drain_timeout_s)
        self.aborting = True
        for scope in list(self.open):
            scope.cancel()

    def shut_down_error(self) -> APIError:
        return self.admission.unavailable(f"the server shut down before this request finished (drain timeout "
                                          f"{self.settings.drain_timeout_s:g} s)")

    # ---------------------------------------------------------------- requests

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def unknown_model(self, name: str) -> APIError:
        return APIError(404, f"the model {_shown(name)} does not exist; this server serves {self.model_name!r}",
                        param="model", code="model_not_found")

    def check_common(self, req: Any) -> None:
        if req.model != self.model_name:
            raise self.unknown_model(req.model)
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n")
        if req.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(req, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (must be 0)", param=name)

    def params(self, req: Any, prompt_ids: list[int], prompt_field: str) -> GenerationParams:
        limit = self.engine.target.model.args.max_position_embeddings
        tokens_field = "max_tokens" if req.max_tokens is not None or req.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        if max_tokens is None:
            max_tokens = max(1, min(self.settings.default_max_tokens, limit - len(prompt_ids)))
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
            raise APIError(400, f"seed must be in [0, 2**63 - 1], got {req.seed}", param="seed")
        block = req.block_size if req.block_size is not None else self.settings.block_size
        params = GenerationParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed, stop=stop,
            block_size=block)
        try:
            check_params(params)
            block_size_for(self.engine.drafter, params)
        except RequestError as exc:
            field = tokens_field if exc.field == "max_tokens" else exc.field
            raise APIError(400, str(exc).replace("max_tokens", field, 1), param=field) from None
        try:
            check_context(self.engine.target.model, len(prompt_ids), max_tokens)
        except ContextLengthError as exc:
            raise APIError(400, str(exc), param=prompt_field, code="context_length_exceeded") from None
        return params

    def refuse_overlong(self, text: str, field: str) -> None:
        """A text longer than the context can hold, at the longest token's length, is refused without
        tokenizing it (a megabyte of text costs a tokenizer seconds of CPU)."""
        limit = self.engine.target.model.args.max_position_embeddings
        tokenizer = self.engine.target.tokenizer
        if tokenizer.fewest_tokens(text) > limit:
            raise APIError(400, f"the prompt's {len(text)} characters cannot fit the model's context of {limit} "
                           f"tokens (no token here is longer than {tokenizer.max_token_chars} characters)",
                           param=field, code="context_length_exceeded")

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        self.refuse_overlong("".join(m["content"] for m in messages), "messages")
        try:
            return self.engine.encode(messages)
        except RuntimeErrorBase as exc:
            raise APIError(400, f"could not render the chat template: {exc}", param="messages") from None

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (batched prompts are not supported)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.refuse_overlong(prompt, "prompt")
            return self.engine.encode(prompt)
        vocab = self.engine.target.model.args.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        return list(prompt)

    # ---------------------------------------------------------------- generation

    async def admit(self, receive: Any) -> bool:
        """Wait for a slot (``queue_timeout_s`` at most); False if the client left meanwhile, which frees its place."""
        acquired = False
        refused: APIError | None = None  # raised after the task group, which would wrap it in a group
        with anyio.CancelScope() as scope:
            self.open.add(scope)
            try:
                async with anyio.create_task_group() as tg:
                    client = ClientWatch(receive, tg.cancel_scope)
                    tg.start_soon(client.watch)
                    try:
                        await self.admission.acquire(self.settings.queue_timeout_s)
                        acquired = True
                    except APIError as exc:
                        refused = exc
                    tg.cancel_scope.cancel()
            finally:
                self.open.discard(scope)
        if refused is not None:
            raise refused
        if self.aborting and not acquired:
            raise self.shut_down_error()
        if client.gone and acquired:
            self.admission.release()
        return acquired and not client.gone

    async def drive(self, prompt_ids: list[int], params: GenerationParams, receive: Any,
                    on_event: Callable[[TokenEvent], Awaitable[None]]) -> TokenEvent | None:
        """Run one generation; the final event, or None when the client went away (request cancelled)."""
        last: TokenEvent | None = None
        start = time.perf_counter()
        self.metrics.observe_prompt(len(prompt_ids))
        previous: float | None = None  # when the last tokens came; None until the first

        async with anyio.create_task_group() as tg:
            client = ClientWatch(receive, tg.cancel_scope)
            self.open.add(tg.cancel_scope)
            tg.start_soon(client.watch)
            events = self.engine.generate(prompt_ids, params)
            try:
                async for event in events:
                    if event.token_ids:
                        now = time.perf_counter()
                        if previous is None:
                            self.metrics.observe_first_token(now - start)
                        self.metrics.observe_tokens(len(event.token_ids), None if previous is None else now - previous)
                        previous = now
                    if event.finish_reason is not None:
                        last = event
                    try:
                        await on_event(event)
                    except OSError:  # the send failed: the client is gone
                        client.gone = True
                        break
                    if last is not None:
                        break
            finally:
                self.open.discard(tg.cancel_scope)
                await events.aclose()  # ends the engine request at once when it has not finished
            tg.cancel_scope.cancel()
        if self.aborting and last is None and not client.gone:
            self.metrics.observe_finish("error", {})
            raise self.shut_down_error()
        if client.gone and last is None:
            self.metrics.observe_finish("cancelled", {})
            return None
        if last is not None:
            self.metrics.observe_finish(last.finish_reason or "stop", dict(last.stats), time.perf_counter() - start)
        return last

    async def warm_up(self) -> None:
        """One short generation; where batched steps run at power-of-two sizes (a GPU), also one
        step of each size up to ``max_concurrent``; where steps are compiled (a GPU), all that at
        each KV buffer size up to WARM_CONTEXT, each of which has its own trace. So the first
        clients do not wait for kernels built per shape or steps traced per buffer size."""
        ids = self.engine.encode("Hello") or [0]
        sizes = [1]
        while self.engine.pads_batches and sizes[-1] < self.settings.max_concurrent:
            sizes.append(sizes[-1] * 2)
        prompts = [ids]
        if self.engine.compiles_steps:
            limit = self.engine.target.model.args.max_position_embeddings - WARM_MARGIN
            lengths = range(GROWTH_STEP - WARM_MARGIN, min(WARM_CONTEXT, limit) + 1, GROWTH_STEP)
            prompts = [(ids * n)[:n] for n in lengths] or prompts  # a prompt ending inside each buffer size
        for prompt in prompts:
            for size in sizes:
                async with anyio.create_task_group() as tg:
                    for _ in range(size):
                        tg.start_soon(self._warm_up_one, prompt)

    async def _warm_up_one(self, ids: list[int]) -> None:
        async for event in self.engine.generate(ids, GenerationParams(max_tokens=4, temperature=0.0)):
            if event.finish_reason == "error":
                raise RuntimeError(f"warm-up generation failed: {event.error}")


def _usage(event: TokenEvent | None) -> dict[str, int] | None:
    if event is None or event.usage is None:
        return None
    u = event.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens}


def _server_error(event: TokenEvent) -> APIError:
    return APIError(500, f"generation failed: {event.error}", type_="server_error")


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    server = Server(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine, anyio.create_task_group() as tg:
            tg.start_soon(server.end_open_requests_after_drain)
            if settings.warmup:
                await server.warm_up()
            server.ready = True
            try:
                yield
            finally:
                server.admission.draining = True
                await server.admission.wait_idle(settings.drain_timeout_s)
                server.ready = False
                tg.cancel_scope.cancel()

    docs = settings.enable_docs
    app = FastAPI(title="dflash-runtime", lifespan=lifespan, docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.server = server
    if settings.allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.allowed_hosts)
    authorized = [Depends(server.authorize)]

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)

    async def handle(request: Request, endpoint: str, chat: bool) -> Response:
        try:
            _json_content_type(request)
            body = await _read_body(request, settings.max_body_bytes)
            req = await anyio.to_thread.run_sync(_parse, ChatCompletionRequest if chat else CompletionRequest, body)
            server.check_common(req)
            prompt_ids = await anyio.to_thread.run_sync(server.chat_prompt if chat else server.completion_prompt, req)
            params = server.params(req, prompt_ids, "messages" if chat else "prompt")
            if not await server.admit(request.receive):
                server.metrics.requests.labels(endpoint, "499").inc()
                return Response(status_code=499)
        except APIError as exc:
            server.metrics.requests.labels(endpoint, str(exc.status)).inc()
            return exc.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        base = {"id": rid, "created": created, "model": server.model_name}
        if not req.stream:
            return await complete(request, endpoint, chat, prompt_ids, params, base)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _SSE(lambda send, receive: stream(endpoint, chat, prompt_ids, params, base, include_usage, send, receive))

    async def complete(request: Request, endpoint: str, chat: bool, prompt_ids: list[int], params: GenerationParams,
                       base: dict[str, Any]) -> Response:
        parts: list[str] = []

        async def on_event(event: TokenEvent) -> None:
            parts.append(event.text)

        start = time.perf_counter()
        try:
            last = await server.drive(prompt_ids, params, request.receive, on_event)
        except APIError as exc:  # ended by a shutdown
            server.metrics.requests.labels(endpoint, str(exc.status)).inc()
            return exc.response()
        finally:
            server.admission.release(time.perf_counter() - start)
        if last is None:
            server.metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        if last.finish_reason == "error":
            server.metrics.requests.labels(endpoint, "500").inc()
            return _server_error(last).response()
        server.metrics.requests.labels(endpoint, "200").inc()
        text = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": last.finish_reason}
            obj = {**base, "object": "chat.completion", "choices": [choice]}
        else:
            obj = {**base, "object": "text_completion", "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}]}
        obj["usage"] = _usage(last)
        obj["dflash"] = {"stats": dict(last.stats), "timings": dict(last.timings)}
        return JSONResponse(obj)

    async def stream(endpoint: str, chat: bool, prompt_ids: list[int], params: GenerationParams, base: dict[str, Any],
                     include_usage: bool, send: Callable[[Any], Awaitable[None]], receive: Any) -> bool:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = {**base, "object": kind, "choices": [choice]}
            if include_usage:
                obj["usage"] = None
            return obj

        async def on_event(event: TokenEvent) -> None:
            if event.finish_reason == "error":
                await send(error_body(f"generation failed: {event.error}", "server_error"))
                return
            if event.text:
                await send(chunk(event.text, None))
            if event.finish_reason is not None:
                await send(chunk(None if chat else "", event.finish_reason))

        start = time.perf_counter()
        try:
            if chat:
                try:
                    await send(chunk("", None, role=True))
                except OSError:
                    server.metrics.requests.labels(endpoint, "499").inc()
                    server.metrics.observe_finish("cancelled", {})
                    return False
            last = await server.drive(prompt_ids, params, receive, on_event)
        except APIError as exc:  # ended by a shutdown: the stream says so, then ends as streams do
            server.metrics.requests.labels(endpoint, str(exc.status)).inc()
            try:
                await send(error_body(exc.message, exc.type))
                await send("[DONE]")
            except OSError:
                return False
            return True
        finally:
            server.admission.release(time.perf_counter() - start)
        if last is None:
            server.metrics.requests.labels(endpoint, "499").inc()
            return False
        server.metrics.requests.labels(endpoint, "500" if last.finish_reason == "error" else "200").inc()
        try:
            if include_usage:
                await send({**base, "object": kind, "choices": [], "usage": _usage(last)})
            await send("[DONE]")
        except OSError:
            return False
        return True

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat", chat=True)

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request) -> Response:
        return await handle(request, "completions", chat=False)

    def model_card() -> dict[str, Any]:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "dflash-runtime"}

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=authorized)
    async def model(model_id: str) -> Response:
        if model_id != server.model_name:
            return server.unknown_model(model_id).response()
        return JSONResponse(model_card())

    @app.get("/health")
    async def health() -> Response:
        if server.ready and not server.admission.draining:
            return JSONResponse({"status": "ok", "model": server.model_name})
        status = "draining" if server.admission.draining else "loading"
        return JSONResponse({"status": status}, 503, headers={"Retry-After": str(settings.retry_after_s)})

    def engine_stats() -> dict[str, Any]:
        stats = engine.snapshot()
        server.metrics.engine_live.set(stats.live_requests)
        server.metrics.engine_cache.set(stats.cache_bytes)
        return {"live_requests": stats.live_requests, "cache_bytes": stats.cache_bytes,
                "discarded_rounds": stats.discarded_rounds}

    @app.get("/metrics")
    async def metrics() -> Response:
        engine_stats()
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def internal_stats() -> dict[str, Any]:
        return {"running": server.admission.running, "queued": server.admission.waiting,
                "draining": server.admission.draining, "ready": server.ready, "engine": engine_stats()}

    if settings.enable_internal_stats:
        app.get("/v1/internal/stats", dependencies=authorized)(internal_stats)

    return app
